"""Report plots (PNG + SVG, matplotlib Agg, no pyplot global state).

* ``pareto``: peak memory (GiB) vs tokens/s for every ok trial, coloured by eval loss; the budget as a
  vertical line; the feasible non-dominated front (min memory, max tokens/s) joined and ringed;
  over-budget trials drawn as crosses (they can never be on the front).
* ``memory_breakdown``: stacked bar per trial of ``metrics.memory_breakdown_bytes`` with its measured peak.
* ``importances``: Optuna parameter importances, one panel per objective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramsweep.record.metrics import MetricName, direction, display_unit, label, scaled, title
from vramsweep.report.importance import Importances
from vramsweep.report.load import SweepData, TrialRecord
from vramsweep.report.tables import pareto_front

BREAKDOWN_ORDER = ("params", "grads", "optimizer", "activations", "other")
MAX_BARS = 60
_PEAK, _TPS, _LOSS = MetricName.PEAK_MEMORY_BYTES, MetricName.TOKENS_PER_S, MetricName.EVAL_LOSS


def _axis(name: str) -> str:
    """Axis label of metric ``name``: its words and display unit (``peak memory (GiB)``)."""
    unit = display_unit(name)
    return f"{title(name)} ({unit})" if unit else label(name)


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out_dir: Path, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.savefig(paths[0])
    fig.savefig(paths[1], metadata={"Date": None})
    return paths


def _short(text: str, n: int = 38) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def pareto_figure(sweep: SweepData) -> Any:
    """The memory vs throughput figure, or None when no ok trial measured both."""
    pts = [t for t in sweep.trials if t.ok and t.peak_gib is not None and t.tokens_per_s is not None]
    if not pts:
        return None
    import matplotlib as mpl

    fig = _figure(7.5, 5.0)
    ax = fig.add_subplot()
    losses = [t.eval_loss for t in pts if t.eval_loss is not None]
    norm = (
        mpl.colors.Normalize(
            vmin=min(losses), vmax=max(losses) if max(losses) > min(losses) else min(losses) + 1e-9
        )
        if losses
        else None
    )
    cmap = mpl.colormaps["viridis"]

    def color(t: TrialRecord) -> Any:
        return cmap(norm(t.eval_loss)) if norm is not None and t.eval_loss is not None else "0.6"

    feasible = [t for t in pts if sweep.feasible(t)]
    _scatter_trials(ax, feasible, [t for t in pts if not sweep.feasible(t)], color)
    _draw_front(ax, feasible)
    budget = sweep.budget_gib
    if budget is not None:
        ax.axvline(budget, color="tab:orange", ls="--", lw=1.3, label=f"budget {budget:g} GiB")
    if norm is not None:
        sm = mpl.cm.ScalarMappable(norm=norm, cmap=cmap)
        fig.colorbar(sm, ax=ax, label=label(_LOSS))
    ax.set_xlabel(_axis(_PEAK))
    ax.set_ylabel(_axis(_TPS))
    ax.set_title(f"{sweep.name}: memory vs throughput ({len(pts)} ok trials)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def _scatter_trials(
    ax: Any, feasible: list[TrialRecord], infeasible: list[TrialRecord], color: Callable[[TrialRecord], Any]
) -> None:
    """The trials at (peak, tokens/s), coloured by ``color``: dots within the budget, crosses over it."""
    if feasible:
        ax.scatter(
            [t.peak_gib for t in feasible],
            [t.tokens_per_s for t in feasible],
            c=[color(t) for t in feasible],
            s=46,
            edgecolors="k",
            linewidths=0.4,
            label="feasible",
            zorder=3,
        )
    if infeasible:
        ax.scatter(
            [t.peak_gib for t in infeasible],
            [t.tokens_per_s for t in infeasible],
            c=[color(t) for t in infeasible],
            marker="X",
            s=60,
            alpha=0.8,
            label="over budget",
            zorder=3,
        )


def _draw_front(ax: Any, feasible: list[TrialRecord]) -> None:
    """The feasible trials' memory/throughput Pareto front: a red step line, ringed and numbered points."""
    front = sorted(
        pareto_front(feasible, [(m, direction(m)) for m in (_PEAK, _TPS)]),
        key=lambda t: (t.peak_gib, -(t.tokens_per_s or 0.0)),
    )
    if front:
        ax.plot(
            [t.peak_gib for t in front],
            [t.tokens_per_s for t in front],
            "-",
            color="tab:red",
            lw=1.2,
            drawstyle="steps-post",
            zorder=2,
        )
        ax.scatter(
            [t.peak_gib for t in front],
            [t.tokens_per_s for t in front],
            s=140,
            facecolors="none",
            edgecolors="tab:red",
            linewidths=1.4,
            label="Pareto front (feasible)",
            zorder=4,
        )
        for t in front:
            ax.annotate(
                f"#{t.number}",
                (t.peak_gib, t.tokens_per_s),
                textcoords="offset points",
                xytext=(6, 5),
                fontsize=8,
            )


