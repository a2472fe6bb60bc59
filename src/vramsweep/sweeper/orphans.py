"""Launcher jobs that outlive their sweeper (issue 40 item 1).

Launcher mode records each trial's job in the study (system attribute :data:`.launch.JOB`,
:func:`.launch.job_record`: ``{"kind": "local",
"pid", "host", "ctime"}`` for a ``submitit_local`` job, ``{"kind": "slurm", "id"}`` for a SLURM one) when it
is submitted. A sweeper that died (SIGKILL, a lost node) or could not cancel a job on SIGTERM/Ctrl-C leaves
the trial RUNNING; the re-run reconciles it (:meth:`.study.StudyBook._reap`) and first adopts its job with
:func:`stop_orphan`: a job still running is cancelled and waited for, so its point is never run twice (the
retry starts only once the orphan is gone; an orphan that finished meanwhile is told from its result
file). A job that cannot be stopped keeps its trial RUNNING, and the re-run says so.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from typing import Any

from vramsweep.sweeper.launch import QUEUED_STATES, slurm_state
from vramsweep.sweeper.storage import owner_alive

#: Seconds an orphan gets to go after it was told to.
STOP_WAIT_S = 20.0


def _local_tree(rec: dict[str, Any]) -> list[Any]:
    """The job's controller process and its descendants while it is the recorded one (``[]``: gone)."""
    import psutil

    if not owner_alive(rec):
        return []
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(int(rec["pid"]))
        return [proc, *proc.children(recursive=True)]
    return []


def _stop_local(rec: dict[str, Any]) -> str | None:
    import psutil

    tree = _local_tree(rec)
    if not tree:
        return None
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(tree, timeout=STOP_WAIT_S)
    return f"processes {' '.join(str(p.pid) for p in alive)} survived SIGKILL" if alive else None


def _stop_slurm(rec: dict[str, Any]) -> str | None:
    job_id = str(rec["id"])
    state = slurm_state(job_id)
    if state is None or (state != "?" and state.split("+")[0] not in QUEUED_STATES):
        return None
    try:
        p = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scancel {job_id} failed: {exc}"
    if p.returncode != 0:
        return f"scancel {job_id} failed: {' '.join((p.stderr or p.stdout).split())[:300]}"
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        state = slurm_state(job_id)
        if state is None or (state != "?" and state.split("+")[0] not in QUEUED_STATES):
            return None
        time.sleep(1.0)
    return f"job {job_id} still {state} {STOP_WAIT_S:.0f} s after scancel"


def pending_first(rec: Any) -> int:
    """Sort key for stopping several recorded jobs: a SLURM job still PENDING (0) before the others (1).
    Stopping a RUNNING job first frees its node, and the scheduler may start a PENDING one of the same
    sweep before its own ``scancel`` comes: its point would start a second time, only to be cancelled."""
    if isinstance(rec, dict) and rec.get("kind") == "slurm" and "id" in rec:
        state = slurm_state(str(rec["id"]))
        return 0 if state is not None and state.split("+")[0] == "PENDING" else 1
    return 1


def stop_orphan(rec: Any) -> tuple[bool, str | None]:
    """Stop a recorded job that may still run: ``(was running, why it could not be stopped or None)``."""
    if not isinstance(rec, dict) or "id" not in rec:
        return False, None
    if rec.get("kind") == "slurm":
        state = slurm_state(str(rec["id"]))
        running = state == "?" or (state is not None and state.split("+")[0] in QUEUED_STATES)
        return running, (_stop_slurm(rec) if running else None)
    if rec.get("host") is not None:
        if rec["host"] != socket.gethostname():
            return False, None  # another machine's local job: its sweeper's host decides
    running = bool(_local_tree(rec))
    return running, (_stop_local(rec) if running else None)
