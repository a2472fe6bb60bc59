"""Report tables: trials, one-factor ablation, stacking, failures, estimate error, best feasible.

Each table is a :class:`Table`: raw rows (numbers unformatted, for CSV and W&B) plus display columns
(formatted strings, for Markdown and the terminal). Definitions used throughout:

* memory in GiB = ``peak_memory_bytes / 2**30``; every metric's header, number format and display unit
  come from the metric registry (:mod:`vramsweep.record.metrics`: ``label``, ``format_value``, ...); feasible
  = status ``ok`` and peak ≤ budget (when a budget is set); only feasible trials can be best or on the Pareto
  front;
* design points with seed repeats report mean ± sample standard deviation (n−1) over their ``ok``
  repeats; Δ columns compare means (Δ % relative to the reference mean);
* estimate error % = (estimate − measured) / measured × 100 (positive = over-prediction).
"""

from __future__ import annotations

import csv
import io
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vramsweep.record.metrics import (
    TIMING_METRICS,
    MetricName,
    column,
    delta_labels,
    format_value,
    is_quality_metric,
    scaled,
    short_label,
    value_format,
    view_metrics,
)
from vramsweep.record.metrics import label as metric_label
from vramsweep.record.metrics import metric as registry_entry
from vramsweep.report.evalset import (
    EvalSplit,
    comparable,
    held_out,
    not_comparable_text,
    same_eval_set,
    split,
)
from vramsweep.report.load import (
    REPEAT_KEYS,
    SweepData,
    TrialRecord,
    display_value,
    norm_value,
    override_dict,
)
from vramsweep.report.stats import NOISE, SIGNIFICANT, UNKNOWN, Comparison, compare

# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """Format a number with ``spec`` (e.g. ``.4f``, ``+.1f``); empty string for None."""
    return "" if value is None else f"{value:{spec}}{suffix}"


def fmt_pm(mean: float | None, std: float | None, spec: str) -> str:
    """``mean ± std`` (std only when repeats exist)."""
    if mean is None:
        return ""
    return f"{mean:{spec}} ± {std:{spec}}" if std is not None else f"{mean:{spec}}"


def gib(v: float | None) -> str:
    """A value already in GiB, formatted as peak memory is."""
    return fmt(v, value_format(MetricName.PEAK_MEMORY_BYTES))


def _clip(text: str | None, n: int = 200) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


@dataclass
class Column:
    """A display column: header and a function from a raw row to its cell text.

    ``metric`` (the raw-row key or key prefix it shows, e.g. ``peak_gib``) and ``kind`` let the terminal
    view (:mod:`vramsweep.report.terminal`) choose columns: ``label`` (what a row is), ``value`` (a
    metric's value), ``delta`` (a metric's marked Δ, the one with the noise mark), ``detail`` (other Δ
    columns), ``list`` (long lists such as trial numbers). ``terminal`` is the cell as the terminal shows
    it (Δ ± standard error and the noise mark), ``brief`` the same without the standard error.
    """

    header: str
    cell: Callable[[dict[str, Any]], str]
    numeric: bool = True
    metric: str | None = None
    kind: str = "label"
    terminal: Callable[[dict[str, Any]], str] | None = None
    brief: Callable[[dict[str, Any]], str] | None = None


@dataclass
class Table:
    """One report table: raw rows for CSV/W&B, display columns for Markdown."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    intro: str = ""
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[list[str]]:
        return [[c.cell(r) for c in self.columns] for r in self.rows]

    def markdown(self) -> str:
        """A padded GitHub pipe table (readable in a terminal too)."""
        headers = [c.header.replace("|", "\\|") for c in self.columns]
        body = [[cell.replace("|", "\\|") for cell in row] for row in self.cells()]
        widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(headers)]
        widths = [max(w, 3) for w in widths]

        def line(cells: list[str]) -> str:
            out = []
            for i, cell in enumerate(cells):
                out.append(cell.rjust(widths[i]) if self.columns[i].numeric else cell.ljust(widths[i]))
            return "| " + " | ".join(out) + " |"

        sep = (
            "|"
            + "|".join(
                ("-" * (w + 1) + ":") if c.numeric else ("-" * (w + 2)) for w, c in zip(widths, self.columns)
            )
            + "|"
        )
        return "\n".join([line(headers), sep] + [line(r) for r in body])

    def raw_columns(self) -> list[str]:
        """The raw keys of every row, in first-seen order, as plain strings (a ``MetricName`` key too:
        W&B tables take ``str`` only)."""
        keys: dict[str, None] = {}
        for r in self.rows:
            for k in r:
                keys.setdefault(str(k))
        return list(keys)


def csv_text(tables: Iterable[Table]) -> str:
    """All tables in one CSV: a leading ``table`` column, then the union of raw keys (empty = n/a)."""
    tables = list(tables)
    columns: dict[str, None] = {"table": None}
    for t in tables:
        for k in t.raw_columns():
            columns.setdefault(k)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for t in tables:
        for r in t.rows:
            row = {"table": t.name}
            for k, v in r.items():
                if v is None:
                    row[k] = ""
                elif isinstance(v, list | tuple):
                    row[k] = " ".join(str(x) for x in v)
                elif isinstance(v, float):
                    row[k] = repr(v)
                else:
                    row[k] = str(v)
            writer.writerow(row)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
#: Significance marks on Δ cells (see :mod:`vramsweep.report.stats` for the tests).
MARKS = {SIGNIFICANT: "*", NOISE: "~", UNKNOWN: "?"}
#: A held-out metric's Δ cell between trials that scored different held-out tokens (report/evalset.py).
NOT_COMPARABLE = "n/c"
#: Mark of a throughput delta measured under load (replaces the significance mark: not a finding).
LOAD_MARK = "!"
MARK_LEGEND = (
    "Δ ± standard error of the difference, then a mark: `*` exceeds the seed-to-seed noise (t-test, "
    "p < 0.05), `~` within noise, `?` noise unknown (a single run on both sides), "
    f"`{LOAD_MARK}` throughput measured under load or on a GPU shared with another trial (not a finding)."
)


@dataclass(frozen=True)
class MetricSpec:
    """A metric compared between design points (memory, speed, and every quality metric measured); made
    from the metric registry by :meth:`of`.

    Attributes:
        key: raw-row prefix (``peak_gib`` -> ``peak_gib_mean``, ``d_peak_gib``, ``p_peak_gib``, ...).
        metric: the result metric it comes from (``peak_memory_bytes`` for ``peak_gib``).
        header: value column header.
        spec: number format.
        delta_header: Δ (absolute) column header, or None.
        pct_header: Δ % column header, or None.
        speed: a throughput metric (flagged when measured under load).
    """

    key: str
    metric: str
    header: str
    spec: str
    delta_header: str | None = None
    pct_header: str | None = None
    speed: bool = False

    @classmethod
    def of(cls, name: str) -> MetricSpec:
        """The spec of metric ``name``: raw key, header, format and Δ headers from the registry."""
        delta, pct = delta_labels(name)
        return cls(
            column(name), name, metric_label(name), value_format(name), delta, pct, name in TIMING_METRICS
        )

    def value(self, trial: TrialRecord) -> float | None:
        """The trial's value in the display unit (memory in GiB)."""
        return scaled(self.metric, trial.metric(self.metric))

    @property
    def pct_key(self) -> str:
        """Raw key of the Δ % (``d_peak_pct`` for memory, ``d_<key>_pct`` otherwise)."""
        return "d_peak_pct" if self.metric == MetricName.PEAK_MEMORY_BYTES else f"d_{self.key}_pct"


