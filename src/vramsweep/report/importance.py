"""Optuna parameter importances per objective, computed from the trial results.

The study is rebuilt in memory from the result records (one single-objective study per objective, the
varying knobs as parameters) rather than read from ``study.db``: ablation and stacking designs enqueue
fixed configs whose ``trial.params`` may be empty, folder-only sweeps have no study, and the results
are the one record every trial has. Numeric knobs become Float/Int distributions, everything else
categorical. ``optuna.importance.get_param_importances`` (PED-ANOVA by default in Optuna 5, which
assumes lower is better) gets ``target=`` negated for maximised objectives.

An objective whose differences between configs are within the seed-to-seed noise (one-way ANOVA over the
configs, p ≥ 0.05) is dropped, and the notes say so: importances of noise would rank knobs that do
nothing. Timing metrics leave out trials measured under load (``meta.timing_conditions``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from vramsweep.record.result import TIMING_METRICS
from vramsweep.report.evalset import comparable, held_out, not_comparable_text, split
from vramsweep.report.load import REPEAT_KEYS, SweepData, TrialRecord, display_value, num
from vramsweep.report.stats import ALPHA, anova_p

MIN_TRIALS = 2


@dataclass
class Importances:
    """Importances per objective metric (``{metric: {param: importance}}``) and why any were skipped."""

    values: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # metric -> why (its differences are noise)


def noise_verdict(sweep: SweepData, trials: list[TrialRecord], metric: str) -> str | None:
    """Do the configs differ on ``metric`` beyond the seed-to-seed noise? One-way ANOVA over the configs
    (seed repeats = the noise): ``dropped, …`` when p ≥ :data:`ALPHA` (the importances would rank noise),
    ``no repeats: noise unknown …`` when no config has two values, None when the differences are real."""
    groups = sweep.config_groups(trials)
    p = anova_p([[t.metric(metric) for t in ts] for ts in groups.values()])  # type: ignore[misc]
    if p is None:
        return "no repeats: noise unknown (importances may rank noise)."
    if p >= ALPHA:
        return (
            f"dropped: its differences between {len(groups)} configs are within the seed-to-seed noise "
            f"(one-way ANOVA p = {p:.2f} ≥ {ALPHA:g}, {len(trials)} trials)."
        )
    return None


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


def _trials_for(sweep: SweepData, metric: str, out: Importances) -> list[TrialRecord] | None:
    """The ok trials with a value of ``metric``, less those whose throughput was measured under load (a
    timing metric); None (noted) for a held-out metric over trials that scored different held-out tokens."""
    trials: list[TrialRecord] = [t for t in sweep.trials if t.ok and t.metric(metric) is not None]
    if metric in TIMING_METRICS:
        loaded = [t.number for t in trials if t.timing_disturbed]
        if loaded:
            trials = [t for t in trials if not t.timing_disturbed]
            out.notes.append(
                f"{metric}: {len(loaded)} trial(s) measured under load left out "
                f"({', '.join(f'{n:04d}' for n in loaded)})."
            )
    if held_out(metric) and (nc := not_comparable_text(trials)):
        trials = comparable(trials)
        out.notes.append(f"{metric}: left out, not comparable with the sweep's reference: {nc}.")
    if held_out(metric) and (sp := split(sweep, trials)) is not None:
        out.notes.append(f"{metric}: skipped, {sp.message()}.")
        return None
    return trials


def compute_importances(sweep: SweepData) -> Importances:
    """Importances of the varying knobs for each objective over the ``ok`` trials that measured it."""
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Importances()
    knobs = [k for k in sweep.varying_knobs() if k not in REPEAT_KEYS]  # seeds are noise, not knobs
    for metric, direction in sweep.objectives:
        trials = _trials_for(sweep, metric, out)
        if trials is None:
            continue
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
        verdict = noise_verdict(sweep, trials, metric)
        if verdict is not None:
            if verdict.startswith("dropped"):
                out.dropped[metric] = verdict
                out.notes.append(f"{metric}: {verdict}")
                continue
            out.notes.append(f"{metric}: {verdict}")
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
