"""Trial result JSON (docs/CONTRACTS.md, "Result JSON"): one file per trial, written atomically
(temp + fsync + replace) by :func:`write_result`. The schema's types are in :mod:`vramsweep.record.schema`,
statuses in :mod:`vramsweep.record.status`, metrics in :mod:`vramsweep.record.metrics`."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from vramsweep.record.atomic import atomic_write_text, current_umask  # noqa: F401 - re-exported
from vramsweep.record.metrics import (  # noqa: F401 - re-exported
    MAXIMIZE_METRICS,
    METRIC_KEYS,
    QUALITY_METRICS,
    TIMING_METRICS,
    empty_metrics,
    is_quality_metric,
    metric_direction,
)
from vramsweep.record.schema import SCHEMA_VERSION, ResultSchemaError, TrialResult, check_result
from vramsweep.record.status import STATUSES, Status

#: When set (the test suite sets it), :func:`write_result` appends each result path it writes to this file,
#: one per line, so every result the suite produces can be checked against the schema afterwards.
RESULT_LOG_ENV = "VRAMSWEEP_RESULT_LOG"


def new_result(
    *,
    status: Status | str = Status.OK,
    reason: str | None = None,
    sweep: str | None = None,
    trial: int | None = None,
    overrides: list[str] | None = None,
    config: dict | None = None,
) -> dict[str, Any]:
    """A fresh result as a plain dict (:meth:`TrialResult.new`'s ``to_json()``): for code that builds a
    result by key (the sweeper). ``status`` may be a string; an unknown one is a ``ValueError`` naming the
    allowed statuses."""
    return TrialResult.new(
        status=status, reason=reason, sweep=sweep, trial=trial, overrides=overrides, config=config
    ).to_json()


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: store them as null (the reason field says why)."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _dumps(data: Any) -> str:
    return json.dumps(_clean(data), indent=2, allow_nan=False) + "\n"


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON atomically (NaN/inf stored as null)."""
    return atomic_write_text(path, _dumps(data))


def checked_json(result: TrialResult | dict[str, Any]) -> dict[str, Any]:
    """The JSON a result is written as (NaN/inf as null), checked against the contract:
    :class:`~vramsweep.record.schema.ResultSchemaError` names the first bad key."""
    data = _clean(result.to_json() if isinstance(result, TrialResult) else result)
    TrialResult.from_json(data)
    return data


def write_result(path: str | os.PathLike, result: TrialResult | dict[str, Any]) -> Path:
    """Write a trial result JSON atomically (the one way results are written).

    ``result`` is a :class:`~vramsweep.record.schema.TrialResult`, or a dict (the sweeper's, a user's trial
    function's) read with ``TrialResult.from_json``: either way the JSON about to be written is checked
    against the contract first, and a result that breaks it raises
    :class:`~vramsweep.record.schema.ResultSchemaError` naming the key, with nothing written.

    With ``VRAMSWEEP_RESULT_LOG`` set (the test suite), the written JSON is also checked to round-trip
    (:func:`vramsweep.record.schema.check_result`) and ``ok <path>`` or ``bad <path> <error>`` appended to
    that file.
    """
    data = checked_json(result)  # ResultSchemaError before anything is written
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    out = atomic_write_text(path, text)
    log = os.environ.get(RESULT_LOG_ENV)
    if log:
        try:
            check_result(json.loads(text))
            line = f"ok\t{Path(out).resolve()}"
        except ResultSchemaError as exc:
            line = f"bad\t{Path(out).resolve()}\t{exc}"
        with open(log, "a", encoding="utf-8") as fh:  # one short O_APPEND write per line
            fh.write(line.replace("\n", " ") + "\n")
    return out


def loads_json(text: str) -> Any:
    """``json.loads``; nesting too deep for Python's parser (``RecursionError`` past ~1,000 levels, a
    traceback in every reader) is a ``ValueError`` like any other unreadable JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read (over ~1,000 levels of [ or {)") from None


def read_json_file(path: str | os.PathLike) -> Any:
    """A JSON file through :func:`loads_json` (``OSError`` or ``ValueError`` when unreadable). Only a
    regular file is read: a FIFO (or a device) would block the reader forever (``report`` hung on a FIFO
    in ``trials/``), so it is opened without blocking and refused as not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        fh = os.fdopen(fd, encoding="utf-8", errors="strict")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        return loads_json(fh.read())


def load_result(path: str | os.PathLike) -> dict[str, Any]:
    return read_json_file(path)


__all__ = [
    "METRIC_KEYS",
    "RESULT_LOG_ENV",
    "SCHEMA_VERSION",
    "STATUSES",
    "atomic_write_json",
    "atomic_write_text",
    "empty_metrics",
    "load_result",
    "new_result",
    "write_result",
]