def base_specs() -> tuple[MetricSpec, ...]:
    """The columns every ablation and stacking table shows: the registry's headline metrics."""
    return tuple(MetricSpec.of(m) for m in view_metrics())


def _stat_specs() -> tuple[MetricSpec, ...]:
    """Metrics whose mean and std every design point row carries (``<key>_mean``, ``<key>_std``): the
    headline and those tagged ``stats`` in the registry."""
    return tuple(MetricSpec.of(m) for m in view_metrics("stats"))


#: Quality metrics not given their own columns unless they are objectives (train loss is not held out,
#: ``initial_*`` metrics are measured before training, perplexity is exp(eval loss)).
_NOT_COMPARED = (MetricName.TRAIN_LOSS, MetricName.INITIAL_EVAL_LOSS, MetricName.EVAL_PPL)


def compared_metrics(sweep: SweepData) -> list[MetricSpec]:
    """The headline metrics (memory, tokens/s, eval loss), then every other objective and every quality
    metric (by name, see :func:`vramsweep.record.result.is_quality_metric`) that an ok trial measured: new
    metrics in the results get columns and significance marks without a change here."""
    out = list(base_specs())
    seen = {s.metric for s in out}
    names = [m for m, _ in sweep.objectives]
    for t in sweep.trials:
        if t.ok:
            names += [
                k
                for k in t.metrics
                if is_quality_metric(k) and k not in _NOT_COMPARED and not k.startswith("initial_")
            ]
    for name in names:
        if name in seen or not any(t.ok and t.metric(name) is not None for t in sweep.trials):
            continue
        seen.add(name)
        out.append(MetricSpec.of(name))
    return out


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std (n−1); std None for fewer than two values."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) >= 2 else None)


def ok_values(trials: Iterable[TrialRecord], get: Callable[[TrialRecord], float | None]) -> list[float]:
    """The measured values of the ``ok`` trials."""
    return [v for v in (get(t) for t in trials if t.ok) if v is not None]


def aggregate(trials: list[TrialRecord], specs: Iterable[MetricSpec] = ()) -> dict[str, Any]:
    """Mean/std of the measured metrics over the ``ok`` trials of one design point."""
    ok = [t for t in trials if t.ok]
    failed = Counter(t.status for t in trials if not t.ok)
    out: dict[str, Any] = {
        "n": len(trials),
        "n_ok": len(ok),
        "failed": ", ".join(f"{n} {s}" for s, n in sorted(failed.items())),
        "trials": [t.number for t in trials],
    }
    getters = {spec.key: spec.value for spec in _stat_specs()}
    for spec in specs:
        getters.setdefault(spec.key, spec.value)
    for key, get in getters.items():
        out[f"{key}_mean"], out[f"{key}_std"] = mean_std(ok_values(ok, get))
    return out


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else (a - b) / b * 100.0


def _n_cell(r: dict[str, Any]) -> str:
    text = f"{r['n_ok']}/{r['n']}"
    return f"{text} ({r['failed']})" if r.get("failed") else text


def _trials_cell(r: dict[str, Any]) -> str:
    return ",".join(str(n) for n in r["trials"])


def pareto_front(trials: Iterable[TrialRecord], objectives: list[tuple[str, str]]) -> list[TrialRecord]:
    """Non-dominated trials over ``objectives`` ((metric, minimize|maximize)); trials missing a value are
    out."""
    points = []
    for t in trials:
        vals = [t.metric(m) for m, _ in objectives]
        if any(v is None for v in vals):
            continue
        points.append((t, [v if d == "minimize" else -v for v, (_, d) in zip(vals, objectives)]))  # type: ignore[operator]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [t for t, v in points if not any(dominates(w, v) for _, w in points)]


