"""``vramsweep pick``: choose the production config that fits a memory budget and pin it as a Hydra
experiment.

Candidates are configs, not trials: a config's seed repeats are one candidate (:class:`Candidate`: the
largest peak of its repeats, the mean eval loss, the mean tokens/s of the repeats measured without load).
Eligible: every ok trial of the config measured a peak ≤ ``budget_gib − headroom_gib`` and (when given)
tokens/s ≥ ``min_tokens_per_s``. Ranking:

* ``prefer="quality"``: lowest mean eval loss, then lower peak memory, then higher tokens/s measured
  without load, then lower trial number; an eval loss within the seed-to-seed noise of the best config's
  counts as equal (configs with seed repeats: t-test p ≥ 0.05, :func:`quality_tiers`), so among those the
  cheaper, then faster, config wins, and the output says which of the two decided;
* ``prefer="speed"``: highest tokens/s measured without load, then lower eval loss, then lower peak
  memory, then lower trial number.

Throughput measured under load (:attr:`TrialRecord.timing_disturbed`) is shown marked ``!`` and breaks no
tie. The config is pinned from its first repeat; the seed is a measurement setting and is not pinned.
A missing eval loss / tokens/s ranks last for its key. The winner is written to
``<conf>/experiment/<name>.yaml`` (``# @package _global_``): ``override /<group>: <option>`` for every config
group the trial selected, plus explicit values for every other field that differs from what those
options compose to (all of ``context.*`` and ``train.*``, and every key the trial overrode, are pinned
regardless). The file is then composed back and compared with the trial's config. ``production.md``
(sweep folder) says why it won. ``<conf>`` is the user's conf dir (``--config-dir``,
``$VRAMSWEEP_CONFIG_DIR`` or ``./conf``; :mod:`vramsweep.config.compose`), layered over the packaged
defaults, never the installed package. ``train.yaml`` has no ``experiment`` slot in its defaults list
(the usual Hydra experiment pattern), so the experiment is appended with ``+experiment=<name>``.

Exit codes of :func:`run_pick`: 0 written; 1 the written experiment did not compose (undone: the old file
back, or none); 2 bad input or nothing fits.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, compose, find_option, writable_conf_dir
from vramsweep.config.errors import error_line
from vramsweep.config.schema import MEASUREMENT_KEYS
from vramsweep.config.weights import random_weights
from vramsweep.record.metrics import (
    MetricName,
    column,
    format_value,
    scaled,
    title,
    value_format,
    view_metrics,
)
from vramsweep.record.metrics import label as metric_label
from vramsweep.record.result import atomic_write_text
from vramsweep.record.units import GIB
from vramsweep.report import evalset
from vramsweep.report.load import ReportError, SweepData, TrialRecord, load_sweep, safe_url
from vramsweep.report.stats import NOISE, UNKNOWN, compare
from vramsweep.report.tables import LOAD_MARK, Column, Table, fmt, gib, metric_cells, view_columns
from vramsweep.report.terminal import compact, wrap

#: Top-level config keys never pinned (where results go, run name, the sweep that produced the trial).
UNPINNED_TOP = ("results_dir", "name", "sweep", "hydra")
#: Sections pinned in full (knob values with no option file of their own).
ALWAYS_PIN = ("context", "train")
TRAIN_COMMAND = "vramsweep train {config_dir}+experiment={name}"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")
PREFER = ("quality", "speed")
TOP_N = 5
#: The metrics pick ranks on and shows (labels, formats and raw keys: the metric registry).
_PEAK, _TPS, _LOSS = MetricName.PEAK_MEMORY_BYTES, MetricName.TOKENS_PER_S, MetricName.EVAL_LOSS


def _winner_metrics() -> tuple[str, ...]:
    """The metrics of the winner's summary beside its memory lines: the registry's ``pick`` view."""
    return tuple(m for m in view_metrics("pick") if m != _PEAK)


def _show(item: TrialRecord | Candidate, name: str, missing: str = "", unit: bool = False) -> str:
    """A trial's or config's value of metric ``name`` as the registry formats it, ``missing`` when not
    measured; a config's tokens/s measured only under load is marked ``!``."""
    loaded = isinstance(item, Candidate) and name == _TPS and item.speed_loaded
    value = item.shown_tps() if isinstance(item, Candidate) and name == _TPS else item.metric(name)
    text = format_value(name, value, unit=unit)
    return (f"{text} {LOAD_MARK}" if loaded else text) if text else missing


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------
#: Quality verdicts of :func:`quality_tiers` (a trial's config vs the best config on eval loss).
BEST, EQUAL, WORSE, UNKNOWN_Q = "best", "equal", "worse", "unknown"


@dataclass
class QualityTier:
    """A trial's config vs the config with the lowest mean eval loss among the eligible ones."""

    verdict: str  # best | equal (not separated beyond noise) | worse (p < 0.05) | unknown (single runs)
    delta: float | None = None  # mean eval loss − the best config's mean
    p: float | None = None
    rank_loss: float = (
        math.inf
    )  # the loss ranked on: the best config's mean for best/equal, else its own mean

    @property
    def text(self) -> str:
        if self.verdict == BEST:
            return "best"
        delta = format_value(_LOSS, self.delta, sign=True)
        if self.verdict == EQUAL:
            return f"= best ({delta}, p {self.p:.2f})"
        if self.verdict == WORSE:
            return f"worse ({delta}, p {self.p:.3f})"
        return "noise unknown" if self.delta is None else f"noise unknown ({delta})"