def pareto_plot(sweep: SweepData, out_dir: Path) -> tuple[list[Path], str | None]:
    """Memory vs throughput scatter; returns (paths, note when skipped)."""
    fig = pareto_figure(sweep)
    if fig is None:
        return [], "Pareto plot skipped: no ok trial measured both peak memory and tokens/s."
    return _save(fig, out_dir, "pareto"), None


def breakdown_plot(sweep: SweepData, out_dir: Path) -> tuple[list[Path], str | None]:
    """Stacked memory breakdown per trial; returns (paths, note when skipped or truncated)."""
    trials = [t for t in sweep.trials if t.breakdown]
    if not trials:
        return [], "Memory breakdown plot skipped: no trial recorded metrics.memory_breakdown_bytes."
    note = None
    if len(trials) > MAX_BARS:
        note = f"Memory breakdown plot shows the first {MAX_BARS} of {len(trials)} trials with a breakdown."
        trials = trials[:MAX_BARS]
    cats = list(BREAKDOWN_ORDER)
    for t in trials:
        for k in t.breakdown:
            if k not in cats:
                cats.append(k)
    knobs = sweep.varying_knobs()
    fig = _figure(max(6.0, 0.45 * len(trials) + 3.0), 5.5)
    ax = fig.add_subplot()
    xs = list(range(len(trials)))
    bottom = [0.0] * len(trials)
    for cat in cats:
        vals = [scaled(MetricName.MEMORY_BREAKDOWN_BYTES, t.breakdown.get(cat, 0.0)) for t in trials]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottom, label=cat, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    peaks = [(x, t.peak_gib) for x, t in zip(xs, trials) if t.peak_gib is not None]
    if peaks:
        ax.scatter(
            [p[0] for p in peaks],
            [p[1] for p in peaks],
            marker="_",
            s=400,
            color="k",
            label="measured peak",
            zorder=3,
        )
    budget = sweep.budget_gib
    if budget is not None:
        ax.axhline(budget, color="tab:orange", ls="--", lw=1.3, label=f"budget {budget:g} GiB")
    ax.set_xticks(
        xs,
        [_short(f"#{t.number} {sweep.knob_label(t, knobs, values_only=True)}") for t in trials],
        rotation=45,
        ha="right",
        fontsize=7,
    )
    ax.set_ylabel(f"memory at peak ({display_unit(MetricName.MEMORY_BREAKDOWN_BYTES)})")
    ax.set_title(f"{sweep.name}: memory breakdown per config")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out_dir, "memory_breakdown"), note


def importance_plot(sweep: SweepData, imps: Importances, out_dir: Path) -> tuple[list[Path], str | None]:
    """One horizontal bar panel per objective with importances."""
    if not imps.values:
        return [], "Importance plot skipped: no objective had importances."
    metrics = list(imps.values)
    fig = _figure(4.2 * len(metrics), 0.4 * max(len(v) for v in imps.values.values()) + 1.8)
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        items = list(imps.values[metric].items())[::-1]
        ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
        ax.set_xlim(0, 1)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("importance")
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"{sweep.name}: parameter importances (Optuna)", fontsize=10)
    return _save(fig, out_dir, "importances"), None


def make_plots(sweep: SweepData, imps: Importances, out_dir: Path) -> tuple[list[Path], list[str]]:
    """Every plot; a plot that fails becomes a note, never an exception."""
    paths: list[Path] = []
    notes: list[str] = []
    for name, fn in (
        ("pareto", lambda: pareto_plot(sweep, out_dir)),
        ("memory breakdown", lambda: breakdown_plot(sweep, out_dir)),
        ("importances", lambda: importance_plot(sweep, imps, out_dir)),
    ):
        try:
            written, note = fn()
        except Exception as exc:  # plotting must never hide the tables
            notes.append(f"{name} plot failed: {exc.__class__.__name__}: {exc}")
            continue
        paths += written
        if note:
            notes.append(note)
    return paths, notes