# ---------------------------------------------------------------------------------------------
# design points (ablation / stacking): finished trials grouped per point
# ---------------------------------------------------------------------------------------------
@dataclass
class PointTrials:
    """The trials of one design point of the report (an ablation baseline/factor or a stacking step).

    Not :class:`vramsweep.sweeper.design.DesignPoint` (a planned trial); this groups finished results.
    """

    label: str
    change: list[str]
    trials: list[TrialRecord] = field(default_factory=list)
    step: int | None = None


def _value_for(trial: TrialRecord, key: str) -> str | None:
    om = trial.override_map
    if key in om:
        return norm_value(om[key])
    v = trial.knob_value(key)
    return None if v is None else norm_value(v)


def _matches(
    trial: TrialRecord, expected: dict[str, str], keys: set[str], changed: dict[str, set[str]]
) -> bool:
    """True when ``trial`` ran exactly ``expected`` on ``keys`` (keys not expected keep their non-design
    value)."""
    for k in keys:
        if k in REPEAT_KEYS:
            continue
        v = _value_for(trial, k)
        if k in expected:
            if v != norm_value(expected[k]):
                return False
        elif v is not None and v in changed.get(k, set()):
            return False
    return True


def _derive_allowed(sweep: SweepData, kind: str) -> bool:
    design = str(sweep.settings.get("design") or "").lower()
    return design in ("", kind)


def _place_recorded_ablation(
    t: TrialRecord, d: dict[str, Any], baseline: PointTrials, factors: dict[tuple[str, ...], PointTrials]
) -> None:
    """Add ``t`` by its ``meta.design`` ``d`` (ablation designs only): to ``baseline`` for the baseline role,
    else to the factor point of its ``change`` (created when new, ``(no change)`` for an empty one)."""
    if d.get("kind") != "ablation":
        return
    if d.get("role") == "baseline":
        baseline.trials.append(t)
    else:
        ch = [str(o) for o in d.get("change") or []]
        factors.setdefault(tuple(ch), PointTrials(" ".join(ch) or "(no change)", ch)).trials.append(t)


def _place_derived_ablation(
    t: TrialRecord,
    b: dict[str, str],
    keys: set[str],
    changed: dict[str, set[str]],
    baseline: PointTrials,
    factors: dict[tuple[str, ...], PointTrials],
) -> None:
    """Add ``t`` (no ``meta.design``) to ``baseline`` when it ran the baseline overrides ``b``, else to the
    first factor point whose change on top of ``b`` it ran (:func:`_matches` on ``keys``); else nowhere."""
    if _matches(t, b, keys, changed):
        baseline.trials.append(t)
        return
    for ch, point in factors.items():
        if _matches(t, {**b, **override_dict(ch)}, keys, changed):
            point.trials.append(t)
            break


def ablation_rows(sweep: SweepData) -> tuple[PointTrials, list[PointTrials]] | None:
    """Baseline and one-factor points from ``meta.design`` roles, else derived from ``sweep.json``."""
    baseline = PointTrials("baseline", [str(o) for o in sweep.settings.get("baseline") or []])
    factors: dict[tuple[str, ...], PointTrials] = {}
    for change in sweep.settings.get("factors") or []:
        ch = [str(o) for o in (change if isinstance(change, list | tuple) else [change])]
        factors.setdefault(tuple(ch), PointTrials(" ".join(ch), ch))
    derive = _derive_allowed(sweep, "ablation") and sweep.settings.get("baseline") is not None and factors
    b = override_dict(baseline.change)
    keys = set(b)
    changed: dict[str, set[str]] = {}
    for ch in factors:
        for k, v in override_dict(ch).items():
            keys.add(k)
            changed.setdefault(k, set()).add(norm_value(v))
    for t in sweep.trials:
        if (d := t.design) is not None:
            _place_recorded_ablation(t, d, baseline, factors)
        elif derive:
            _place_derived_ablation(t, b, keys, changed, baseline, factors)
    if not baseline.trials and not any(p.trials for p in factors.values()):
        return None
    return baseline, [p for p in factors.values() if p.trials]


def stacking_rows(sweep: SweepData) -> list[PointTrials] | None:
    """Stacking steps in order (step 0 = baseline) from ``meta.design``, else derived from ``sweep.json``."""
    stack = [str(o) for o in sweep.settings.get("stack") or []]
    points: dict[int, PointTrials] = {}
    derive = _derive_allowed(sweep, "stacking") and bool(stack)
    base = override_dict(sweep.settings.get("baseline") or [])
    expected: list[dict[str, str]] = []
    cur = dict(base)
    expected.append(dict(cur))
    for o in stack:
        cur.update(override_dict([o]))
        expected.append(dict(cur))
    keys = set(base) | set(override_dict(stack))
    changed: dict[str, set[str]] = {}
    for o in stack:
        for k, v in override_dict([o]).items():
            changed.setdefault(k, set()).add(norm_value(v))
    for t in sweep.trials:
        d = t.design
        if d is not None:
            if d.get("kind") != "stacking" or not isinstance(d.get("step"), int):
                continue
            step = int(d["step"])
            added = d.get("added")
            label = str(added) if added else ("(baseline)" if step == 0 else f"step {step}")
            applied = [str(o) for o in d.get("applied") or []]
            points.setdefault(step, PointTrials(label, applied, step=step)).trials.append(t)
            continue
        if not derive:
            continue
        # The last step a trial matches wins (a later step can coincide with an earlier one's values).
        for step in range(len(expected) - 1, -1, -1):
            if _matches(t, expected[step], keys, changed):
                label = stack[step - 1] if step > 0 else "(baseline)"
                points.setdefault(step, PointTrials(label, stack[:step], step=step)).trials.append(t)
                break
    if not points:
        return None
    return [points[s] for s in sorted(points)]


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def _fits_text(sweep: SweepData, t: TrialRecord) -> str:
    if not t.ok:
        return "no"
    f = sweep.fits(t)
    return "n/a" if f is None else ("yes" if f else "no")