@dataclass
class Candidate:
    """One config of the sweep: its ok trials (seed repeats together), ranked and shown as one.

    ``rep`` is the trial pinned (the first repeat; the seed is a measurement setting and is not pinned).
    Peak memory is the largest of the repeats' (the config fits only if every repeat did), eval loss and
    the other quality metrics their mean, tokens/s the mean of the repeats measured without load
    (``None`` when every repeat ran under load: such a figure breaks no tie, ``speed_loaded`` says so).
    """

    trials: list[TrialRecord]

    @property
    def rep(self) -> TrialRecord:
        return self.trials[0]

    @property
    def number(self) -> int:
        return self.rep.number

    @property
    def numbers(self) -> str:
        return ", ".join(str(t.number) for t in self.trials)

    def metric(self, name: str) -> float | None:
        if name == _PEAK:
            vals = [t.peak_bytes for t in self.trials]
            return None if any(v is None for v in vals) else max(vals)  # type: ignore[type-var]
        if name == _TPS:  # unloaded figures, and the confirm stage's alone figure of a shared one
            vals = [t.tokens_per_s for t in self.trials if not t.timing_disturbed]
            vals += [t.alone.tokens_per_s for t in self.trials if t.timing_disturbed and t.alone is not None]
        else:
            vals = [t.metric(name) for t in self.trials]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    @property
    def speed_loaded(self) -> bool:
        """Every repeat's throughput was measured under load (and so is left out of the ranking)."""
        return all(t.timing_disturbed and t.alone is None for t in self.trials) and any(
            t.tokens_per_s is not None for t in self.trials
        )

    def shown_tps(self) -> float | None:
        """Tokens/s as shown: the unloaded mean, else (marked) the mean under load."""
        if self.speed_loaded:
            vals = [t.tokens_per_s for t in self.trials if t.tokens_per_s is not None]
            return statistics.fmean(vals)  # type: ignore[arg-type]
        return self.metric(_TPS)

    @property
    def peak_bytes(self) -> float | None:
        return self.metric(_PEAK)

    @property
    def peak_gib(self) -> float | None:
        b = self.peak_bytes
        return None if b is None else b / GIB

    @property
    def tokens_per_s(self) -> float | None:
        return self.metric(_TPS)

    @property
    def eval_loss(self) -> float | None:
        return self.metric(_LOSS)


def candidates(sweep: SweepData, trials: list[TrialRecord]) -> list[Candidate]:
    """``trials`` as configs (:meth:`SweepData.config_groups`), each with its repeats in repeat order."""

    def order(t: TrialRecord) -> tuple:
        return ((t.design or {}).get("repeat") or 0, t.number)

    return [Candidate(sorted(ts, key=order)) for ts in sweep.config_groups(trials).values()]


def quality_tiers(sweep: SweepData, trials: list[TrialRecord]) -> dict[int, QualityTier]:
    """Per trial: is its config's eval loss separated from the best config's beyond the seed noise?

    Configs are the trials grouped by their knobs (seed repeats together); the best config has the lowest
    mean eval loss; another config is ``equal`` when the t-test of its values against the best's says
    p ≥ 0.05 (:func:`vramsweep.report.stats.compare`), ``worse`` when p < 0.05, ``unknown`` with a single
    run on both sides. Trials without an eval loss get no entry.
    """
    cands = [t for t in trials if t.eval_loss is not None]
    if not cands:
        return {}
    groups = sweep.config_groups(cands)
    values = {label: [t.eval_loss for t in ts] for label, ts in groups.items()}
    means = {label: statistics.fmean(v) for label, v in values.items()}  # type: ignore[arg-type]
    best = min(groups, key=lambda g: (means[g], min(t.number for t in groups[g])))
    out: dict[int, QualityTier] = {}
    for label, ts in groups.items():
        if label == best:
            tier = QualityTier(BEST, 0.0, None, means[best])
        else:
            c = compare(values[label], values[best])  # type: ignore[arg-type]
            if c is None or c.verdict == UNKNOWN:
                tier = QualityTier(UNKNOWN_Q, c.delta if c else None, None, means[label])
            elif c.verdict == NOISE:
                tier = QualityTier(EQUAL, c.delta, c.p, means[best])
            else:
                tier = QualityTier(WORSE, c.delta, c.p, means[label])
        for t in ts:
            out[t.number] = tier
    return out


def rank_key(
    trial: TrialRecord, prefer: str, tiers: dict[int, QualityTier] | None = None, *, use_loss: bool = True
) -> tuple:
    """Sort key: smaller is better (see the module docstring for the order); ``use_loss=False`` leaves the
    eval loss out (``--prefer speed`` over trials that scored different held-out tokens).

    With ``tiers`` (:func:`quality_tiers`), ``quality`` ranks on each config's mean eval loss, and every
    config not separated from the best config beyond noise (``best``/``equal``) on the best config's mean:
    a loss difference within noise counts as equal, so the cheaper, then faster, config wins. Without seed
    repeats (single trials per config) this is the plain order by eval loss.
    """
    inf = math.inf
    loss = trial.eval_loss if trial.eval_loss is not None and use_loss else inf
    tps = -trial.tokens_per_s if trial.tokens_per_s is not None else inf
    peak = trial.peak_bytes if trial.peak_bytes is not None else inf
    if prefer == "speed":
        return (tps, loss, peak, trial.number)
    if tiers is not None and trial.number in tiers:
        return (tiers[trial.number].rank_loss, peak, tps, loss, trial.number)
    return (loss, peak, tps, loss, trial.number)


