"""Held-out metrics compare only over one eval set: trials grouped by ``meta.eval_set.fingerprint``.

A trial's eval loss, perplexity, task score and fact/control metrics (the registry's ``held_out`` metrics)
are over the held-out tokens it scored (:mod:`vramsweep.data.evalset`). Two trials whose eval-set
fingerprints differ scored different tokens: their difference is not an effect of the knob, so ``report``
shows no Δ and no best for those metrics and ``pick`` refuses to rank on them, naming the config key that
made the eval sets differ (:func:`split`). Trials without a fingerprint (older results, a user's trial
function) are left out of the check.

A trial that could not score the sweep's reference (``meta.eval_set.comparable: false``, e.g. a context
shorter than the reference's held-out examples; :mod:`vramsweep.data.reference`) scored its own held-out
examples: :func:`not_comparable` says why, :func:`comparable` leaves such trials out of every held-out
ranking (``report``'s best and Pareto, ``pick``, importances), and a Δ against one is not computed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vramsweep.record.metrics import HELD_OUT_METRICS
from vramsweep.report.load import REPEAT_KEYS, SweepData, TrialRecord, display_value, norm_value

#: Top-level config sections that never describe what a trial scored.
_NOT_KNOBS = ("results_dir", "name", "sweep", "hydra", "logger")


def fingerprint(trial: TrialRecord) -> str | None:
    """The trial's eval-set fingerprint (``meta.eval_set.fingerprint``), None when not recorded."""
    es = trial.meta.get("eval_set")
    fp = es.get("fingerprint") if isinstance(es, dict) else None
    return str(fp) if fp else None


def not_comparable(trial: TrialRecord) -> str | None:
    """Why the trial's held-out metrics are not over the sweep's reference (None: they are, or unknown)."""
    es = trial.meta.get("eval_set")
    if not isinstance(es, dict) or es.get("comparable", True) is not False:
        return None
    return str(es.get("not_comparable") or "it could not score the sweep's reference held-out examples")


def comparable(trials: Iterable[TrialRecord]) -> list[TrialRecord]:
    """``trials`` less those marked not comparable (:func:`not_comparable`)."""
    return [t for t in trials if not_comparable(t) is None]


def not_comparable_text(trials: Iterable[TrialRecord]) -> str:
    """``trial 3 (context.max_tokens=256 is shorter ...); trial 4 (...)``: the not-comparable trials, why."""
    found = [(t.number, why) for t in trials if (why := not_comparable(t)) is not None]
    return "; ".join(f"trial {n} ({why})" for n, why in found)


def held_out(metric: str) -> bool:
    """Whether ``metric`` is measured on the held-out set (compares only over one eval set)."""
    return str(metric).split(".", 1)[0] in HELD_OUT_METRICS


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if not prefix and k in _NOT_KNOBS:
            continue
        out.update(_flat(v, key))
    return out


@dataclass(frozen=True)
class EvalSplit:
    """Trials that scored different held-out tokens: ``groups`` (fingerprint -> trials, first-seen order) and
    ``knobs`` (the config keys whose values set the groups apart; empty when none does)."""

    groups: dict[str, list[TrialRecord]]
    knobs: list[str]

    def knob_text(self) -> str:
        """``context.max_tokens (512 | 256)``, or why no key is named."""
        if not self.knobs:
            return "no config key differs (the data files or the tokenizer changed between trials?)"
        parts = []
        for k in self.knobs[:3]:
            vals = [display_value(ts[0].knob_value(k)) for ts in self.groups.values()]
            parts.append(f"{k} ({' | '.join(dict.fromkeys(vals))})")
        return ", ".join(parts) + (", …" if len(self.knobs) > 3 else "")

    def fingerprints_text(self) -> str:
        """``1a2b3c4d: trials 0, 1; 5e6f7a8b: trial 2``."""
        out = []
        for fp, ts in self.groups.items():
            nums = ", ".join(str(t.number) for t in ts[:6]) + (", …" if len(ts) > 6 else "")
            out.append(f"{fp[:8]}: trial{'s' if len(ts) > 1 else ''} {nums}")
        return "; ".join(out)

    def message(self) -> str:
        """One sentence: why held-out metrics are not ranked, and the knob to blame."""
        return (
            "the trials scored different held-out tokens "
            f"(eval-set fingerprints {self.fingerprints_text()}), made different by {self.knob_text()}"
        )


def _constant_within(values: list[set[str]]) -> bool:
    return all(len(v) == 1 for v in values) and len({next(iter(v)) for v in values}) > 1


def _differs(values: list[set[str]]) -> bool:
    return len(set().union(*values)) > 1


def differing_knobs(sweep: SweepData, groups: dict[str, list[TrialRecord]]) -> list[str]:
    """The keys that explain the groups: first the sweep's own knobs (override keys), then every composed
    config key, each taken when it has one value inside every group and differs between groups; failing
    that, keys whose values merely differ between groups."""
    override_keys = [k for k in sweep.candidate_knobs() if k not in REPEAT_KEYS]
    flats = {fp: [_flat(t.config) for t in ts] for fp, ts in groups.items()}
    config_keys = [k for k in dict.fromkeys(k for fl in flats.values() for f in fl for k in f)]
    config_keys = [k for k in config_keys if k not in REPEAT_KEYS]

    def values_of(key: str, from_config: bool) -> list[set[str]]:
        if from_config:
            return [{norm_value(f.get(key)) for f in fl} for fl in flats.values()]
        return [{norm_value(t.knob_value(key)) for t in ts} for ts in groups.values()]

    for rule in (_constant_within, _differs):
        for keys, from_config in ((override_keys, False), (config_keys, True)):
            found = [k for k in keys if rule(values_of(k, from_config))]
            if found:
                return found
    return []


def split(sweep: SweepData, trials: Iterable[TrialRecord]) -> EvalSplit | None:
    """The eval-set groups of ``trials`` when they scored more than one set, else None (trials marked not
    comparable are left out: :func:`comparable`)."""
    groups: dict[str, list[TrialRecord]] = {}
    for t in comparable(trials):
        fp = fingerprint(t)
        if fp is not None:
            groups.setdefault(fp, []).append(t)
    if len(groups) < 2:
        return None
    return EvalSplit(groups, differing_knobs(sweep, groups))


def same_eval_set(a: Iterable[TrialRecord], b: Iterable[TrialRecord]) -> bool:
    """Whether the fingerprinted trials of ``a`` and ``b`` all scored one eval set (True when unknown; False
    when one of them could not score the sweep's reference)."""
    both = [*a, *b]
    if any(not_comparable(t) is not None for t in both):
        return False
    fps = {fp for t in both if (fp := fingerprint(t)) is not None}
    return len(fps) < 2