def metric_column(name: str, kind: str = "value", *, key: str | None = None) -> Column:
    """The display column of metric ``name``: its registry label and format, on raw key ``key`` (default
    the registry's :func:`~vramsweep.record.metrics.column`, ``peak_gib`` for peak memory), which holds
    the value in its display unit."""
    key = key or column(name)
    spec = value_format(name)
    return Column(metric_label(name), lambda r: fmt(r.get(key), spec), metric=key, kind=kind)


def metric_cells(trial: TrialRecord, names: Iterable[str]) -> dict[str, float | None]:
    """``{column(name): value in the display unit}`` of ``trial`` for each metric (the raw row of
    :func:`metric_column`)."""
    return {column(n): scaled(n, trial.metric(n)) for n in names}


def view_columns(view: str | None) -> list[Column]:
    """The metric columns of default view ``view`` (:func:`~vramsweep.record.metrics.view_metrics`; None:
    the headline alone), each
    of kind ``detail`` (files only on a narrow terminal) where the registry says so, else ``value``."""
    return [metric_column(m, "detail" if registry_entry(m).detail else "value") for m in view_metrics(view)]


def trials_table(sweep: SweepData) -> Table:
    knobs = sweep.varying_knobs()
    rows = []
    for t in sweep.trials:
        r: dict[str, Any] = {"trial": t.number, "status": t.status}
        for k in knobs:
            r[k] = t.knob_value(k)
        names = view_metrics("trials")  # peak memory: in GiB, then in bytes and its kind
        first = [m for m in names if m == MetricName.PEAK_MEMORY_BYTES]
        others = [m for m in names if m != MetricName.PEAK_MEMORY_BYTES]
        r.update(
            {
                **metric_cells(t, first),
                MetricName.PEAK_MEMORY_BYTES: t.peak_bytes,
                MetricName.MEMORY_KIND: t.memory_kind,
                **metric_cells(t, others),
                "estimate_gib": t.estimate_gib,
                "estimate_error_pct": t.estimate_error_pct,
                "budget_gib": sweep.trial_budget_gib(t),
                "fits": _fits_text(sweep, t),
                "feasible": sweep.feasible(t),
                "reason": t.reason,
                "timing_disturbed": t.timing_disturbed,
                "gpu_share": _gpu_share_text(t),
                "overrides": list(t.overrides),
            }
        )
        rows.append(r)
    cols = [Column("trial", lambda r: str(r["trial"])), Column("status", lambda r: r["status"], False)]
    for k in knobs:
        cols.append(Column(k, (lambda key: lambda r: display_value(r[key]))(k), False))
    cols += view_columns("trials")
    cols += [
        Column("est GiB", lambda r: gib(r["estimate_gib"]), metric="estimate_gib", kind="detail"),
        Column(
            "est err %",
            lambda r: fmt(r["estimate_error_pct"], "+.1f"),
            metric="estimate_error_pct",
            kind="detail",
        ),
        Column("fits", lambda r: r["fits"], False),
    ]
    if any(r["gpu_share"] for r in rows):  # trials_per_gpu: whose throughput was measured beside another
        cols.append(Column("GPU", lambda r: r["gpu_share"] or "", False))
    budget = sweep.budget_gib
    intro = (
        f"Budget {budget:g} GiB: fits = status ok and peak ≤ budget."
        if budget is not None
        else "No memory budget set (sweep.json budget_gib / hardware.budget_gib are 0): fits = n/a."
    )
    return Table("trials", "Trials", cols, rows, intro=intro)


def _compare_into(
    r: dict[str, Any], point: PointTrials, ref: PointTrials | None, specs: list[MetricSpec], pfx: str
) -> None:
    """Δ, its standard error, p-value and verdict of ``point`` vs ``ref`` for every metric, into row ``r``
    (keys ``d_<pfx><key>``, ``d_<pfx><key>_pct``, ``se_<pfx><key>``, ``p_<pfx><key>``, ``sig_<pfx><key>``)."""
    loaded = _loaded(point.trials) + (_loaded(ref.trials) if ref is not None else [])
    r[f"loaded_{pfx}".rstrip("_")] = "; ".join(f"trial {n}: {why}" for n, why in loaded) or None
    oks = [t for t in point.trials if t.ok] + ([t for t in ref.trials if t.ok] if ref is not None else [])
    other_eval_set = ref is not None and not same_eval_set(oks, [])
    for spec in specs:
        a = ok_values(point.trials, spec.value)
        b = ok_values(ref.trials, spec.value) if ref is not None else []
        # held-out metrics over different held-out tokens: no Δ, the cell says n/c (report/evalset.py)
        nc = other_eval_set and held_out(spec.metric) and bool(a) and bool(b)
        if nc:
            r[f"nc_{pfx}{spec.key}"] = True
        c: Comparison | None = None if nc else compare(a, b)
        pct = f"d_{pfx}{spec.pct_key[2:]}"
        ref_mean = statistics.fmean(b) if b else None
        r[f"d_{pfx}{spec.key}"] = c.delta if c else None
        r[pct] = _pct(statistics.fmean(a), ref_mean) if c else None
        r[f"se_{pfx}{spec.key}"] = c.se if c else None
        r[f"se_{pfx}{spec.pct_key[2:]}"] = (
            c.se / abs(ref_mean) * 100.0 if c and c.se is not None and ref_mean else None
        )
        r[f"p_{pfx}{spec.key}"] = c.p if c else None
        r[f"sig_{pfx}{spec.key}"] = c.verdict if c else None
        r[f"test_{pfx}{spec.key}"] = c.test if c else None


