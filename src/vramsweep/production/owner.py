"""One owner per run folder (docs/RUNS.md "Who owns a run folder").

:func:`claim` is called by ``vramsweep train`` (and the SLURM job of a production run) before anything is
built or written:

1. ``run.lock`` in the folder is taken with ``flock`` (exclusive, non-blocking) and held for the run's life;
   it records the holder (pid, host, start time, command). A second start while it is held exits 2 naming
   the holder. The kernel drops the lock when the process ends, ``kill -9`` included, so a dead run never
   blocks its folder (on NFS, Linux emulates ``flock`` with byte-range locks the server keeps).
2. Under the lock, what the folder holds decides: a **finished** run (``result.json`` with status ``ok``) or
   a **stopped** one (a complete checkpoint) with ``train.resume=never`` exits 2 before anything is written,
   suggesting ``train.resume=auto`` or a new folder; a finished run with ``train.resume=auto`` is complete:
   nothing is written and the command says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vramsweep.config.errors import ConfigError
from vramsweep.record.status import Status

LOCK_FILE = "run.lock"
RESULT_FILE = "result.json"


class RunFolderError(ConfigError):
    """A run folder another run owns, or one whose run would be lost (exit 2, nothing written)."""


@dataclass
class Claim:
    """The outcome of :func:`claim`: ``complete`` (a finished run, ``train.resume=auto``: nothing to do,
    ``result`` is its result) or an owned folder (``fd`` holds the lock until :meth:`release`)."""

    run_dir: Path
    fd: int | None = None
    complete: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    note: str | None = None  # said once on stderr when the folder could not be locked

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # releases the flock
            self.fd = None


def _holder_text(lock: Path) -> str:
    try:
        h = json.loads(lock.read_text())
        return f"pid {h.get('pid')} on host {h.get('host')} since {h.get('started')}"
    except (OSError, ValueError, AttributeError):
        return "another process (its record in the lock file is unreadable)"


def _open(lock: Path, *, create: bool) -> int | None:
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        return os.open(lock, flags, 0o644)
    except FileNotFoundError:
        return None


def _lock(fd: int, lock: Path) -> bool:
    """Take the flock (False: this filesystem has none); a held lock is a :class:`RunFolderError`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderError(
            f"train.output_dir={lock.parent} is in use: a run holds it ({_holder_text(lock)}; lock "
            f"{lock}). Wait for it to end or stop it, or give this run another train.output_dir",
            key="train.output_dir",
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    return True


def read_result(run_dir: Path) -> dict[str, Any] | None:
    try:
        res = json.loads((Path(run_dir) / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) else None


def _stopped_at(run_dir: Path) -> Path | None:
    from vramsweep.production.checkpoint import latest_checkpoint

    return latest_checkpoint(Path(run_dir))


def check_contents(run_dir: Path, resume: str) -> dict[str, Any] | None:
    """The finished run's result (``resume=auto``: complete), None (a run may start or resume here), or a
    :class:`RunFolderError` (``resume=never`` over a finished or stopped run)."""
    res = read_result(run_dir)
    finished = res is not None and res.get("status") == Status.OK
    if finished and resume == "auto":
        return res
    if resume != "never":
        return None
    if finished:
        raise RunFolderError(
            f"train.output_dir={run_dir} holds a finished run (status ok, {run_dir / RESULT_FILE}): "
            "train.resume=never would overwrite it. train.resume=auto says it is complete and changes "
            "nothing; to train again give a new train.output_dir",
            key="train.resume",
            allowed=["auto", "never (with a new train.output_dir)"],
        )
    ckpt = _stopped_at(run_dir)
    if ckpt is not None:
        raise RunFolderError(
            f"train.output_dir={run_dir} holds a stopped run (checkpoint {ckpt}): train.resume=never would "
            "start it over and mix its files. train.resume=auto continues it; to start over give a new "
            "train.output_dir",
            key="train.resume",
            allowed=["auto", "never (with a new train.output_dir)"],
        )
    return None


def _record_holder(fd: int) -> None:
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:2000],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)


def claim(run_dir: str | os.PathLike, resume: str) -> Claim:
    """Own ``run_dir`` for a run with ``train.resume=resume`` (see the module docstring). Nothing is written
    unless the run may start: the folder and ``run.lock`` are made, the holder recorded, the lock kept."""
    run_dir = Path(run_dir).absolute()
    lock = run_dir / LOCK_FILE
    fd = _open(lock, create=False)  # an existing lock: taken before the folder is read
    try:
        locked = fd is not None and _lock(fd, lock)
        done = check_contents(run_dir, resume)
        if done is not None:
            if fd is not None:
                os.close(fd)
            return Claim(run_dir, complete=True, result=done)
        if fd is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = _open(lock, create=True)
            assert fd is not None
            locked = _lock(fd, lock)
            done = check_contents(run_dir, resume)  # again, under the lock: a run that ended meanwhile
            if done is not None:
                os.close(fd)
                return Claim(run_dir, complete=True, result=done)
    except BaseException:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    _record_holder(fd)
    if not locked:
        return Claim(run_dir, fd=fd, note=f"{lock}: this filesystem has no flock; the folder is not locked")
    from vramsweep.production.checkpoint import remove_dead_staging

    gone = remove_dead_staging(run_dir)  # the lock is ours: every staging folder here is a dead writer's
    note = (
        f"removed {len(gone)} staging folder(s)/temporary file(s) of a dead run: {gone[0].name}"
        if gone
        else None
    )
    return Claim(run_dir, fd=fd, note=note)


def complete_line(claim: Claim) -> str:
    """What ``train.resume=auto`` on a finished run says (one line)."""
    res = claim.result
    steps = ((res.get("config") or {}).get("train") or {}).get("steps")
    when = (res.get("meta") or {}).get("finished")
    return (
        f"run folder {claim.run_dir} holds a complete run (status ok, {steps} steps, finished {when}): "
        f"nothing to do, nothing changed. result: {claim.run_dir / RESULT_FILE}"
    )
