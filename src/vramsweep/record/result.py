"""Trial result JSON (DESIGN.md §5): one file per trial, written atomically (temp + fsync + replace)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "unsupported", "diverged", "error", "infeasible_estimate", "pruned")
METRIC_KEYS = (
    "peak_memory_bytes",
    "memory_kind",
    "memory_breakdown_bytes",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "train_loss",
    "initial_eval_loss",
    "eval_loss",
    "eval_ppl",
    "task_score",
    "fact_token_acc",
    "fact_nll",
    "control_token_acc",
    "control_nll",
)


def empty_metrics() -> dict[str, Any]:
    """Every metric key present, all null (never write a figure that was not measured)."""
    return {k: None for k in METRIC_KEYS}


def new_result(
    *,
    status: str = "ok",
    reason: str | None = None,
    sweep: str | None = None,
    trial: int | None = None,
    overrides: list[str] | None = None,
    config: dict | None = None,
) -> dict[str, Any]:
    if status not in STATUSES:
        raise ValueError(f"status={status!r} (allowed: {', '.join(STATUSES)})")
    return {
        "schema": SCHEMA_VERSION,
        "status": status,
        "reason": reason,
        "sweep": sweep,
        "trial": trial,
        "overrides": list(overrides or []),
        "config": config or {},
        "metrics": empty_metrics(),
        "estimate": None,
        "meta": {},
    }


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: store them as null (the reason field says why)."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


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


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder + fsync + ``os.replace``):
    a reader sees the old file or the new one, never half. The file gets the mode a plain ``open()``
    would give it (``0666`` minus the umask), not ``mkstemp``'s private ``0600``: a team sharing a
    results folder can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON atomically (NaN/inf stored as null)."""
    return atomic_write_text(path, json.dumps(_clean(data), indent=2, allow_nan=False) + "\n")


def load_result(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)