def _gpu_share_text(t: TrialRecord) -> str | None:
    """The trials table's GPU cell: ``shared`` (throughput not the card's own) or ``alone``."""
    gs = t.meta.get("gpu_share")
    if not isinstance(gs, dict):
        return None
    return f"{gs.get('device')} shared" if t.gpu_shared else f"{gs.get('device')} alone"


def _loaded(trials: list[TrialRecord]) -> list[tuple[int, str]]:
    return [(t.number, why) for t in trials if t.ok and (why := t.timing_disturbed)]


def _mark(r: dict[str, Any], spec: MetricSpec, pfx: str) -> str:
    verdict = r.get(f"sig_{pfx}{spec.key}")
    if verdict is None:
        return ""
    if spec.speed and r.get(f"loaded_{pfx}".rstrip("_")):
        return LOAD_MARK
    return MARKS[verdict]


def _delta_cell(
    spec: MetricSpec, pfx: str, pct: bool, se: bool = True, marked: bool | None = None
) -> Callable[[dict[str, Any]], str]:
    """Δ (or Δ %) ± its standard error (unless ``se=False``), and the mark on the metric's main Δ column
    (``marked`` forces the standard error and mark on or off: the terminal marks memory's Δ %)."""
    key = f"{pfx}{spec.pct_key[2:]}" if pct else f"{pfx}{spec.key}"
    num_spec = "+.1f" if pct else "+" + spec.spec
    se_spec = ".1f" if pct else spec.spec
    if marked is None:
        marked = pct == (spec.delta_header is None)

    def cell(r: dict[str, Any]) -> str:
        if r.get(f"nc_{pfx}{spec.key}"):
            return NOT_COMPARABLE
        d = r.get(f"d_{key}")
        if d is None:
            return ""
        text = f"{d:{num_spec}}"
        se_v = r.get(f"se_{key}")
        if se and se_v is not None and marked:
            text += f" ± {se_v:{se_spec}}"
        if marked:
            text += f" {_mark(r, spec, pfx)}"
        return text

    return cell


def _metric_columns(specs: list[MetricSpec], pfx: str, header_pfx: str = "") -> list[Column]:
    cols = []
    for spec in specs:
        cols.append(
            Column(
                spec.header,
                (lambda k, f: lambda r: fmt_pm(r.get(f"{k}_mean"), r.get(f"{k}_std"), f))(
                    spec.key, spec.spec
                ),
                metric=spec.key,
                kind="value",
            )
        )
        for header, pct in ((spec.delta_header, False), (spec.pct_header, True)):
            if header:
                # the terminal shows one Δ per metric, with its noise mark: in % where there is one
                on_terminal = pct == (spec.pct_header is not None)
                cols.append(
                    Column(
                        _hdr(header, header_pfx),
                        _delta_cell(spec, pfx, pct=pct),
                        metric=spec.key,
                        kind="delta" if on_terminal else "detail",
                        terminal=_delta_cell(spec, pfx, pct=pct, marked=True) if on_terminal else None,
                        brief=_delta_cell(spec, pfx, pct=pct, se=False, marked=True) if on_terminal else None,
                    )
                )
    return cols


def _hdr(header: str, pfx: str) -> str:
    """``Δ mem GiB`` -> ``Δ prev GiB``, ``Δ tok/s %`` -> ``Δ prev tok/s %`` (stacking)."""
    if not pfx:
        return header
    mem = f"Δ {short_label(MetricName.PEAK_MEMORY_BYTES)} "
    rest = header[len(mem) :] if header.startswith(mem) else header[len("Δ ") :]
    return f"Δ {pfx} {rest}"


def _noise_notes(rows: list[dict[str, Any]], specs: list[MetricSpec], pfx: str) -> list[str]:
    """Say so when the noise is unknown everywhere (no repeats): then nothing is marked significant."""
    verdicts = [r.get(f"sig_{pfx}{s.key}") for r in rows for s in specs]
    verdicts = [v for v in verdicts if v is not None]
    notes = []
    if verdicts and all(v == UNKNOWN for v in verdicts):
        notes.append(
            "No repeats: noise unknown. Every Δ is the difference of single runs and none is marked "
            "significant; run seed repeats (sweep.repeats ≥ 2) to tell effects from noise."
        )
    return notes


def _eval_set_notes(sweep: SweepData, rows: list[dict[str, Any]], points: list[PointTrials]) -> list[str]:
    """Why held-out Δ cells say n/c: the compared trials scored different held-out tokens, and the knob."""
    if not any(k.startswith("nc_") and v for r in rows for k, v in r.items()):
        return []
    oks = [t for p in points for t in p.trials if t.ok]
    sp = split(sweep, oks)
    whys = [sp.message()] if sp is not None else []
    if nc := not_comparable_text(oks):
        whys.append(f"not comparable with the sweep's reference held-out examples: {nc}")
    why = "; ".join(whys) or "the trials scored different held-out tokens"
    return [
        f"{NOT_COMPARABLE}: held-out metrics not compared (eval loss, ppl, task score, fact/control): {why}. "
        "Fix that key across the sweep to compare them (docs/DATA.md, Held-out loss)."
    ]


