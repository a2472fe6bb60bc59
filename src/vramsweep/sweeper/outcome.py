"""Failures are data: a trial's result -> its Optuna outcome (state, values, budget constraint).

How each status is told to Optuna (so that ``study.best_trial(s)`` never holds an infeasible or failed
trial, and the sampler still learns where the memory wall is):

=====================  ========  ===========================================================
status                 state     notes
=====================  ========  ===========================================================
ok, within budget      COMPLETE  values = objectives; constraint ``vram_over_budget_gib`` <= 0
ok, over budget        COMPLETE  measured values kept; constraint > 0 -> infeasible, never best
oom                    PRUNED    constraint > 0: TPE ranks it below every feasible trial
infeasible_estimate    PRUNED    constraint = estimate - budget (> 0)
pruned                 PRUNED    intermediate eval losses; partial metrics in the JSON
unsupported, diverged  FAIL      results, not failures (do not count toward max_failure_rate)
host_oom               FAIL      not a device-budget point (also a SIGKILL while the pool grew)
error                  FAIL      counts toward max_failure_rate
ok, objective NaN/inf  FAIL      status becomes ``diverged`` when a loss is not finite
ok, objective missing  FAIL      ``objective_error`` attr; counts toward max_failure_rate
=====================  ========  ===========================================================
"""

from __future__ import annotations

import math
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from vramsweep.record.failure import classify_exception
from vramsweep.record.feasibility import over_budget_gib, result_budget_gib
from vramsweep.record.hostmem import GROWING
from vramsweep.record.metrics import LOSS_METRICS, METRIC_KEYS, SCALAR_METRICS, empty_metrics
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import checked_json, new_result
from vramsweep.record.schema import SCHEMA_VERSION, ResultSchemaError
from vramsweep.record.status import STATUSES, Status
from vramsweep.record.units import GIB
from vramsweep.sweeper.settings import Objective

CONSTRAINT_KEY = "vram_over_budget_gib"
#: System attribute optuna-dashboard reads a trial's constraints from (a list; Optuna 5 itself writes
#: ``constraints:<name>``; it reads both, so the budget constraint shows up once more as ``"0"``).
DASHBOARD_CONSTRAINTS_KEY = "constraints"
#: Violation used when a trial ran out of memory but no peak was measured (1 MiB over).
MIN_VIOLATION_GIB = 1.0 / 1024
# Compact metrics stored in Optuna user attrs: every scalar result metric (not the breakdown dict).
ATTR_METRICS = SCALAR_METRICS


@dataclass
class Outcome:
    """What to tell Optuna about one finished trial."""

    state: str  # COMPLETE | PRUNED | FAIL
    values: list[float] | None
    constraint: float | None
    failure: bool  # counts toward max_failure_rate
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "values": self.values,
            "constraint": self.constraint,
            "failure": self.failure,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Outcome:
        return cls(d["state"], d.get("values"), d.get("constraint"), bool(d.get("failure")), d.get("note"))


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x))


def metric_value(metrics: dict[str, Any], name: str) -> Any:
    """``metrics[name]``; dotted names reach into nested dicts (``memory_breakdown_bytes.activations``)."""
    node: Any = metrics
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def classify(result: dict[str, Any], objectives: list[Objective], *, budget_gib: float = 0.0) -> Outcome:
    """Decide the Optuna outcome of a finished trial (``result`` may be modified: NaN loss -> diverged).

    Feasibility (budget and peak) is :mod:`vramsweep.record.feasibility`'s one rule."""
    status = result.get("status")
    metrics = result.get("metrics") or {}
    budget = result_budget_gib(result, budget_gib)
    over = over_budget_gib(metrics.get(M.PEAK_MEMORY_BYTES), budget)
    if status == Status.OK:
        bad_loss = [m for m in LOSS_METRICS if metrics.get(m) is not None and not _finite(metrics.get(m))]
        if bad_loss:
            result["status"] = Status.DIVERGED.value
            result["reason"] = f"{bad_loss[0]} is {metrics.get(bad_loss[0])} (not finite)"
            return Outcome("FAIL", None, None, False, result["reason"])
        values: list[float] = []
        for o in objectives:
            v = metric_value(metrics, o.metric)
            if v is None:
                note = f"objective {o.metric} was not measured (null): the trial cannot be ranked"
                return Outcome("FAIL", None, None, True, note)
            if not _finite(v):
                note = f"objective {o.metric} is {v} (not finite)"
                return Outcome("FAIL", None, None, True, note)
            values.append(float(v))
        if budget is not None and over is None:
            return Outcome(
                "FAIL",
                None,
                None,
                True,
                f"peak_memory_bytes not measured: cannot check hardware.budget_gib={budget}",
            )
        return Outcome("COMPLETE", values, over if over is not None else 0.0, False)
    if status == Status.PRUNED:
        return Outcome("PRUNED", None, over, False)
    if status == Status.OOM:
        return Outcome("PRUNED", None, max(over or 0.0, MIN_VIOLATION_GIB), False)
    if status == Status.INFEASIBLE_ESTIMATE:
        est = (result.get("estimate") or {}).get(M.PEAK_MEMORY_BYTES)
        est_over = over_budget_gib(est, budget)
        return Outcome("PRUNED", None, max(est_over or 0.0, MIN_VIOLATION_GIB), False)
    if status in (
        Status.UNSUPPORTED,
        Status.DIVERGED,
        Status.HOST_OOM,
    ):  # HOST_OOM: not a device-budget point
        return Outcome("FAIL", None, None, False)
    return Outcome("FAIL", None, None, True)