def eligible(sweep: SweepData, limit_gib: float, min_tokens_per_s: float | None) -> list[Candidate]:
    """Configs (seed repeats together) whose ok trials all measured a peak ≤ ``limit_gib`` and (optionally)
    enough throughput (the unloaded mean, else the mean under load)."""
    out = []
    for c in candidates(sweep, [t for t in sweep.trials if t.ok]):
        if c.peak_gib is None or c.peak_gib > limit_gib:
            continue
        tps = c.shown_tps()
        if min_tokens_per_s is not None and (tps is None or tps < min_tokens_per_s):
            continue
        out.append(c)
    return out


def closest(
    sweep: SweepData, limit_gib: float, min_tokens_per_s: float | None, n: int = 3
) -> list[tuple[TrialRecord, str]]:
    """The ``n`` measured ok trials nearest to eligibility (smallest excess over the limit first)."""
    scored = []
    for t in sweep.trials:
        if not t.ok or t.peak_gib is None:
            continue
        over = max(0.0, t.peak_gib - limit_gib)
        short = 0.0
        why = []
        if over > 0:
            why.append(f"{gib(over)} GiB over")
        if min_tokens_per_s is not None:
            tps = t.tokens_per_s
            if tps is None or tps < min_tokens_per_s:
                short = 1.0 if tps is None else (min_tokens_per_s - tps) / min_tokens_per_s
                why.append(
                    f"{title(_TPS)} not measured"
                    if tps is None
                    else f"{title(_TPS)} {format_value(_TPS, tps)} < {min_tokens_per_s:g}"
                )
        scored.append(((over, short, t.peak_gib, t.number), t, ", ".join(why)))
    scored.sort(key=lambda x: x[0])
    return [(t, why) for _, t, why in scored[:n]]


