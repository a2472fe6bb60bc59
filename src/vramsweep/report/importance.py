"""Optuna parameter importances per objective, computed from the trial results.

The study is rebuilt in memory from the result records (one single-objective study per objective, the
varying knobs as parameters) rather than read from ``study.db``: ablation and stacking designs enqueue
fixed configs whose ``trial.params`` may be empty, folder-only sweeps have no study, and the results
are the one record every trial has. Numeric knobs become Float/Int distributions, everything else
categorical. ``optuna.importance.get_param_importances`` (PED-ANOVA by default in Optuna 5, which
assumes lower is better) gets ``target=`` negated for maximised objectives.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from vramsweep.report.load import REPEAT_KEYS, SweepData, TrialRecord, display_value, num

MIN_TRIALS = 2


@dataclass
class Importances:
    """Importances per objective metric (``{metric: {param: importance}}``) and why any were skipped."""

    values: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _distribution(values: list[Any]) -> tuple[Any, bool]:
    """(distribution, numeric) for the observed values of one knob."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    nums = [num(v) for v in values]
    if all(n is not None for n in nums):
        lo, hi = min(nums), max(nums)  # type: ignore[type-var]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return IntDistribution(int(lo), int(hi)), True  # type: ignore[arg-type]
        return FloatDistribution(float(lo), float(hi)), True  # type: ignore[arg-type]
    return CategoricalDistribution(sorted({display_value(v) for v in values})), False


def _param(value: Any, dist: Any, numeric: bool) -> Any:
    from optuna.distributions import IntDistribution

    if not numeric:
        return display_value(value)
    return int(value) if isinstance(dist, IntDistribution) else float(value)


def compute_importances(sweep: SweepData) -> Importances:
    """Importances of the varying knobs for each objective over the ``ok`` trials that measured it."""
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Importances()
    knobs = [k for k in sweep.varying_knobs() if k not in REPEAT_KEYS]  # seeds are noise, not knobs
    for metric, direction in sweep.objectives:
        trials: list[TrialRecord] = [t for t in sweep.trials if t.ok and t.metric(metric) is not None]
        if len(trials) < MIN_TRIALS:
            out.notes.append(
                f"{metric}: skipped, {len(trials)} complete trial(s) with a value (need ≥ {MIN_TRIALS})."
            )
            continue
        dists: dict[str, Any] = {}
        numeric: dict[str, bool] = {}
        for k in knobs:
            values = [t.knob_value(k) for t in trials]
            if len({display_value(v) for v in values}) < 2:
                continue
            dists[k], numeric[k] = _distribution(values)
        if not dists:
            out.notes.append(f"{metric}: skipped, no knob varies across its {len(trials)} complete trials.")
            continue
        study = optuna.create_study(direction=direction)
        for t in trials:
            params = {k: _param(t.knob_value(k), dists[k], numeric[k]) for k in dists}
            study.add_trial(create_trial(params=params, distributions=dists, value=t.metric(metric)))
        sign = 1.0 if direction == "minimize" else -1.0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imp = optuna.importance.get_param_importances(study, target=lambda ft, s=sign: s * ft.value)
        except Exception as exc:  # a degenerate study must not take the report down
            out.notes.append(f"{metric}: importances failed ({exc.__class__.__name__}: {exc}).")
            continue
        out.values[metric] = {k: float(v) for k, v in imp.items()}
        if len(imp) > 1 and len({round(v, 12) for v in imp.values()}) == 1:
            out.notes.append(
                f"{metric}: importances are all equal ({len(trials)} trials are too few to separate "
                "the knobs)."
            )
    return out
