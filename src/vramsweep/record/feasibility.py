"""The feasibility rule, defined once: which budget a trial is held to and whether it fits.

A trial is **feasible** when its status is ``ok`` and, if it has a budget, its measured
``metrics.peak_memory_bytes`` is at most the budget. Its budget is its own recorded
``config.hardware.budget_gib`` when that is recorded (a sweep may vary ``hardware``), else the sweep's
``budget_gib``; ``0`` (or nothing) means no budget. An ``ok`` trial with a budget but no measured peak is
not feasible (it cannot be checked). Only feasible trials can be a sweep's best; the sweeper tells Optuna
the violation :func:`over_budget_gib` as a constraint (> 0: infeasible) and the report uses :func:`feasible`.
"""

from __future__ import annotations

import math
from typing import Any

from vramsweep.record.status import Status
from vramsweep.record.units import GIB


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def recorded_budget_gib(config: Any) -> float | None:
    """``config.hardware.budget_gib`` as a number (0 = no budget), None when not recorded."""
    try:
        return _num(config["hardware"]["budget_gib"])
    except (KeyError, TypeError, IndexError):
        return None


def budget_gib(config: Any, fallback: Any = None) -> float | None:
    """The budget (GiB) a trial is held to: its recorded ``hardware.budget_gib``, else ``fallback`` (the
    sweep's ``budget_gib``); None when that is 0 or missing (no budget)."""
    b = recorded_budget_gib(config)
    if b is None:
        b = _num(fallback)
    return b if b is not None and b > 0 else None


def over_budget_gib(peak_bytes: Any, budget: float | None) -> float | None:
    """``peak / GiB - budget`` (> 0: over), None when there is no budget or no measured peak."""
    peak = _num(peak_bytes)
    if budget is None or budget <= 0 or peak is None:
        return None
    return peak / GIB - budget


def fits(peak_bytes: Any, budget: float | None) -> bool | None:
    """Peak within the budget; None when there is no budget; False when the peak was not measured."""
    if budget is None or budget <= 0:
        return None
    over = over_budget_gib(peak_bytes, budget)
    return over is not None and over <= 0


def feasible(status: Any, peak_bytes: Any, budget: float | None) -> bool:
    """Status ``ok`` and (no budget, or measured peak <= budget)."""
    return status == Status.OK and fits(peak_bytes, budget) is not False


def result_budget_gib(result: dict[str, Any], fallback: Any = None) -> float | None:
    """:func:`budget_gib` of a result dict (its ``config``)."""
    return budget_gib(result.get("config"), fallback)


def result_feasible(result: dict[str, Any], fallback_budget_gib: Any = None) -> bool:
    """:func:`feasible` of a result dict."""
    peak = (result.get("metrics") or {}).get("peak_memory_bytes")
    return feasible(result.get("status"), peak, result_budget_gib(result, fallback_budget_gib))


__all__ = [
    "budget_gib",
    "feasible",
    "fits",
    "over_budget_gib",
    "recorded_budget_gib",
    "result_budget_gib",
    "result_feasible",
]