def _load_notes(points: list[PointTrials]) -> list[str]:
    """Which trials measured their throughput under load (``meta.timing_conditions``), and why."""
    loaded = sorted({n: why for p in points for n, why in _loaded(p.trials)}.items())
    if not loaded:
        return []
    if len(loaded) > 3:  # one line, not a paragraph: the reasons per trial are in the trials table/CSV
        return [
            f"Throughput measured under load ({LOAD_MARK}: not a finding): {len(loaded)} trials "
            f"({', '.join(str(n) for n, _ in loaded)}), e.g. trial {loaded[0][0]}: {loaded[0][1]}."
        ]
    return [
        f"Throughput measured under load ({LOAD_MARK}: not a finding): "
        + "; ".join(f"trial {n} ({why})" for n, why in loaded)
        + "."
    ]


def _point_row(
    point: PointTrials, ref: PointTrials | None, specs: list[MetricSpec], pfx: str = "", **extra: Any
) -> dict[str, Any]:
    r = {**extra, **aggregate(point.trials, specs)}
    _compare_into(r, point, ref, specs, pfx)
    return r


def ablation_table(sweep: SweepData) -> Table | None:
    found = ablation_rows(sweep)
    if found is None:
        return None
    baseline, factors = found
    specs = compared_metrics(sweep)
    ref = baseline if baseline.trials and any(t.ok for t in baseline.trials) else None
    base_row = _point_row(baseline, None, specs, change="baseline", role="baseline")
    rows = [base_row] if baseline.trials else []
    rows += [_point_row(p, ref, specs, change=p.label, role="factor") for p in factors]
    cols = [Column("change", lambda r: r["change"], False), Column("n ok", _n_cell, False)]
    cols += _metric_columns(specs, "")
    cols.append(Column("trials", _trials_cell, False, kind="list"))
    b = " ".join(baseline.change) or "(overrides of the baseline trials)"
    intro = (
        f"Each change applied alone to the baseline `{b}`. Values: mean ± std over ok seed repeats. "
        + MARK_LEGEND
    )
    notes = []
    if not baseline.trials:
        notes.append("No baseline trial found: Δ columns are empty.")
    elif not base_row["n_ok"]:
        notes.append("Every baseline trial failed: Δ columns are empty.")
    notes += _noise_notes(rows, specs, "") if ref is not None else []
    notes += _eval_set_notes(sweep, rows, [baseline, *factors])
    notes += _load_notes([baseline, *factors])
    return Table("ablation", "One-factor ablation", cols, rows, intro=intro, notes=notes)


def stacking_table(sweep: SweepData) -> Table | None:
    points = stacking_rows(sweep)
    if points is None:
        return None
    specs = compared_metrics(sweep)
    rows: list[dict[str, Any]] = []
    start: dict[str, Any] | None = None
    prev: PointTrials | None = None
    relative = [s for s in specs if s.pct_header]  # compared with the start too (memory, tokens/s)
    for p in points:
        r = _point_row(p, prev, specs, "prev_", step=p.step, added=p.label, applied=list(p.change))
        for s in relative:
            mean = f"{s.key}_mean"
            r[f"d_start_{s.pct_key[2:]}"] = _pct(r[mean], start[mean]) if start else None
        if start is None:
            start = r
        prev = p
        rows.append(r)
    cols = [
        Column("step", lambda r: str(r["step"])),
        Column("added", lambda r: r["added"], False),
        Column("n ok", _n_cell, False),
    ]
    cols += _metric_columns(specs, "prev_", "prev")
    cols += [
        Column(
            f"{short_label(s.metric)} vs start %",
            (lambda k: lambda r: fmt(r[k], "+.1f"))(f"d_start_{s.pct_key[2:]}"),
            kind="detail",
        )
        for s in relative
    ]
    cols.append(Column("trials", _trials_cell, False, kind="list"))
    intro = (
        "Optimisations added one at a time, in order; each row is the cumulative config after that step. "
        "Δ prev compares with the step before (empty when either is unmeasured). " + MARK_LEGEND
    )
    notes = _noise_notes(rows, specs, "prev_") + _eval_set_notes(sweep, rows, points) + _load_notes(points)
    return Table("stacking", "Stacking", cols, rows, intro=intro, notes=notes)


def failures_table(sweep: SweepData) -> Table:
    knobs = sweep.varying_knobs()
    rows = []
    for t in sweep.trials:
        if t.ok:
            if sweep.fits(t) is False:
                budget = sweep.trial_budget_gib(t)
                peak = format_value(MetricName.PEAK_MEMORY_BYTES, t.peak_bytes, unit=True)
                why = (
                    f"peak {peak} > budget {budget:g} GiB"
                    if peak
                    else f"peak not measured (budget {budget:g} GiB)"
                )
                rows.append(
                    {
                        "trial": t.number,
                        "class": "over_budget",
                        "reason": why,
                        "knobs": sweep.knob_label(t, knobs),
                    }
                )
            continue
        rows.append(
            {"trial": t.number, "class": t.status, "reason": t.reason, "knobs": sweep.knob_label(t, knobs)}
        )
    cols = [
        Column("trial", lambda r: str(r["trial"])),
        Column("class", lambda r: r["class"], False),
        Column("knobs", lambda r: r["knobs"], False),
        Column("reason", lambda r: _clip(r["reason"]), False),
    ]
    counts = Counter(r["class"] for r in rows)
    intro = (
        "None: every trial finished ok within the budget."
        if not rows
        else "Trials that cannot be best: " + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) + "."
    )
    return Table("failures", "Failures and infeasible trials", cols, rows, intro=intro)


