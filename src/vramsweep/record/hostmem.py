"""Host memory of a trial process: its resident set, and the trace it leaves while its pinned pool grows.

1. :func:`process_rss`: the process's resident set now and its peak (``VmRSS`` / ``VmHWM`` of
   ``/proc/self/status``; the peak of a forked trial starts at what it shared with its fork server when it
   was forked). Every trial records it in ``meta.host_memory`` (docs/CONTRACTS.md).
2. The host-pool marker: while ``checkpointing=offload``'s host pool is being allocated and page-locked
   (``cudaHostRegister`` faults every page in) a trial process writes ``{"state": "growing", ...}`` to the
   file named by :data:`MARKER_ENV` (the sweeper sets it to :func:`marker_path` of the trial's result), and
   ``"held"`` once every page is resident. Real exhaustion there ends in the kernel's OOM killer, a SIGKILL
   with no result JSON; the sweeper reads the marker and records ``host_oom`` instead of ``error``
   (:func:`vramsweep.sweeper.outcome.died_status`).

Torch-free and stdlib-only: the sweeper process reads the marker, the trial process writes it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from vramsweep.record.atomic import atomic_write_text

#: Environment variable naming the file a trial process writes its host-pool progress to.
MARKER_ENV = "VRAMSWEEP_HOST_POOL_MARKER"
#: Marker states: the pool is being allocated / page-locked, every page is resident, it failed.
GROWING, HELD, FAILED = "growing", "held", "failed"


class HostMemoryError(RuntimeError):
    """Host (pinned) memory for the offloaded layer inputs could not be allocated or page-locked: the trial
    ends ``host_oom`` (:mod:`vramsweep.record.failure`), not ``oom`` (device memory)."""


def _proc_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """``key: value kB`` lines of a ``/proc`` file, in bytes (missing file or keys: left out)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys and rest.split():
                    out[key] = int(rest.split()[0]) * 1024
    return out


def process_rss() -> dict[str, int | None]:
    """``{"rss_bytes", "peak_rss_bytes"}`` of this process (``VmRSS``, ``VmHWM``); where ``/proc`` has no
    such lines, the peak from ``getrusage`` and the current figure ``None``."""
    status = _proc_kib("/proc/self/status", ("VmRSS", "VmHWM"))
    peak = status.get("VmHWM")
    if peak is None:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    return {"rss_bytes": status.get("VmRSS"), "peak_rss_bytes": peak}


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    return _proc_kib("/proc/meminfo", ("MemAvailable",)).get("MemAvailable")


def marker_path(result_path: str | os.PathLike) -> str:
    """Where the trial whose result JSON is ``result_path`` writes its host-pool marker."""
    return f"{os.fspath(result_path)}.hostpool.json"


def write_marker(state: str, pool_bytes: int, **extra: Any) -> None:
    """Record the host pool's state in :data:`MARKER_ENV`'s file (no-op when it is not set). Written to a
    temp file and renamed, so a reader never sees half a record; no fsync: a killed process's writes stay
    in the page cache, and the marker only has to outlive the process."""
    path = os.environ.get(MARKER_ENV)
    if not path:
        return
    record = {
        "state": state,
        "pool_bytes": int(pool_bytes),
        "pid": os.getpid(),
        "time": time.time(),
        "available_bytes": available_bytes(),
        **process_rss(),
        **extra,
    }
    with contextlib.suppress(OSError):  # a marker that cannot be written leaves the last one
        atomic_write_text(path, json.dumps(record), durable=False)


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker at ``path``, or None (absent, unreadable, not a JSON object)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_marker(path: str | os.PathLike) -> None:
    """Remove the marker and any temp file a killed writer left (:func:`atomic_write_text`'s
    ``.<name>.<random>.tmp``)."""
    path = Path(path)
    for p in (path, *path.parent.glob(f".{glob.escape(path.name)}.*.tmp")):
        with contextlib.suppress(OSError):
            os.unlink(p)


__all__ = [
    "FAILED",
    "GROWING",
    "HELD",
    "MARKER_ENV",
    "HostMemoryError",
    "available_bytes",
    "marker_path",
    "process_rss",
    "read_marker",
    "remove_marker",
    "write_marker",
]