# ---------------------------------------------------------------------------------------------
# experiment file
# ---------------------------------------------------------------------------------------------
def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts as ``{"a.b": value}`` (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        tree = tree.setdefault(p, {})
    tree[parts[-1]] = value


def train_command(name: str, conf: Path) -> str:
    """How to train experiment ``name`` written into ``conf`` (``--config-dir`` unless it is ``./conf``)."""
    local = (Path.cwd() / "conf").resolve()
    flag = "" if Path(conf).resolve() == local else f"--config-dir {shlex.quote(str(conf))} "
    return TRAIN_COMMAND.format(config_dir=flag, name=name)


def compose_in(conf_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """:func:`vramsweep.config.compose` with ``conf_dir`` as the user's conf dir, no rules (the trial
    already passed them), as a plain dict. Raises ReportError."""
    from omegaconf import OmegaConf

    try:
        container = OmegaConf.to_container(compose(overrides, conf_dir=conf_dir, rules="none"), resolve=True)
    except ConfigError as exc:
        raise ReportError(f"cannot compose {' '.join(overrides) or 'the defaults'}: {exc}") from exc
    return container if isinstance(container, dict) else {}


@dataclass
class ExperimentSpec:
    """What the experiment file selects (group options) and pins (values)."""

    groups: list[tuple[str, str]]
    pinned: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    checked_keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # header lines (the data paths as the sweep typed them)


def _yaml_scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def build_experiment(trial: TrialRecord, conf_dir: Path) -> ExperimentSpec:
    """Group options + pinned values that make ``+experiment=<name>`` compose to ``trial.config``."""

    cfg = trial.config or {}
    overridden = set(trial.override_map)
    if not cfg:
        # No composed config recorded (study-only trial): the overrides are all we know.
        groups, pinned = [], {}
        for k, v in trial.override_map.items():
            if "." not in k and find_option(k, v, conf_dir) is not None:
                groups.append((k, v))
            elif "." in k:
                _set(pinned, k, _yaml_scalar(v))
        return ExperimentSpec(groups, pinned, [], [k for k in trial.override_map])
    groups = []
    for section, value in cfg.items():
        if section in UNPINNED_TOP or not isinstance(value, dict):
            continue
        name = value.get("name")
        if isinstance(name, str) and find_option(section, name, conf_dir) is not None:
            groups.append((section, name))
    base = flatten(compose_in(conf_dir, [f"{g}={o}" for g, o in groups]))
    grouped = {g for g, _ in groups}
    pinned: dict[str, Any] = {}
    skipped: list[str] = []
    checked: list[str] = []
    for key, value in flatten({k: v for k, v in cfg.items() if k not in UNPINNED_TOP}).items():
        section = key.split(".")[0]
        if key in MEASUREMENT_KEYS:  # the trial's measurement budget and seed repeat, not the recipe
            continue
        if key not in base:
            skipped.append(key)
            continue
        checked.append(key)
        if section in grouped and key == f"{section}.name":
            continue  # selected by the defaults list
        if section in ALWAYS_PIN or key in overridden or base[key] != value:
            _set(pinned, key, value)
    return ExperimentSpec(groups, pinned, skipped, checked)


def experiment_yaml(spec: ExperimentSpec, header: list[str]) -> str:
    """The experiment file text: ``@package _global_`` first, header comments, defaults, pinned values."""
    from omegaconf import OmegaConf

    lines = ["# @package _global_"] + [f"# {h}" if h else "#" for h in header]
    if spec.groups:
        lines.append("defaults:")
        lines += [f"  - override /{g}: {json.dumps(o)}" for g, o in spec.groups]
    text = "\n".join(lines) + "\n"
    if spec.pinned:
        text += OmegaConf.to_yaml(OmegaConf.create(spec.pinned), sort_keys=False)
    return text


def verify_experiment(conf_dir: Path, name: str, trial: TrialRecord, spec: ExperimentSpec) -> list[str]:
    """Compose ``+experiment=<name>`` and list every checked key whose value differs from the trial's."""
    composed = flatten(compose_in(conf_dir, [f"+experiment={name}"]))
    if trial.config:
        want = flatten({k: v for k, v in trial.config.items() if k not in UNPINNED_TOP})
    else:
        want = {k: _yaml_scalar(v) for k, v in trial.override_map.items() if "." in k}
        want.update({f"{g}.name": o for g, o in spec.groups})
    diffs = []
    for key in spec.checked_keys or list(want):
        if key not in want:
            continue
        if key not in composed or composed[key] != want[key]:
            diffs.append(f"{key}: trial {want[key]!r}, experiment {composed.get(key, '<missing>')!r}")
    return diffs


# ---------------------------------------------------------------------------------------------
# production.md
# ---------------------------------------------------------------------------------------------
def point_label(sweep: SweepData, trial: TrialRecord, knobs: list[str]) -> str:
    """What a trial's config is, shortest first: an ablation point's change (``checkpointing=on``,
    ``(baseline)``), a stacking step's added knob (``+kernels=liger``), else the sweep's varying knobs; a
    seed repeat is marked ``(seed N)``."""
    d = trial.design or {}
    repeat = f" (seed {d['repeat']})" if d.get("repeat") else ""
    if d.get("kind") == "ablation":
        change = " ".join(str(o) for o in d.get("change") or [])
        return ("(baseline)" if d.get("role") == "baseline" or not change else change) + repeat
    if d.get("kind") == "stacking":
        return (f"+{d['added']}" if d.get("added") else "(baseline)") + repeat
    return sweep.knob_label(trial, knobs)


def candidates_table(
    sweep: SweepData,
    ranked: list[Candidate],
    budget_gib: float,
    n: int = TOP_N,
    tiers: dict[int, QualityTier] | None = None,
) -> Table:
    """The top ``n`` ranked configs, one row each (its seed repeats' trial numbers together); headroom =
    budget − measured peak; tokens/s measured only under load marked ``!``; quality = vs the best
    config's eval loss (``= best`` within noise)."""
    tiers = tiers or {}
    knobs = sweep.varying_knobs()
    tps_key = column(_TPS)
    names = view_metrics("pick")  # the registry's headline and ``pick`` view
    rows = [
        {
            "rank": i + 1,
            "trials": c.numbers,
            "knobs": point_label(sweep, c.rep, knobs),
            **metric_cells(c, names),  # type: ignore[arg-type]
            "headroom_gib": None if c.peak_gib is None else budget_gib - c.peak_gib,
            tps_key: scaled(_TPS, c.shown_tps()),
            "tps_loaded": c.speed_loaded,
            "quality_vs_best": tiers[c.number].text if c.number in tiers else "",
            "quality_p": tiers[c.number].p if c.number in tiers else None,
        }
        for i, c in enumerate(ranked[:n])
    ]
    cols = [
        Column("rank", lambda r: str(r["rank"])),
        Column("trials", lambda r: r["trials"], False),
        Column("knobs", lambda r: r["knobs"], False),
    ]
    for name, col in zip(names, view_columns("pick"), strict=True):
        cols += _candidate_columns(name, col, tps_key)
    return Table("candidates", "Top candidates", cols, rows)


def _candidate_columns(name: str, col: Column, tps_key: str) -> list[Column]:
    """The candidates table's column(s) of metric ``name``: memory with the headroom after it, tokens/s
    marked where measured only under load, eval loss with the quality tier after it, any other metric as
    the registry shows it (``detail`` ones left out first on a narrow terminal)."""
    if name == _PEAK:
        return [col, Column("headroom GiB", lambda r: gib(r["headroom_gib"]))]
    if name == _TPS:
        spec = value_format(_TPS)
        shown = Column(
            metric_label(_TPS),
            lambda r: fmt(r.get(tps_key), spec) + (f" {LOAD_MARK}" if r["tps_loaded"] else ""),
            metric=tps_key,
            kind="value",
        )
        return [shown]
    if name == _LOSS:
        return [col, Column("quality vs best", lambda r: r["quality_vs_best"], False)]
    return [col]


def _criterion(prefer: str) -> str:
    if prefer == "speed":
        return (
            "highest tokens/s measured without load, seed repeats averaged "
            "(ties: lower eval loss, lower peak memory, lower trial number)"
        )
    return (
        "lowest eval loss, seed repeats averaged, a loss within seed noise of the best counting as equal "
        "(ties: lower peak memory, higher tokens/s measured without load, lower trial number)"
    )


def _configs(c: Candidate) -> str:
    """``trial 0004`` for a single run, ``trials 4, 10`` for a config with seed repeats."""
    return f"trial {c.number:04d}" if len(c.trials) == 1 else f"trials {c.numbers}"


def _tie_break(winner: Candidate, best: Candidate) -> str:
    """What made ``winner`` (a quality tie with ``best``) the pick, as a clause ending in ``than``."""
    wp, bp = winner.peak_gib, best.peak_gib
    if wp is not None and bp is not None and wp < bp:
        return f"it needs {gib(bp - wp)} GiB less {title(_PEAK)} than"
    wt, bt = winner.tokens_per_s, best.tokens_per_s
    if wt is not None and (bt is None or wt > bt):
        return (
            f"with the same {title(_PEAK)} it is faster, measured without load "
            f"({_show(winner, _TPS)} vs {_show(best, _TPS, 'none unloaded')} {metric_label(_TPS)}), than"
        )
    return (
        f"with the same {title(_PEAK)} and no {metric_label(_TPS)} measured without load to tell them apart, "
        "the lower trial number decides over"
    )


def quality_note(winner: Candidate, ranked: list[Candidate], tiers: dict[int, QualityTier]) -> str | None:
    """Why the winner won on quality, in one sentence (None when noise played no part)."""
    if not tiers:
        return None
    tier = tiers.get(winner.number)
    best = next(c for c in ranked if c.number in tiers and tiers[c.number].verdict == BEST)
    if tier is not None and tier.verdict == EQUAL:
        return (
            f"the config of {_configs(winner)} has an {title(_LOSS)} within seed noise of the best config's "
            f"(Δ {format_value(_LOSS, tier.delta, sign=True)}, p {tier.p:.2f}): counted as equal, and "
            f"{_tie_break(winner, best)} the best config ({_configs(best)})"
        )
    if all(tiers[c.number].verdict in (BEST, UNKNOWN_Q) for c in ranked if c.number in tiers) and any(
        tiers[c.number].verdict == UNKNOWN_Q for c in ranked if c.number in tiers
    ):
        return "no seed repeats: noise unknown, eval losses compared as measured"
    return None


def _command(
    target: str, budget: float, min_tps: float | None, prefer: str, headroom: float, name: str | None
) -> str:
    cmd = f"vramsweep pick {safe_url(target)} --budget-gib {budget:g} --prefer {prefer}"
    if headroom:
        cmd += f" --headroom-gib {headroom:g}"
    if min_tps is not None:
        cmd += f" --min-tokens-per-s {min_tps:g}"
    if name:
        cmd += f" --name {name}"
    return cmd


def production_md(
    sweep: SweepData,
    winner: Candidate,
    ranked: list[Candidate],
    *,
    budget_gib: float,
    headroom_gib: float,
    min_tokens_per_s: float | None,
    prefer: str,
    exp_path: Path,
    name: str,
    command: str,
    warnings: list[str],
    tiers: dict[int, QualityTier] | None = None,
) -> str:
    """The ``production.md`` text."""
    tiers = tiers or {}
    why = quality_note(winner, ranked, tiers) if prefer == "quality" else None
    limit = budget_gib - headroom_gib
    peak = winner.peak_gib or 0.0
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cond = f"peak ≤ {budget_gib:g} GiB budget − {headroom_gib:g} GiB headroom = {limit:g} GiB"
    if min_tokens_per_s is not None:
        cond += f", tokens/s ≥ {min_tokens_per_s:g}"
    n_ok = sum(t.ok for t in sweep.trials)
    lines = [
        f"# Production config: {sweep.name}, {budget_gib:g} GiB",
        "",
        f"Chosen by `{command}` on {stamp}.",
        "",
        f"**Trial {winner.number}** won "
        f"({'its config: trials ' + winner.numbers if len(winner.trials) > 1 else 'a single run'}): "
        f"{_criterion(prefer)} among {len(ranked)} eligible config(s) ({cond}) out of "
        f"{len(sweep.trials)} ({n_ok} ok)." + (f" Quality: {why}." if why else ""),
        "",
        f"Experiment: `{exp_path}`; train it with `{train_command(name, exp_path.parent.parent)}`.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| measured peak | {gib(peak)} GiB ({winner.rep.memory_kind or 'kind not recorded'}) |",
        f"| budget | {budget_gib:g} GiB (headroom asked {headroom_gib:g} GiB) |",
        f"| headroom vs budget | {gib(budget_gib - peak)} GiB "
        f"({(budget_gib - peak) / budget_gib * 100:.1f} %) |",
        *(f"| {title(m)} | {_show(winner, m, 'not measured')} |" for m in _winner_metrics()),
        "| estimate | "
        f"{gib(est) + ' GiB' if (est := winner.rep.estimate_gib) is not None else 'none recorded'} |",
        f"| overrides | `{' '.join(winner.rep.overrides) or '(none)'}` |",
        "",
        "## Top candidates",
        "",
        candidates_table(sweep, ranked, budget_gib, tiers=tiers).markdown(),
        "",
    ]
    meta = winner.rep.meta or {}
    lines += ["## Versions", "", "| item | value |", "|---|---|"]
    for key in ("device", "git_sha", "seed", "started", "wall_s"):
        if meta.get(key) is not None:
            lines.append(f"| {key} | {meta[key]} |")
    versions = meta.get("versions") if isinstance(meta.get("versions"), dict) else {}
    for k in sorted(versions):
        lines.append(f"| {k} | {versions[k]} |")
    if not meta:
        lines.append("| (none recorded) | |")
    lines.append("")
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def default_name(sweep_name: str, budget_gib: float) -> str:
    """``<sweep>_<budget>gib`` with a file-safe sweep name (``15.5`` -> ``15p5``)."""
    slug = re.sub(r"[^A-Za-z0-9_\-]+", "_", sweep_name).strip("_-") or "sweep"
    return f"{slug}_{f'{budget_gib:g}'.replace('.', 'p')}gib"


def _err(msg: str) -> int:
    print(error_line("pick", msg), file=sys.stderr)
    return 2


def _check_args(
    budget_gib: float, min_tokens_per_s: float | None, prefer: str, headroom_gib: float
) -> str | None:
    if not isinstance(budget_gib, int | float) or not math.isfinite(budget_gib) or budget_gib <= 0:
        return f"--budget-gib must be a positive number (got {budget_gib!r})"
    if not isinstance(headroom_gib, int | float) or not math.isfinite(headroom_gib) or headroom_gib < 0:
        return f"--headroom-gib must be ≥ 0 (got {headroom_gib!r})"
    if headroom_gib >= budget_gib:
        return f"--headroom-gib {headroom_gib:g} leaves nothing of --budget-gib {budget_gib:g}"
    if min_tokens_per_s is not None and (not math.isfinite(min_tokens_per_s) or min_tokens_per_s < 0):
        return f"--min-tokens-per-s must be ≥ 0 (got {min_tokens_per_s!r})"
    if prefer not in PREFER:
        return f"--prefer {prefer!r} is not known (allowed: {', '.join(PREFER)})"
    return None


def _target_conf(name: str | None, conf_dir: str | None) -> Path:
    """The conf dir ``experiment/<name>.yaml`` goes into; :class:`ReportError` for a bad name or folder."""
    if name is not None and not NAME_RE.match(name):
        raise ReportError(
            f"--name {name!r} must be letters, digits, '_' or '-' (it becomes "
            "experiment/<name>.yaml in the conf dir)"
        )
    if conf_dir is None:
        try:
            conf = writable_conf_dir()
        except ConfigError as exc:
            raise ReportError(str(exc)) from None
    else:
        conf = Path(conf_dir).expanduser().resolve()
    if conf.exists() and not conf.is_dir():
        raise ReportError(f"the conf dir {conf} is not a folder")
    return conf


def _pin_warnings(winner: TrialRecord, spec: Any) -> list[str]:
    """What the pinned experiment cannot promise (said on stderr and in production.md)."""
    warnings: list[str] = []
    if spec.skipped:
        warnings.append(
            "not pinned (unknown to this conf, so this checkout cannot set them): " + ", ".join(spec.skipped)
        )
    if not winner.config:
        warnings.append(f"trial {winner.number:04d} has no recorded config: pinned from its overrides only")
    if winner.memory_kind == "cpu_tracked":
        warnings.append(
            "peak measured on CPU (tracked tensors): a GPU adds CUDA context and allocator slack; "
            "compare `vramsweep estimate` for the target card"
        )
    return warnings


def _pin_data(sweep: SweepData, winner: TrialRecord, spec: ExperimentSpec) -> list[str]:
    """Pin the winner's data files by absolute path with their sha256 beside them (the production run
    checks it); the warnings: data changed since the sweep, trials on different data."""
    from vramsweep.report.datacheck import data_pins, mixed_data_note

    pins, warnings = data_pins(winner)
    typed = (winner.config or {}).get("data") or {}
    for key, value in pins.items():
        _set(spec.pinned, f"data.{key}", value)
        if key in ("path", "eval_path") and typed.get(key) is not None:  # as run.json: typed kept beside
            spec.notes.append(f"data.{key}: {value} (absolute, resolved; the sweep typed {typed[key]!r})")
    spec.checked_keys = [k for k in spec.checked_keys if k.removeprefix("data.") not in pins]
    if note := mixed_data_note(sweep.trials):
        warnings.append(note)
    return warnings


def _pinned_header(
    command: str,
    sweep: SweepData,
    winner: Candidate,
    prefer: str,
    n_ranked: int,
    limit: float,
    min_tokens_per_s: float | None,
    name: str,
    conf: Path,
) -> list[str]:
    """The comment lines at the top of the experiment file: how, when and why it was pinned."""
    return [
        f"Pinned by `{command}`",
        f"on {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}: trial {winner.number} of "
        f"sweep '{sweep.name}', {_criterion(prefer)}",
        f"among {n_ranked} config(s) whose ok trials all peaked <= {limit:g} GiB"
        + (f" and tokens/s >= {min_tokens_per_s:g}" if min_tokens_per_s is not None else "")
        + ".",
        f"Measured ({_configs(winner)}): peak {_show(winner, _PEAK, unit=True)}, {title(_TPS)} "
        f"{_show(winner, _TPS, 'n/a')}, {title(_LOSS)} {_show(winner, _LOSS, 'n/a')}.",
        f"Train it: {train_command(name, conf)}",
    ]


def _print_pick(
    sweep: SweepData,
    winner: Candidate,
    ranked: list[Candidate],
    tiers: dict[int, QualityTier],
    budget_gib: float,
    prefer: str,
    prod_path: Path,
    warnings: list[str],
) -> None:
    """The terminal's account of the pick (120 columns): the winner, why, the candidates, the warnings."""
    print(
        wrap(
            f"Picked trial {winner.number:04d} of {sweep.name} for {budget_gib:g} GiB (prefer {prefer}"
            + (f"; its config's {len(winner.trials)} seed repeats averaged" if len(winner.trials) > 1 else "")
            + "): "
            f"peak {_show(winner, _PEAK, unit=True)} (headroom {gib(budget_gib - winner.peak_gib)} GiB), "
            f"{_show(winner, _TPS, 'n/a')} {metric_label(_TPS)}, {title(_LOSS)} {_show(winner, _LOSS, 'n/a')}"
        )
    )
    why = quality_note(winner, ranked, tiers) if prefer == "quality" else None
    if why:
        print(wrap(f"quality: {why}"))
    shown, notes = compact(candidates_table(sweep, ranked, budget_gib, tiers=tiers))
    print(shown)
    if notes:
        print(wrap(f"{' '.join(notes)} Every column: {prod_path}."))
    for w in warnings:
        print(wrap(f"vramsweep pick: warning: {w}"), file=sys.stderr)


class _Undo:
    """What ``pick`` wrote into the conf dir, undone when a later step fails: the experiment file gets its
    old text back (or is removed), and the folders it made (``<conf>/``, ``experiment/``) go again."""

    def __init__(self, exp_path: Path):
        self.path = exp_path
        self.old = exp_path.read_bytes() if exp_path.is_file() else None
        self.made = [d for d in (exp_path.parent.parent, exp_path.parent) if not d.exists()]

    def __call__(self) -> None:
        try:
            if self.old is not None:
                self.path.write_bytes(self.old)
            else:
                self.path.unlink(missing_ok=True)
            for d in reversed(self.made):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
        except OSError:
            pass  # the failure being reported matters more


def _write_experiment(
    exp_path: Path, conf: Path, name: str, spec: Any, header: list[str], winner: TrialRecord, undo: _Undo
) -> list[str]:
    """Write ``experiment/<name>.yaml`` and compose it back; returns the values it does not reproduce.
    ``OSError``: not written; :class:`ReportError`: it does not compose. Either way ``undo`` has run."""
    try:
        atomic_write_text(exp_path, experiment_yaml(spec, header))
        return verify_experiment(conf, name, winner, spec)
    except (OSError, ReportError):
        undo()
        raise


def _comparable_only(ok: list[Candidate]) -> list[Candidate]:
    """The eligible configs less those with a trial that could not score the sweep's reference held-out
    examples (its eval loss is over other tokens: it ranks nothing); said on stderr with why."""
    left = [c for c in ok if any(evalset.not_comparable(t) for t in c.trials)]
    if left:
        why = evalset.not_comparable_text(t for c in left for t in c.trials)
        print(
            "note: left out of the ranking, not comparable with the sweep's reference held-out examples: "
            f"{why}",
            file=sys.stderr,
        )
    return [c for c in ok if c not in left]


def run_pick(
    target: str,
    *,
    budget_gib: float,
    min_tokens_per_s: float | None = None,
    prefer: str = "quality",
    headroom_gib: float = 0.0,
    name: str | None = None,
    conf_dir: str | None = None,
    study: str | None = None,
) -> int:
    """Pick the best trial that fits ``budget_gib`` and write ``<conf>/experiment/<name>.yaml`` +
    ``production.md``.

    Args:
        target: sweep folder, ``sweep.json``/``study.db``, or Optuna storage URL.
        budget_gib: memory budget (GiB) the config must fit.
        min_tokens_per_s: optional throughput floor.
        prefer: ``quality`` (lowest eval loss) or ``speed`` (highest tokens/s).
        headroom_gib: keep this much of the budget free.
        name: experiment name (default ``<sweep>_<budget>gib``).
        conf_dir: the user's conf dir to write ``experiment/<name>.yaml`` into (created if missing; default
            :func:`vramsweep.config.compose.writable_conf_dir`: ``--config-dir``/``$VRAMSWEEP_CONFIG_DIR``,
            else ``./conf``), never the installed package.
        study: study name for storage targets holding several studies.

    Returns:
        0 written; 1 the written experiment failed to compose (undone); 2 bad input or nothing fits.
    """
    prefer = str(prefer).lower()
    problem = _check_args(budget_gib, min_tokens_per_s, prefer, headroom_gib)
    if problem:
        return _err(problem)
    if name is not None:
        name = name[:-5] if name.endswith(".yaml") else name
    try:
        conf = _target_conf(name, conf_dir)
        sweep = load_sweep(target, study=study)
    except ReportError as exc:
        return _err(str(exc))
    limit = budget_gib - headroom_gib
    ok = _comparable_only(eligible(sweep, limit, min_tokens_per_s))
    if prefer == "quality" and (rand := [t for c in ok for t in c.trials if random_weights(t.config)]):
        model = ((rand[0].config or {}).get("model") or {}).get("name", "?")
        return _err(
            f"--prefer quality: {len(rand)} eligible trial(s) of {sweep.name} trained random weights "
            f"(model={model} without model.path), so their eval losses rank nothing; use --prefer speed, "
            "or sweep with model.path=<Hugging Face folder>"
        )
    sp = evalset.split(sweep, [t for c in ok for t in c.trials if t.eval_loss is not None])
    if sp is not None and prefer == "quality":
        return _err(
            f"--prefer quality: {sp.message()}, so their eval losses do not rank; sweep with that key fixed "
            "(docs/DATA.md, Held-out loss), or use --prefer speed; nothing written"
        )
    if sp is not None:
        print(f"note: eval loss breaks no tie: {sp.message()}", file=sys.stderr)
    tiers = quality_tiers(sweep, [t for c in ok for t in c.trials]) if sp is None else {}
    ranked = sorted(ok, key=lambda t: rank_key(t, prefer, tiers, use_loss=sp is None))
    if not ranked:
        return _nothing_fits(sweep, budget_gib, headroom_gib, limit, min_tokens_per_s)
    command = _command(target, budget_gib, min_tokens_per_s, prefer, headroom_gib, name)
    return _pin_winner(
        sweep,
        ranked,
        tiers,
        conf,
        name or default_name(sweep.name, budget_gib),
        command,
        budget_gib=budget_gib,
        min_tokens_per_s=min_tokens_per_s,
        prefer=prefer,
        headroom_gib=headroom_gib,
    )


def _pin_winner(
    sweep: SweepData,
    ranked: list[Candidate],
    tiers: dict[int, QualityTier],
    conf: Path,
    name: str,
    command: str,
    *,
    budget_gib: float,
    min_tokens_per_s: float | None,
    prefer: str,
    headroom_gib: float,
) -> int:
    """Pin the first of ``ranked`` as ``<conf>/experiment/<name>.yaml`` (composed back to check it) and
    explain it in the sweep's ``production.md``; the exit code of :func:`run_pick` (the experiment is
    undone when it does not compose or ``production.md`` cannot be written)."""
    limit = budget_gib - headroom_gib
    winner = ranked[0]
    try:
        spec = build_experiment(winner.rep, conf)
    except ReportError as exc:
        return _err(f"cannot pin trial {winner.number:04d}: {exc}")
    warnings = _pin_warnings(winner.rep, spec) + _pin_data(sweep, winner.rep, spec)
    header = _pinned_header(command, sweep, winner, prefer, len(ranked), limit, min_tokens_per_s, name, conf)
    header += spec.notes
    exp_path = conf / "experiment" / f"{name}.yaml"
    existed = exp_path.exists()
    undo = _Undo(exp_path)
    try:
        diffs = _write_experiment(exp_path, conf, name, spec, header, winner.rep, undo)
    except OSError as exc:
        return _err(f"cannot write {exp_path}: {exc}")
    except ReportError as exc:
        print(
            f"vramsweep pick: error: the experiment for trial {winner.number:04d} does not compose "
            f"({exp_path} left as it was): {exc}",
            file=sys.stderr,
        )
        return 1
    if diffs:
        warnings.append("composing the experiment does not reproduce every value: " + "; ".join(diffs))
    out_dir = sweep.folder if sweep.folder is not None else Path.cwd()
    prod_path = out_dir / "production.md"
    try:
        atomic_write_text(
            prod_path,
            production_md(
                sweep,
                winner,
                ranked,
                budget_gib=budget_gib,
                headroom_gib=headroom_gib,
                min_tokens_per_s=min_tokens_per_s,
                prefer=prefer,
                exp_path=exp_path,
                name=name,
                command=command,
                warnings=warnings,
                tiers=tiers,
            ),
        )
    except OSError as exc:
        undo()  # production.md explains the experiment: neither is left without the other
        return _err(f"cannot write {prod_path}: {exc}")

    _print_pick(sweep, winner, ranked, tiers, budget_gib, prefer, prod_path, warnings)
    print(f"{'overwrote' if existed else 'wrote'} {exp_path}")
    print(f"wrote {prod_path}")
    print(f"train it: {train_command(name, conf)}")
    return 0


def _nothing_fits(
    sweep: SweepData, budget_gib: float, headroom_gib: float, limit: float, min_tokens_per_s: float | None
) -> int:
    cond = f"{budget_gib:g} GiB" + (f" − {headroom_gib:g} GiB headroom" if headroom_gib else "")
    if min_tokens_per_s is not None:
        cond += f" with tokens/s ≥ {min_tokens_per_s:g}"
    if not sweep.trials:
        where = sweep.folder if sweep.folder is not None else sweep.name
        return _err(f"no trial results in {where}: nothing to pick from")
    near = closest(sweep, limit, min_tokens_per_s)
    print(
        f"vramsweep pick: error: nothing fits {cond}: {len(sweep.trials)} trial(s), "
        f"{sum(t.ok for t in sweep.trials)} ok; nothing written.",
        file=sys.stderr,
    )
    if not near:
        from collections import Counter

        counts = Counter(t.status for t in sweep.trials)
        print(
            "no ok trial measured a peak (" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ")",
            file=sys.stderr,
        )
        return 2
    knobs = sweep.varying_knobs()
    table = Table(
        "closest",
        "Closest",
        [
            Column("trial", lambda r: str(r["trial"])),
            Column("knobs", lambda r: r["knobs"], False),
            *view_columns(None),  # the registry's headline metrics
            Column("why not", lambda r: r["why"], False),
        ],
        [
            {
                "trial": t.number,
                "knobs": point_label(sweep, t, knobs),
                **metric_cells(t, view_metrics()),
                "why": why,
            }
            for t, why in near
        ],
    )
    print(f"closest {len(near)}:", file=sys.stderr)
    print(table.markdown(), file=sys.stderr)
    return 2