def normalise_result(result: Any, *, sweep: str, trial: int, overrides: list[str]) -> dict[str, Any]:
    """Make any trial return value a well-formed result dict (docs/CONTRACTS.md); never raises."""
    if not isinstance(result, dict):
        out = new_result(
            status=Status.ERROR,
            reason=f"trial function returned {type(result).__name__}, not a dict",
            sweep=sweep,
            trial=trial,
            overrides=overrides,
        )
        return out
    out = dict(result)
    out.setdefault("schema", SCHEMA_VERSION)
    if out.get("status") not in STATUSES:
        out["reason"] = f"unknown status {out.get('status')!r}; {out.get('reason') or ''}".strip()
        out["status"] = Status.ERROR.value
    out.setdefault("reason", None)
    out["sweep"] = sweep
    out["trial"] = trial
    out.setdefault("overrides", list(overrides))
    if not out.get("overrides"):
        out["overrides"] = list(overrides)
    out.setdefault("config", {})
    metrics = empty_metrics()
    metrics.update(out.get("metrics") or {})
    out["metrics"] = metrics
    out.setdefault("estimate", None)
    out["meta"] = dict(out.get("meta") or {})
    return _checked(out, sweep=sweep, trial=trial, overrides=overrides)


def _checked(result: dict[str, Any], *, sweep: str, trial: int, overrides: list[str]) -> dict[str, Any]:
    """``result`` if it follows the contract (:class:`~vramsweep.record.schema.TrialResult`); else an
    ``error`` result whose reason names the bad key (its config kept): a trial function's bad value is
    that trial's failure, never the sweep's."""

    try:
        checked_json(result)
    except ResultSchemaError as exc:
        out = new_result(
            status=Status.ERROR,
            reason=f"the trial function returned a result that breaks the result contract: {exc}"[:2000],
            sweep=sweep,
            trial=trial,
            overrides=list(result.get("overrides") or overrides),
            config=result.get("config") if isinstance(result.get("config"), dict) else {},
        )
        return out
    return result


def result_from_exception(
    exc: BaseException, *, sweep: str, trial: int, overrides: list[str]
) -> dict[str, Any]:
    """A trial function raised (the contract says it should not, so this is the safety net): its status and
    reason are :func:`vramsweep.record.failure.classify_exception`'s, as in the trial; an unexpected error's
    reason ends with where it happened (the last frames; there is no ``meta.traceback`` here)."""

    status, reason, unexpected = classify_exception(exc)
    if unexpected:
        tb = traceback.extract_tb(exc.__traceback__)[-3:]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(tb))
        reason += f" (at {where})" if where else ""
    return new_result(status=status, reason=reason[:2000], sweep=sweep, trial=trial, overrides=overrides)


def signal_reason(exitcode: int | None) -> str:
    """Human reason for a trial process that ended without a result."""
    if exitcode is None:
        return "trial process did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (killed: kill -9 or the kernel's OOM killer)" if -exitcode == signal.SIGKILL else ""
        return f"trial process killed by {name}{hint} before writing its result"
    return f"trial process exited with code {exitcode} before writing its result"


def died_status(exitcode: int | None, marker: dict[str, Any] | None) -> tuple[Status, str]:
    """Status and reason of a trial process that ended without a result. A SIGKILL while its host pool was
    growing (``marker``: :mod:`vramsweep.record.hostmem`, state ``growing``) is the kernel's OOM killer
    ending a process that ran out of host memory while ``cudaHostRegister`` faulted the pool's pages in:
    ``host_oom``, not ``error``. Any other death is ``error`` with :func:`signal_reason`."""
    reason = signal_reason(exitcode)
    if exitcode != -signal.SIGKILL or not marker or marker.get("state") != GROWING:
        return Status.ERROR, reason

    def gib(key: str) -> str:
        v = marker.get(key)
        return f"{v / GIB:.2f} GiB" if isinstance(v, int | float) and not isinstance(v, bool) else "unknown"

    return Status.HOST_OOM, (
        f"{reason}, while its {'pinned ' if marker.get('pinned') else ''}host pool for "
        f"checkpointing=offload was growing to {gib('pool_bytes')} (process RSS {gib('rss_bytes')}, "
        f"MemAvailable {gib('available_bytes')} when it started): out of host memory; use a shorter "
        "context.max_tokens, checkpointing=on, or a machine with more RAM"
    )


def user_attrs(result: dict[str, Any], outcome: Outcome, result_path: str) -> dict[str, Any]:
    """Compact, JSON-safe user attrs for the Optuna trial (the full record is the result JSON)."""
    metrics = result.get("metrics") or {}
    attrs: dict[str, Any] = {
        "status": result.get("status"),
        "reason": (result.get("reason") or None) and str(result.get("reason"))[:1000],
        "result_path": result_path,
        "overrides": list(result.get("overrides") or []),
    }
    meta = result.get("meta") or {}
    if meta.get("design") is not None:
        attrs["design"] = meta["design"]
    for k in ATTR_METRICS:
        v = metrics.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        attrs[k] = v
    if _finite(meta.get("wall_s")):
        attrs["wall_s"] = float(meta["wall_s"])
    if outcome.constraint is not None:
        attrs[CONSTRAINT_KEY] = outcome.constraint
        attrs["feasible"] = outcome.constraint <= 0
    if outcome.note:
        attrs["objective_error"] = outcome.note
    for k in ("retry_of", "duplicate_of"):
        if meta.get(k) is not None:
            attrs[k] = meta[k]
    return attrs


__all__ = [
    "METRIC_KEYS",
    "Outcome",
    "classify",
    "normalise_result",
    "result_from_exception",
    "signal_reason",
    "died_status",
    "user_attrs",
    "metric_value",
    "CONSTRAINT_KEY",
]
