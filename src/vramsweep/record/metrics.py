"""The metric registry: every field of a result's ``metrics`` object, defined once.

A metric is one :class:`Metric` entry in :data:`METRICS`; adding a metric is one line here (plus the code
that measures it). Everything else derives from the registry: the keys every result carries
(:data:`METRIC_KEYS`, null until measured), the metrics a sweep may optimise (:data:`OBJECTIVE_METRICS`) or
prune on (:data:`PRUNABLE_METRICS`), the losses whose non-finite value means ``diverged``
(:data:`LOSS_METRICS`), each metric's better direction (:func:`direction`), and how it is shown: its column
header (:func:`label`), its words in a sentence (:func:`title`), the stem of its Δ headers
(:func:`short_label`), its number format and display unit (:func:`value_format`, :func:`format_value`; bytes
are shown in GiB), its raw-row key in tables and CSV (:func:`column`) and its W&B summary alias
(:func:`wandb_key`), and which default views show it (:func:`view_metrics`: the ``headline`` metrics in
every view, ``views`` in the named ones). Every table, progress line, CLI line, plot and W&B key takes
these from here. The schema prose is in docs/CONTRACTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from vramsweep.record.units import GIB

Direction = Literal["minimize", "maximize"]
#: What a metric's value is: a number, a text label, a ``{part: number}`` map (dotted names reach in), or a
#: list of records (``intermediate_eval``).
Kind = Literal["number", "text", "map", "list"]
#: Which Δ columns an ablation/stacking table shows for a metric: absolute, relative (%), or both.
Delta = Literal["abs", "pct", "both"]
#: Number format of a metric without one (and of a metric outside the registry).
DEFAULT_FMT = ".4f"


@dataclass(frozen=True)
class Metric:
    """One field of ``result.metrics``."""

    name: str
    unit: str  # "bytes", "tokens/s", "s", "nats", "fraction", "" (dimensionless / label)
    direction: Direction | None  # which way is better; None for labels
    objective: bool = False  # may be a sweep objective (``sweep.objectives``)
    prunable: bool = False  # reported at intermediate evals: a single objective that the pruner can use
    loss: bool = False  # a non-finite value means the trial diverged
    kind: Kind = "number"
    core: bool = True  # in every result (null until measured); else written only when measured
    doc: str = ""
    quality: bool = False  # measures the model, not the machine: seed repeats separate effects from noise
    timing: bool = False  # timed on the machine (disturbed by load: ``meta.timing_conditions``)
    held_out: bool = False  # measured on the held-out set: compares only within one ``meta.eval_set``
    # How it is shown (every table, progress/CLI line, plot and W&B key takes these from here):
    label: str = ""  # short column header ("tokens/s", "peak GiB"); "" = the name
    title: str = ""  # its words in a sentence or CLI line ("peak memory"); "" = the label
    short: str = ""  # stem of its Δ headers ("mem" -> "Δ mem GiB", "Δ mem %"); "" = the label
    fmt: str = DEFAULT_FMT  # format spec of the shown value (after scaling bytes to GiB)
    column: str = ""  # raw-row key of the shown value in tables, CSV and W&B tables; "" = the name
    delta: Delta = "abs"  # which Δ columns a comparison table shows
    wandb: str = ""  # W&B summary alias beside the name itself ("eval/loss"); "" = none
    # Which default views show it (:func:`view_metrics`): a headline metric is a default column of every
    # table, the terminal summary, the W&B trials table and pick's candidates; ``views`` names the views
    # (:data:`VIEWS`) that show it beside the headline; ``detail`` columns go first on a narrow terminal.
    headline: bool = False
    views: tuple[str, ...] = ()
    detail: bool = False

    @property
    def scale(self) -> int:
        """Divisor from the stored value to the shown one (bytes are shown in GiB)."""
        return GIB if self.unit == "bytes" else 1

    @property
    def display_unit(self) -> str:
        """Unit of the shown value: ``GiB`` for bytes, else the stored unit (``""`` when it is a plain
        number: nats, fractions, tokens/s say so in the label)."""
        return "GiB" if self.unit == "bytes" else ""


#: The registry, in the order metrics appear in a result file.
METRICS: tuple[Metric, ...] = (
    Metric(
        "peak_memory_bytes",
        "bytes",
        "minimize",
        objective=True,
        doc="peak device memory of the run",
        label="peak GiB",
        title="peak memory",
        short="mem",
        column="peak_gib",
        delta="both",
        headline=True,
    ),
    Metric("memory_kind", "", None, kind="text", doc="what the peak counts: reserved | allocated | tracked"),
    Metric("memory_breakdown_bytes", "bytes", "minimize", kind="map", doc="peak by category (params, ...)"),
    Metric(
        "tokens_per_s",
        "tokens/s",
        "maximize",
        objective=True,
        doc="training throughput, timed steps",
        timing=True,
        label="tokens/s",
        short="tok/s",
        fmt=".1f",
        delta="pct",
        wandb="train/tokens_per_s",
        headline=True,
    ),
    Metric(
        "step_time_s",
        "s",
        "minimize",
        objective=True,
        doc="mean wall time of a timed step",
        timing=True,
        label="s/step",
        title="step time",
        fmt=".3f",
        views=("wandb",),
    ),
    Metric(
        "mfu",
        "fraction",
        "maximize",
        objective=True,
        doc="model FLOPs utilisation",
        timing=True,
        views=("wandb",),
    ),
    Metric(
        "train_loss",
        "nats",
        "minimize",
        objective=True,
        loss=True,
        doc="mean loss of the last steps",
        quality=True,
        label="train loss",
    ),
    Metric(
        "initial_eval_loss",
        "nats",
        "minimize",
        objective=True,
        loss=True,
        doc="eval loss before training",
        quality=True,
        held_out=True,
        label="initial eval loss",
    ),
    Metric(
        "eval_loss",
        "nats",
        "minimize",
        objective=True,
        prunable=True,
        loss=True,
        doc="final eval loss",
        quality=True,
        held_out=True,
        label="eval loss",
        wandb="eval/loss",
        headline=True,
    ),
    Metric(
        "eval_ppl",
        "",
        "minimize",
        objective=True,
        prunable=True,
        loss=True,
        doc="exp(eval_loss)",
        quality=True,
        held_out=True,
        label="ppl",
        title="eval ppl",
        fmt=".2f",
        wandb="eval/ppl",
        views=("trials", "stats", "wandb", "pick"),
        detail=True,
    ),
    Metric(
        "task_score",
        "",
        "maximize",
        objective=True,
        doc="task metric (higher is better)",
        quality=True,
        held_out=True,
        label="task score",
        fmt=".3f",
        views=("trials", "wandb", "pick"),
    ),
    # Written only when measured (not in every result):
    Metric(
        "initial_task_score",
        "",
        "maximize",
        core=False,
        doc="task_score before training",
        quality=True,
        held_out=True,
        label="initial task score",
        fmt=".3f",
    ),
    Metric("intermediate_eval", "", None, kind="list", core=False, doc="[{step, eval_loss, ...}] per eval"),
    Metric("measured_steps", "steps", None, core=False, doc="timed steps behind tokens_per_s"),
    Metric("tokens_trained", "tokens", None, core=False, doc="tokens in the timed steps"),
    Metric("padding_tokens", "tokens", None, core=False, doc="padding tokens in the timed steps"),
    Metric("target_tokens", "tokens", None, core=False, doc="loss-bearing tokens in the timed steps"),
    Metric("state_bytes", "bytes", None, kind="map", core=False, doc="params, grads, optimizer state"),
    Metric("task_spans", "spans", None, core=False, doc="answer spans behind task_score"),
    Metric("memory_phase", "", None, kind="text", core=False, doc="CUDA: the phase peak_memory_bytes covers"),
    Metric(
        "cuda_max_allocated_bytes", "bytes", "minimize", core=False, doc="torch.cuda.max_memory_allocated"
    ),
    Metric("cuda_max_reserved_bytes", "bytes", "minimize", core=False, doc="torch.cuda.max_memory_reserved"),
    Metric("cuda_fragmentation_bytes", "bytes", "minimize", core=False, doc="reserved - allocated at peak"),
    Metric(
        "cuda_trial_peak_reserved_bytes", "bytes", "minimize", core=False, doc="reserved peak, whole trial"
    ),
    Metric("nvml_process_peak_bytes", "bytes", "minimize", core=False, doc="NVML per-process peak"),
    Metric("nvml_device_used_peak_bytes", "bytes", "minimize", core=False, doc="NVML device-used peak"),
    # Answer quality on held-out facts vs. control text (the `quality` work): accuracy up, NLL down.
    Metric(
        "fact_token_acc",
        "fraction",
        "maximize",
        objective=True,
        core=False,
        doc="fact-token accuracy",
        quality=True,
        held_out=True,
        views=("terminal",),
    ),
    Metric(
        "fact_nll",
        "nats",
        "minimize",
        objective=True,
        core=False,
        doc="mean NLL of fact tokens",
        quality=True,
        held_out=True,
    ),
    Metric(
        "control_token_acc",
        "fraction",
        "maximize",
        objective=True,
        core=False,
        doc="control accuracy",
        quality=True,
        held_out=True,
    ),
    Metric(
        "control_nll",
        "nats",
        "minimize",
        objective=True,
        core=False,
        doc="mean NLL of control tokens",
        quality=True,
        held_out=True,
    ),
    Metric("fact_tokens", "tokens", None, core=False, doc="fact-value tokens behind the fact metrics"),
    Metric(
        "control_tokens", "tokens", None, core=False, doc="other target tokens behind the control metrics"
    ),
)

#: Every metric's name as a constant (``MetricName.TOKENS_PER_S == "tokens_per_s"``), derived from the
#: registry: code outside ``record/`` names a metric through this, never by a string literal. A ``str`` enum,
#: so a member is the plain string as a dict key, in JSON and in f-strings.
MetricName = StrEnum("MetricName", {m.name.upper(): m.name for m in METRICS})

#: Name -> :class:`Metric`.
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
#: The metric keys every result carries (null until measured), in file order.
METRIC_KEYS: tuple[str, ...] = tuple(m.name for m in METRICS if m.core)
#: Metrics that can be sweep objectives (map metrics are objectives through dotted names only).
OBJECTIVE_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.objective)
#: Loss-like metrics the trial reports at intermediate evals (pruning works on these only).
PRUNABLE_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.prunable)
#: Losses: a non-finite value turns an ``ok`` trial into ``diverged``.
LOSS_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.loss)
#: Metrics of the model's quality (seed repeats by default in ablations; significance marks in reports).
QUALITY_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.quality)
#: Metrics measured on the held-out set (they compare only between trials of one eval-set fingerprint).
HELD_OUT_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.held_out)
#: Metrics timed on the machine (a report flags them when measured under load).
TIMING_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.timing)
#: Metrics where larger is better.
MAXIMIZE_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.direction == "maximize")
#: Metric names outside the registry (a user's trial function) are judged by their suffix.
_MAXIMIZE_SUFFIXES = ("_acc", "_accuracy", "_score")
_QUALITY_SUFFIXES = ("_acc", "_accuracy", "_score", "_nll", "_loss", "_ppl")
#: The core scalar metrics (numbers and labels): what goes into one Optuna user attr each.
SCALAR_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.core and m.kind in ("number", "text"))


#: The default views beside the headline (a metric's ``views``): ``trials`` (the trials table), ``stats``
#: (mean and std of every design point row), ``terminal`` (the terminal summary), ``wandb`` (the W&B
#: summary run's trials table), ``pick`` (pick's candidates table).
VIEWS = ("trials", "stats", "terminal", "wandb", "pick")


def view_metrics(view: str | None = None) -> tuple[str, ...]:
    """The metrics a default view shows, in registry order: the headline metrics, and those tagged with
    ``view`` (:data:`VIEWS`; None: the headline alone, the ablation and stacking tables' base columns).
    Read at call time, so a new metric flagged ``headline=True`` shows in every view."""
    if view is not None and view not in VIEWS:
        raise KeyError(f"unknown view {view!r} (known: {', '.join(VIEWS)})")
    return tuple(m.name for m in METRICS if m.headline or (view is not None and view in m.views))


def metric(name: str) -> Metric:
    """The registry entry for ``name``; a dotted name (``memory_breakdown_bytes.activations``) gives its
    map metric. Raises ``KeyError`` naming the known metrics."""
    root = name.split(".", 1)[0]
    m = BY_NAME.get(root)
    if m is None or ("." in name and m.kind != "map"):
        raise KeyError(f"unknown metric {name!r} (known: {', '.join(BY_NAME)})")
    return m


def is_objective(name: str) -> bool:
    """Whether ``name`` may be a sweep objective: an objective metric, or a dotted part of a map metric."""
    try:
        m = metric(name)
    except KeyError:
        return False
    return m.objective or (m.kind == "map" and m.direction is not None)


def direction(name: str) -> Direction:
    """Which way ``name`` is better: ``"minimize"`` or ``"maximize"`` (dotted map parts: the map's).

    Raises ``KeyError`` for an unknown metric or a label without a direction.
    """
    d = metric(name).direction
    if d is None:
        raise KeyError(f"metric {name!r} has no better direction (a label or a count)")
    return d


def higher_is_better(name: str) -> bool:
    """``direction(name) == "maximize"``."""
    return direction(name) == "maximize"


def metric_direction(name: str) -> Direction:
    """Like :func:`direction`, for any metric a result may hold: a registered one's direction, else by
    name (``*_acc``, ``*_accuracy``, ``*_score``: maximize; anything else: minimize)."""
    try:
        return direction(name)
    except KeyError:
        root = str(name).split(".", 1)[0]
        return "maximize" if root.endswith(_MAXIMIZE_SUFFIXES) else "minimize"


def is_quality_metric(name: str) -> bool:
    """A model-quality metric: registered with ``quality=True``, or unregistered and named like one
    (``*_acc``, ``*_accuracy``, ``*_score``, ``*_nll``, ``*_loss``, ``*_ppl``)."""
    root = str(name).split(".", 1)[0]
    m = BY_NAME.get(root)
    return m.quality if m is not None else root.endswith(_QUALITY_SUFFIXES)


def _entry(name: str) -> Metric | None:
    """The registry entry of ``name`` (a dotted name: its map metric), None outside the registry."""
    try:
        return metric(str(name))
    except KeyError:
        return None


def label(name: str) -> str:
    """Short column header of ``name`` (``"tokens/s"``, ``"peak GiB"``); the name itself when the registry
    gives none or does not know it (a user's metric shows under its own name)."""
    m = _entry(name)
    return (m.label or m.name) if m is not None and "." not in str(name) else str(name)


def title(name: str) -> str:
    """``name`` in words, for a sentence or a CLI line (``"peak memory"``); else its :func:`label`."""
    m = _entry(name)
    return m.title if m is not None and m.title and "." not in str(name) else label(name)


def short_label(name: str) -> str:
    """Stem of the Δ headers of ``name`` (``"mem"``: ``Δ mem GiB``, ``Δ mem %``); else its :func:`label`."""
    m = _entry(name)
    return m.short if m is not None and m.short and "." not in str(name) else label(name)


def delta_labels(name: str) -> tuple[str | None, str | None]:
    """Headers of the absolute and the relative Δ column of ``name`` (None where the table has none):
    ``("Δ mem GiB", "Δ mem %")``, ``(None, "Δ tok/s %")``, ``("Δ eval loss", None)``."""
    m = _entry(name)
    kind = m.delta if m is not None else "abs"
    stem = short_label(name)
    unit = display_unit(name)
    absolute = f"Δ {stem} {unit}" if unit else f"Δ {stem}"
    return (absolute if kind != "pct" else None), (f"Δ {stem} %" if kind != "abs" else None)


def value_format(name: str) -> str:
    """Format spec of the shown value of ``name`` (``".1f"``; :data:`DEFAULT_FMT` outside the registry)."""
    m = _entry(name)
    return m.fmt if m is not None else DEFAULT_FMT


def display_unit(name: str) -> str:
    """Unit of the shown value of ``name`` (``"GiB"`` for bytes; ``""`` for a plain number)."""
    m = _entry(name)
    return m.display_unit if m is not None else ""


def column(name: str) -> str:
    """Raw-row key of the shown value of ``name`` in tables, CSV and W&B tables (``peak_gib``)."""
    m = _entry(name)
    return m.column if m is not None and m.column and "." not in str(name) else str(name)


def wandb_key(name: str) -> str | None:
    """The W&B summary alias of ``name`` beside its own key (``"eval/loss"``), None when it has none."""
    m = _entry(name)
    return m.wandb if m is not None and m.wandb and "." not in str(name) else None


def scaled(name: str, value: float | None) -> float | None:
    """The stored value of ``name`` in its display unit (bytes -> GiB); None stays None."""
    m = _entry(name)
    return None if value is None else (value / m.scale if m is not None and m.scale != 1 else value)


def format_value(name: str, value: float | None, *, unit: bool = False, sign: bool = False) -> str:
    """The stored value of ``name`` as shown: scaled (bytes -> GiB) and formatted (``".1f"``); with
    ``unit`` the display unit appended (``"12.3456 GiB"``), with ``sign`` a leading ``+``/``-``; ``""``
    for None."""
    v = scaled(name, value)
    if v is None:
        return ""
    text = f"{v:{'+' if sign else ''}{value_format(name)}}"
    u = display_unit(name)
    return f"{text} {u}" if unit and u else text


def empty_metrics() -> dict[str, None]:
    """Every metric key present, all null (never write a figure that was not measured)."""
    return {k: None for k in METRIC_KEYS}


__all__ = [
    "BY_NAME",
    "VIEWS",
    "view_metrics",
    "DEFAULT_FMT",
    "column",
    "delta_labels",
    "display_unit",
    "format_value",
    "label",
    "scaled",
    "short_label",
    "title",
    "value_format",
    "wandb_key",
    "MAXIMIZE_METRICS",
    "QUALITY_METRICS",
    "HELD_OUT_METRICS",
    "TIMING_METRICS",
    "is_quality_metric",
    "metric_direction",
    "LOSS_METRICS",
    "METRICS",
    "METRIC_KEYS",
    "OBJECTIVE_METRICS",
    "PRUNABLE_METRICS",
    "SCALAR_METRICS",
    "Direction",
    "Metric",
    "MetricName",
    "direction",
    "empty_metrics",
    "higher_is_better",
    "is_objective",
    "metric",
]