def estimate_tables(sweep: SweepData) -> tuple[Table, Table] | None:
    """Per-trial and per-knob estimate error, for trials with both an estimate and a measured peak."""
    knobs = sweep.varying_knobs()
    with_est = [t for t in sweep.trials if t.estimate_error_pct is not None]
    if not with_est:
        return None
    rows = [
        {
            "trial": t.number,
            "knobs": sweep.knob_label(t, knobs),
            "estimate_gib": t.estimate_gib,
            **metric_cells(t, [MetricName.PEAK_MEMORY_BYTES]),
            "error_gib": _delta(t.estimate_gib, t.peak_gib),
            "error_pct": t.estimate_error_pct,
            MetricName.MEMORY_KIND: t.memory_kind,
        }
        for t in with_est
    ]
    per_trial = Table(
        "estimate_error",
        "Estimate error per trial",
        [
            Column("trial", lambda r: str(r["trial"])),
            Column("knobs", lambda r: r["knobs"], False),
            Column("estimate GiB", lambda r: gib(r["estimate_gib"])),
            Column("measured GiB", lambda r: gib(r[column(MetricName.PEAK_MEMORY_BYTES)])),
            Column("error GiB", lambda r: fmt(r["error_gib"], "+.4f")),
            Column("error %", lambda r: fmt(r["error_pct"], "+.1f")),
        ],
        rows,
        intro="error % = (estimate − measured) / measured × 100; positive = over-prediction.",
    )
    krows = []
    for k in (k for k in knobs if k not in REPEAT_KEYS):
        groups: dict[str, list[float]] = {}
        for t in with_est:
            groups.setdefault(display_value(t.knob_value(k)), []).append(t.estimate_error_pct)  # type: ignore[arg-type]
        for value, errs in groups.items():
            krows.append(
                {
                    "knob": k,
                    "value": value,
                    "n": len(errs),
                    "mean_error_pct": statistics.fmean(errs),
                    "mean_abs_error_pct": statistics.fmean(abs(e) for e in errs),
                    "max_abs_error_pct": max(abs(e) for e in errs),
                }
            )
    per_knob = Table(
        "estimate_error_by_knob",
        "Estimate error per knob",
        [
            Column("knob", lambda r: r["knob"], False),
            Column("value", lambda r: r["value"], False),
            Column("n", lambda r: str(r["n"])),
            Column("mean error %", lambda r: fmt(r["mean_error_pct"], "+.1f")),
            Column("mean abs error %", lambda r: fmt(r["mean_abs_error_pct"], ".1f")),
            Column("max abs error %", lambda r: fmt(r["max_abs_error_pct"], ".1f")),
        ],
        krows,
    )
    return per_trial, per_knob


def metric_text(metric: str, value: float | None) -> str:
    """A stored metric value as shown, with its display unit (``12.3456 GiB``): the registry's format."""
    return format_value(metric, value, unit=True)


def _noise_text(within: list[str], unknown: list[str], n_other: int) -> str:
    if n_other == 0:
        return "only config"
    if len(unknown) == n_other:
        return "no repeats: noise unknown"
    parts = []
    if within:
        shown = ", ".join(within[:3]) + (", …" if len(within) > 3 else "")
        parts.append(f"within noise of {len(within)} of {n_other} other configs ({shown}): not a finding")
    if unknown:
        parts.append(f"noise unknown vs {len(unknown)}")
    if not within:
        parts.insert(0, f"better than all {n_other - len(unknown)} other configs beyond noise")
    return "; ".join(parts)


def _diff_label(base: str, other: str) -> str:
    """The ``key=value`` pairs of config label ``other`` that differ from ``base`` (short table cells)."""
    mine = set(base.split(" "))
    diff = [kv for kv in other.split(" ") if kv not in mine]
    return " ".join(diff) or other


def best_config(
    sweep: SweepData, trials: list[TrialRecord], metric: str, direction: str
) -> tuple[TrialRecord, dict[str, Any]] | None:
    """The best config on ``metric`` (by its mean over ok seed repeats; ties: lower trial number), its best
    trial, and which other configs it is not separated from (t-test of the configs' values, p ≥ 0.05).

    Returns ``(trial, info)`` with ``info`` = ``config``, ``within_noise`` (configs not separated from the
    best, as their differences to it, ``; ``-joined), ``noise_unknown`` (single runs on both sides,
    ``; ``-joined), ``n_other``, ``noise`` (a sentence); None when no trial has a value.
    """
    cands = [t for t in trials if t.metric(metric) is not None]
    if held_out(metric):  # a trial that could not score the sweep's reference ranks on no held-out metric
        cands = comparable(cands)
    if not cands:
        return None
    sign = 1.0 if direction == "minimize" else -1.0
    groups = sweep.config_groups(cands)
    values = {label: [t.metric(metric) for t in ts] for label, ts in groups.items()}

    def config_rank(label: str) -> tuple[float, int]:
        return (sign * statistics.fmean(values[label]), min(t.number for t in groups[label]))  # type: ignore[arg-type]

    label = min(groups, key=config_rank)
    best = min(groups[label], key=lambda t: (sign * t.metric(metric), t.number))  # type: ignore[operator]
    within, unknown = [], []
    for other, vals in values.items():
        if other == label:
            continue
        c = compare(vals, values[label])  # type: ignore[arg-type]
        short = _diff_label(label, other)
        if c is None or c.verdict == UNKNOWN:
            unknown.append(short)
        elif c.verdict == NOISE:
            within.append(short)
    n_other = len(groups) - 1
    info = {
        "config": label,
        "within_noise": "; ".join(within),
        "noise_unknown": "; ".join(unknown),
        "n_other": n_other,
        "noise": _noise_text(within, unknown, n_other),
    }
    return best, info


def ranked_objectives(
    sweep: SweepData, trials: list[TrialRecord]
) -> tuple[list[tuple[str, str]], dict[str, EvalSplit]]:
    """The objectives ``trials`` can be ranked on, and the held-out ones they cannot: metric -> the
    :class:`~vramsweep.report.evalset.EvalSplit` of trials that scored different held-out tokens."""
    unranked: dict[str, EvalSplit] = {}
    for metric, _ in sweep.objectives:
        if held_out(metric) and (sp := split(sweep, [t for t in trials if t.metric(metric) is not None])):
            unranked[metric] = sp
    return [(m, d) for m, d in sweep.objectives if m not in unranked], unranked


