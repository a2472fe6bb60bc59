"""The one atomic writer of vramsweep (temp file in the same folder, fsync, ``os.replace``, folder fsync):
results, sweep files, reports, production outputs, markers, the vocabulary slice's id map and the data
cache's pickles all write through :func:`atomic_write_text` (or :func:`atomic_write_bytes`).
Two writers stay apart on purpose: the fork server's status file (``sweeper/zygote.py``: it imports nothing
of vramsweep before its preload), and a production checkpoint (``production/checkpoint.py``: a whole folder
is staged and renamed; it uses :func:`fsync_dir`). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it (Linux ``/proc``); else set-and-restore."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: :func:`atomic_write_bytes` of its encoding."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder + fsync + ``os.replace``, then
    the folder fsynced): a reader sees the old file or the new one, never half, and after a crash the new
    one is on disk. ``durable=False`` leaves out both fsyncs (a marker that only has to outlive its
    process: still never half, much cheaper). The file gets the mode a plain ``open()`` would give it
    (``0666`` minus the umask), not ``mkstemp``'s private ``0600``: a team sharing a results folder can
    read it. The temp file (``.<name>.<random>.tmp``) goes again on any error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        with contextlib.suppress(OSError):  # a folder that cannot be opened or fsynced (some network mounts)
            fsync_dir(path.parent)
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder, so a rename into it (or out of it) survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