def best_table(sweep: SweepData) -> Table:
    """Best feasible config per objective (by its mean over seed repeats; its best trial shown), whether it
    is separated from the other configs beyond noise, and the feasible Pareto front."""
    knobs = sweep.varying_knobs()
    feasible = [t for t in sweep.trials if sweep.feasible(t)]
    rows = []
    front_objectives, unranked = ranked_objectives(sweep, feasible)
    for metric, direction in sweep.objectives:
        sp = unranked.get(metric)
        found = None if sp is not None else best_config(sweep, feasible, metric, direction)
        if found is None:
            rows.append(
                {
                    "objective": metric,
                    "direction": direction,
                    "trial": None,
                    "value": None,
                    "knobs": "",
                    "noise": f"not ranked: {sp.message()}" if sp is not None else "",
                }
            )
            continue
        best, info = found
        rows.append(
            {
                "objective": metric,
                "direction": direction,
                "trial": best.number,
                "value": best.metric(metric),
                "knobs": sweep.knob_label(best, knobs),
                **info,
            }
        )
    held = any(held_out(m) for m, _ in front_objectives)
    front = pareto_front(comparable(feasible) if held else feasible, front_objectives)
    objs = ", ".join(f"{m} {'↓' if d == 'minimize' else '↑'}" for m, d in front_objectives)
    if unranked:
        objs += f" ({', '.join(unranked)} left out: the trials scored different held-out tokens)"
    if (nc := not_comparable_text(feasible)) and any(held_out(m) for m, _ in sweep.objectives):
        objs += f"; left out of the held-out rankings, not comparable with the sweep's reference: {nc}"
    intro = (
        f"Feasible trials only ({len(feasible)} of {len(sweep.trials)}). Best = the config with "
        "the best mean over its seed repeats (its best trial shown); vs other configs: which it "
        "beats beyond the seed-to-seed noise (t-test, p < 0.05). "
        f"Pareto front over {objs}: " + (", ".join(f"trial {t.number:04d}" for t in front) or "empty") + "."
    )
    return Table(
        "best",
        "Best feasible",
        [
            Column("objective", lambda r: r["objective"], False),
            Column("direction", lambda r: r["direction"], False),
            Column("trial", lambda r: "" if r["trial"] is None else str(r["trial"])),
            Column("value", lambda r: metric_text(r["objective"], r["value"])),
            Column("knobs", lambda r: r["knobs"], False),
            Column("vs other configs", lambda r: r["noise"], False),
        ],
        rows,
        intro=intro,
    )


@dataclass
class Report:
    """Every table of a sweep report, keyed by name, plus the sweep it came from."""

    sweep: SweepData
    tables: dict[str, Table]
    notes: list[str] = field(default_factory=list)
    importances: Any = None  # vramsweep.report.importance.Importances when computed

    @property
    def main(self) -> Table:
        """The table printed to the terminal: ablation, else stacking, else trials."""
        for name in ("ablation", "stacking", "trials"):
            if name in self.tables:
                return self.tables[name]
        raise KeyError("no tables")


def confirm_table(sweep: SweepData) -> Table | None:
    """Shared vs alone: the throughput of each config the confirm stage re-ran alone on a GPU (``None`` when
    none was)."""
    rows = []
    for t in sweep.trials:
        if t.alone is None:
            continue
        shared, alone = t.tokens_per_s, t.alone.tokens_per_s
        rows.append(
            {
                "trial": t.number,
                "confirm_trial": t.alone.number,
                "tokens_per_s_shared": shared,
                "tokens_per_s_alone": alone,
                "shared_over_alone_pct": (shared / alone - 1.0) * 100.0 if shared and alone else None,
                "shared_with": t.gpu_shared,
                "overrides": list(t.overrides),
            }
        )
    if not rows:
        return None
    cols = [
        Column("trial", lambda r: str(r["trial"])),
        Column("tok/s shared", lambda r: fmt(r["tokens_per_s_shared"], ",.0f")),
        Column("tok/s alone", lambda r: fmt(r["tokens_per_s_alone"], ",.0f")),
        Column("shared vs alone %", lambda r: fmt(r["shared_over_alone_pct"], "+.1f")),
        Column("confirm trial", lambda r: str(r["confirm_trial"])),
    ]
    intro = (
        "sweep.confirm: the configs pick chooses between, re-run each alone on a GPU after measuring their "
        "throughput beside other trials; pick ranks on the alone figure."
    )
    return Table("confirm", "Throughput: shared GPU vs alone", cols, rows, intro=intro)


def build_tables(sweep: SweepData) -> Report:
    """All tables for ``sweep`` (which must have at least one trial)."""
    tables: dict[str, Table] = {}
    tables["best"] = best_table(sweep)
    ab = ablation_table(sweep)
    if ab is not None:
        tables["ablation"] = ab
    st = stacking_table(sweep)
    if st is not None:
        tables["stacking"] = st
    tables["trials"] = trials_table(sweep)
    if (confirm := confirm_table(sweep)) is not None:
        tables["confirm"] = confirm
    tables["failures"] = failures_table(sweep)
    est = estimate_tables(sweep)
    notes = list(sweep.notes)
    if est is not None:
        tables["estimate_error"], tables["estimate_error_by_knob"] = est
    else:
        notes.append("No trial recorded a memory estimate beside a measured peak: no estimate-error table.")
    return Report(sweep=sweep, tables=tables, notes=notes)
