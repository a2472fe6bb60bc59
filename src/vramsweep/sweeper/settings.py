"""Sweeper settings: the declarations of the ``hydra.sweeper.*`` keys and of a sweep file's ``sweep:`` node,
and their checker.

:class:`SweeperConf` is the structured config users override on the command line the way
hydra-optuna-sweeper users already do (``hydra.sweeper.n_trials=40 hydra.sweeper.sampler=random``).
The Hydra plugin registers it (plus ``_target_``) as ``hydra/sweeper=vramsweep``. :func:`sweeper_conf` is
the one reader of a ``hydra.sweeper`` node, for every driver (the main one, function mode, max-context):
unknown keys, types and ranges checked (each field's :class:`Rule`), values typed, raising
:class:`~vramsweep.config.ConfigError` (exit 2) for anything malformed. :class:`SweepConfig` is the
``sweep:`` node, typed. Resolving them into what a sweep runs (design, objectives, storage URL, folder)
is :func:`vramsweep.sweeper.plan.resolve_settings`'s.

This module is imported by Hydra's plugin scan, so it must stay light: dataclasses only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.config.urls import mask_secret, mask_url, normalise_storage_url  # noqa: F401 - re-exported
from vramsweep.record.metrics import OBJECTIVE_METRICS, is_objective
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import metric_direction
from vramsweep.sweeper.samplers import PRUNERS, SAMPLERS  # noqa: F401 - re-exported (one table: samplers.py)

#: Sweep designs (``sweep.design``).
DESIGNS = ("search", "grid", "ablation", "stacking")  # + "max_context" (sweeper/maxctx.py, its own driver)
#: Trial isolation modes (``hydra.sweeper.isolation``).
ISOLATIONS = ("fork", "spawn", "inprocess", "launcher")
# Metrics that can be objectives or pruned on: the registry (record/metrics.py) says. Dotted paths reach
# into map metrics, e.g. ``memory_breakdown_bytes.activations``.
#: Seed repeats per design point by default for ablation/stacking designs with a quality objective
#: (``sweep.repeats`` overrides; see :func:`vramsweep.sweeper.plan.default_repeats`).
QUALITY_REPEATS = 3
#: Modules the fork server imports once, so each trial starts warm (missing ones are skipped).
DEFAULT_PRELOAD = (
    "vramsweep.trial",
    "vramsweep.config",
    "torch",
    "transformers",
    "peft",
    "optuna",
)
DEFAULT_TRIAL_FN = "vramsweep.trial:run_trial_overrides"


#: Most worker slots of one sweep process (``hydra.sweeper.n_jobs``): each is a thread here plus a trial
#: process (or a launcher job in flight); more than this fails on thread or process limits mid-sweep.
MAX_N_JOBS = 256
#: Most trials one study may hold (``hydra.sweeper.n_trials``): every slot is enqueued in the study before
#: the first trial starts, so a mistyped count would spend minutes writing slots.
MAX_N_TRIALS = 10_000
#: Shortest ``hydra.sweeper.timeout_s``: starting a trial process alone takes about a second, so a shorter
#: limit kills every trial.
MIN_TIMEOUT_S = 1.0
#: Most trials one GPU may hold at once (``hydra.sweeper.trials_per_gpu``).
MAX_PER_GPU = 64


@dataclass(frozen=True)
class Rule:
    """Type and range of one ``hydra.sweeper.*`` setting (carried by its :class:`SweeperConf` field;
    :data:`SETTING_RULES`).

    ``kind``: ``int``, ``float``, ``bool``, ``str``, ``choice`` (one of ``choices``), ``spec`` (a name in
    ``choices`` or a dict, checked by :func:`_check_spec`), ``direction`` (``minimize``/``maximize`` or a list
    of them), ``strs`` (a list of names), ``map`` (a dict) or ``any`` (checked where it is parsed).
    ``lo``/``hi`` bound numbers (inclusive unless ``lo_open``); ``nullable`` allows ``null`` (``hint`` says
    what it means); ``check`` is a further check of a given, non-null value (a format, a module that must
    exist) that raises :class:`ConfigError`.
    """

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    nullable: bool = False
    choices: tuple[str, ...] = ()
    hint: str = ""
    check: Callable[[Any], None] | None = None
    auto: str = ""  # ``auto`` is allowed too; what it means


def setting(rule: Rule, default: Any = None, *, factory: Callable[[], Any] | None = None) -> Any:
    """A :class:`SweeperConf` field with its :class:`Rule` beside it (read by :func:`check_conf`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


@dataclass
class SweeperConf:
    """``hydra.sweeper.*`` settings (see docs/SWEEPS.md for the full story).

    Each field carries its :class:`Rule` (type, range, allowed values) beside its type: :func:`check_conf`
    reads them. Adding a setting = one field here and one line below (docs/SWEEPS.md).

    Attributes:
        n_trials: study total; a re-run continues and runs exactly the remainder. ``null`` = every
            point of a grid/ablation/stacking design, 20 for a search.
        n_jobs: local worker slots on this machine (each trial still runs in its own process); ``auto``:
            one per visible GPU seat (``trials_per_gpu`` each), 1 on CPU (:mod:`.gpus`).
        storage: Optuna storage URL; ``null`` = ``sqlite:///<sweep dir>/study.db``. Use
            ``postgresql://user@host/db`` for many workers or machines.
        study_name: ``null`` = the sweep's name (a sweep file's ``sweep.name``, ``sweep.name=<x>``, or for an
            ad-hoc sweep ``<swept keys>-<hash of what it runs>``).
        sampler: ``tpe | random | grid | nsga2 | gp``, or a dict: ``{name: tpe, n_startup_trials: 5}`` or
            hydra-optuna-sweeper style ``{_target_: optuna.samplers.TPESampler, seed: 1}``. ``null`` (the
            default): command-line comma lists / ``range`` / ``choice`` are a grid (Hydra's basic-sweeper
            semantics); a sweep file's ``params``, ``sweep.design: search`` or an ``interval`` is a TPE
            search.
        pruner: ``median | sha | hyperband | none`` or a dict like ``sampler``. Active only for a search
            with a single objective ``eval_loss``/``eval_ppl`` (Optuna cannot report intermediate values
            in multi-objective studies; fixed designs run every point to the end).
        direction: hydra-optuna-sweeper compatibility: ``minimize`` or a list, applied to the objectives
            in order.
        objectives: overrides ``sweep.objectives``: a list of metric names or ``{metric, direction}``.
        params: search space, ``{key: "choice(a,b)" | "range(8,33,8)" | "interval(1e-4,1e-2)" |
            "tag(log, interval(...))" | fixed value}``.
        seed: sampler seed (``null`` = random).
        isolation: ``fork`` (warm fork server, default), ``spawn`` (cold process), ``inprocess`` (debug),
            ``launcher`` (each trial a job of the Hydra launcher, ``n_jobs`` in flight; implied by
            ``hydra/launcher=submitit_slurm`` or any launcher but Hydra's basic one).
        trial_fn: ``module:function`` that runs one trial from overrides (tests inject fakes here).
        preload: modules the fork server imports once.
        max_failure_rate: abort (exit 1) when more than this fraction of finished trials are ``error``
            (crashes, kills, timeouts, missing objectives), once ``min_trials_for_failure_rate`` have
            finished. oom/unsupported/diverged/pruned/infeasible are results, not failures.
        min_trials_for_failure_rate: how many finished trials before the cap is checked.
        timeout_s: wall-clock limit per trial (``null`` = none); a trial over it is killed (``error``).
        heartbeat_s: how often a worker stamps its running trials.
        grace_s: a RUNNING trial whose heartbeat is older than this is stale (its worker died): failed,
            its config retried (up to ``retry_stale`` times). Trials of dead processes on this host are
            detected at once.
        retry_stale: how many times a design point whose worker died (or that Ctrl-C stopped) is
            retried; after that it is recorded ``error`` for good (a re-run with a higher value retries it).
        dedup: search design only: a point the sampler proposes again is not re-run; the earlier
            trial's outcome is copied (``duplicate_of``) at zero cost.
        sweep_dir: ``null`` = ``<results_dir>/sweeps/<name>``.
        cuda_devices: the GPUs trials run on (``null``: every visible one); each trial gets
            ``CUDA_VISIBLE_DEVICES=<its GPU>``.
        trials_per_gpu: trials one GPU holds at once, each in its own process under its own cap; ``auto``:
            ``⌊(card − gpu_reserve_gib) ÷ (cap + CUDA context)⌋`` where the hardware profile caps below the
            card, else 1. Throughput measured beside another trial is marked shared.
        gpu_reserve_gib: memory of each card left out of the ``trials_per_gpu=auto`` arithmetic.
        share_below: a trial whose memory estimate reaches this fraction of its cap runs alone on its GPU.
        progress: print one line per finished trial plus a total progress bar (notes print either way).
        custom_search_space: function mode only (any Hydra app): ``module.function(cfg, trial)`` that
            suggests more params, as in hydra-optuna-sweeper.
    """

    n_trials: int | None = setting(
        Rule("int", 0, MAX_N_TRIALS, nullable=True, hint="every point of a design, 20 for a search"), None
    )
    n_jobs: Any = setting(Rule("int", 1, MAX_N_JOBS, auto="one per GPU seat, 1 on CPU"), "auto")
    storage: str | None = setting(Rule("str", nullable=True, hint="sqlite:///<sweep dir>/study.db"), None)
    study_name: str | None = setting(Rule("str", nullable=True, hint="the sweep's name"), None)
    sampler: Any = setting(Rule("spec", nullable=True, choices=SAMPLERS), None)
    pruner: Any = setting(Rule("spec", choices=PRUNERS), "median")
    direction: Any = setting(Rule("direction", nullable=True), None)
    objectives: Any = setting(Rule("any", nullable=True), None)
    params: dict[str, Any] = setting(Rule("map", nullable=True), factory=dict)
    seed: int | None = setting(Rule("int", 0, 2**32 - 1, nullable=True, hint="a random seed"), None)
    isolation: str = setting(Rule("choice", choices=ISOLATIONS), "fork")
    trial_fn: str = setting(Rule("str", check=lambda v: _check_trial_fn_setting(v)), DEFAULT_TRIAL_FN)
    preload: list[str] = setting(
        Rule("strs", nullable=True, check=lambda v: _check_preload(v)), factory=lambda: list(DEFAULT_PRELOAD)
    )
    max_failure_rate: float = setting(Rule("float", 0.0, 1.0), 0.5)
    min_trials_for_failure_rate: int = setting(Rule("int", 1, MAX_N_TRIALS), 4)
    timeout_s: float | None = setting(
        Rule("float", MIN_TIMEOUT_S, None, nullable=True, hint="no limit"), None
    )
    heartbeat_s: float = setting(Rule("float", 0.0, 3600.0, lo_open=True), 10.0)
    grace_s: float = setting(Rule("float", 0.0, None, lo_open=True), 120.0)
    retry_stale: int = setting(Rule("int", 0, 100), 3)
    dedup: bool = setting(Rule("bool"), True)
    sweep_dir: str | None = setting(Rule("str", nullable=True, hint="<results_dir>/sweeps/<name>"), None)
    cuda_devices: list[str] | None = setting(
        Rule("strs", nullable=True, hint="every visible device", check=lambda v: _check_cuda_devices(v)), None
    )
    trials_per_gpu: Any = setting(
        Rule("int", 1, MAX_PER_GPU, auto="as many capped trials as the card holds"), "auto"
    )
    gpu_reserve_gib: float = setting(Rule("float", 0.0, 1024.0), 1.0)
    share_below: float = setting(Rule("float", 0.0, 1.0, lo_open=True), 0.9)
    progress: bool = setting(Rule("bool"), True)
    custom_search_space: str | None = setting(Rule("str", nullable=True, check=lambda v: _check_css(v)), None)


#: Every ``hydra.sweeper.*`` key: its type and range (read from the :class:`SweeperConf` fields), checked
#: before anything is planned, written or run.
SETTING_RULES: dict[str, Rule] = {f.name: f.metadata["rule"] for f in fields(SweeperConf)}


def _fmt_num(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) and abs(v) >= 10_000 else f"{v:g}"


def _range_text(rule: Rule) -> str:
    """``an integer in 1..256``, ``a number > 0``, ``a number in [0, 1]`` (plus ``or null (...)``)."""
    what = "an integer" if rule.kind == "int" else "a number"
    lo, hi = rule.lo, rule.hi
    if rule.kind == "int":
        text = (
            f"{what} in {_fmt_num(int(lo))}..{_fmt_num(int(hi))}" if hi is not None else f"{what} >= {lo:g}"
        )
    elif lo is not None and hi is not None:
        text = f"{what} in {'(' if rule.lo_open else '['}{lo:g}, {hi:g}]"
    elif lo is not None:
        text = f"{what} {'>' if rule.lo_open else '>='} {lo:g}"
    else:
        text = what
    return text + (
        f", or null for {rule.hint}" if rule.nullable and rule.hint else ", or null" if rule.nullable else ""
    )


def _kind_text(rule: Rule) -> str:
    if rule.auto:
        return f"auto ({rule.auto}) or " + _kind_text(replace(rule, auto=""))
    if rule.kind in ("int", "float"):
        return _range_text(rule)
    base = {
        "bool": "true or false",
        "str": "a string",
        "choice": "one of " + ", ".join(rule.choices),
        "spec": "one of " + ", ".join(rule.choices) + " or a dict with 'name' or '_target_'",
        "direction": "minimize, maximize or a list of them",
        "strs": "a list of names, e.g. [a, b]",
        "map": "a mapping {key: value}",
    }.get(rule.kind, "a value")
    return base + (
        f", or null for {rule.hint}" if rule.nullable and rule.hint else ", or null" if rule.nullable else ""
    )


def check_setting(key: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``hydra.sweeper.<key>=value`` has the type and range of its rule
    (null only where the rule allows it; then the check of its kind, :data:`_KIND_CHECKS`)."""
    rule = SETTING_RULES.get(key)
    if rule is None:
        raise ConfigError(
            f"unknown setting hydra.sweeper.{key}", key=f"hydra.sweeper.{key}", allowed=sorted(SETTING_RULES)
        )
    full = f"hydra.sweeper.{key}"
    if value is None:
        if rule.nullable:
            return
        raise _bad_setting(full, value, rule, "cannot be null")
    if rule.auto and value == "auto":
        return
    check = _KIND_CHECKS.get(rule.kind)
    if check is not None:
        check(full, value, rule)


def _bad_setting(full: str, value: Any, rule: Rule, why: str = "") -> ConfigError:
    """The error for ``full=value``: ``why``, or by default that it is not what the rule's kind wants."""
    shown = "null" if value is None else repr(value) if isinstance(value, str) else value
    return ConfigError(
        f"{full}={shown} {why or 'is not ' + _kind_text(rule)}", key=full, allowed=[_kind_text(rule)]
    )


def _check_number_setting(full: str, value: Any, rule: Rule) -> None:
    """``int``/``float``: a number (not a bool; an ``int`` may be a whole float), finite, within the rule's
    bounds."""
    import math

    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad_setting(full, value, rule)
    if rule.kind == "int" and isinstance(value, float):
        if not value.is_integer():
            raise _bad_setting(full, value, rule)
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad_setting(full, value, rule, "is not finite")
    lo, hi = rule.lo, rule.hi
    if lo is not None and (value <= lo if rule.lo_open else value < lo) or hi is not None and value > hi:
        raise _bad_setting(full, value, rule, "is out of range")


def _check_bool_setting(full: str, value: Any, rule: Rule) -> None:
    """``bool``: true or false."""
    if not isinstance(value, bool):
        raise _bad_setting(full, value, rule)


def _check_text_setting(full: str, value: Any, rule: Rule) -> None:
    """``str``/``choice``: a non-blank string; for ``choice``, one of the rule's choices."""
    if not isinstance(value, str):
        raise _bad_setting(full, value, rule)
    if not value.strip():
        raise _bad_setting(full, value, rule, "is empty")
    if rule.kind == "choice" and value not in rule.choices:
        raise ConfigError(f"{full}={value!r} is not known", key=full, allowed=list(rule.choices))


def _check_spec_setting(full: str, value: Any, rule: Rule) -> None:
    """``spec``: a name among the rule's choices or a dict (:func:`_check_spec`)."""
    _check_spec(value, rule.choices, full)


def _check_direction_setting(full: str, value: Any, rule: Rule) -> None:
    """``direction``: ``minimize``/``maximize`` (any case) or a non-empty list of them."""
    items = value if isinstance(value, list | tuple) else [value]
    if not items or any(str(d).lower() not in ("minimize", "maximize") for d in items):
        raise ConfigError(f"{full}={value!r} is not known", key=full, allowed=["minimize", "maximize"])


def _check_strs_setting(full: str, value: Any, rule: Rule) -> None:
    """``strs``: a list of non-blank strings or integers (not bools)."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, str | int) and not isinstance(v, bool) and str(v).strip() for v in value
    ):
        raise _bad_setting(full, value, rule)


def _check_map_setting(full: str, value: Any, rule: Rule) -> None:
    """``map``: a dict."""
    if not isinstance(value, dict):
        raise _bad_setting(full, value, rule)


#: The type/range check of a given, non-null setting, by its rule's kind (``any``: none here; checked where
#: it is parsed).
_KIND_CHECKS: dict[str, Callable[[str, Any, Rule], None]] = {
    "int": _check_number_setting,
    "float": _check_number_setting,
    "bool": _check_bool_setting,
    "str": _check_text_setting,
    "choice": _check_text_setting,
    "spec": _check_spec_setting,
    "direction": _check_direction_setting,
    "strs": _check_strs_setting,
    "map": _check_map_setting,
}


#: keys of the ``hydra.sweeper`` node that are Hydra's, not settings
NOT_SETTINGS = ("_target_", "_recursive_", "_convert_", "_partial_", "defaults")


def check_conf(sweeper: dict[str, Any]) -> None:
    """Every ``hydra.sweeper.*`` key given, against the :class:`Rule` its :class:`SweeperConf` field carries
    (type and range first, then each rule's ``check``), plus the one rule that ties two keys: before the
    sweep is planned, any folder made or any trial run."""

    given = {k: v for k, v in sweeper.items() if k not in NOT_SETTINGS}
    for k, v in given.items():
        check_setting(k, v)
    for k, rule in SETTING_RULES.items():
        if rule.check is not None and given.get(k) is not None:
            rule.check(given[k])
    hb = sweeper.get("heartbeat_s", SweeperConf.heartbeat_s)
    grace = sweeper.get("grace_s", SweeperConf.grace_s)
    if float(grace) < 2 * float(hb):
        raise ConfigError(
            f"hydra.sweeper.grace_s={grace:g} must be at least 2 x hydra.sweeper.heartbeat_s={hb:g} "
            "(a live worker would look dead)",
            key="hydra.sweeper.grace_s",
            allowed=[f">= {2 * float(hb):g}"],
        )


def _check_trial_fn_setting(trial_fn: Any) -> None:
    """``hydra.sweeper.trial_fn``: ``module:function``, a module that exists defining that function."""
    if not re.fullmatch(r"[\w.]+:\w+", str(trial_fn)):
        raise ConfigError(
            f"hydra.sweeper.trial_fn={trial_fn!r} must be 'module:function'",
            key="hydra.sweeper.trial_fn",
            allowed=[DEFAULT_TRIAL_FN],
        )
    _check_trial_fn(str(trial_fn))


def _check_css(css: Any) -> None:
    resolve_custom_search_space(str(css))


def _check_cuda_devices(devices: Any) -> None:
    bad = [d for d in devices if not re.fullmatch(r"\d+|GPU-[0-9A-Fa-f-]+|MIG-[\w/-]+", str(d).strip())]
    if bad:
        raise ConfigError(
            f"hydra.sweeper.cuda_devices={list(devices)} has {bad[0]!r}, not a device",
            key="hydra.sweeper.cuda_devices",
            allowed=["device indices >= 0, e.g. [0,1]", "GPU-<uuid>", "MIG-<uuid>"],
        )


def _check_preload(modules: Any) -> None:
    for module in modules:
        _check_importable(str(module))


def resolve_custom_search_space(path: str) -> Any:
    """``hydra.sweeper.custom_search_space`` as upstream resolves it: any dotted path
    ``hydra.utils.get_method`` finds (``custom-search-space-objective.configure`` included;
    ``module:function`` too). :class:`ConfigError` names the key when it does not resolve to a function."""
    from hydra.utils import get_method

    key = "hydra.sweeper.custom_search_space"
    try:
        fn = get_method(path.replace(":", "."))
    except Exception as exc:  # get_method wraps ImportError/AttributeError in its own messages
        why = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())[:300] or type(exc).__name__
        raise ConfigError(
            f"{key}={path!r} does not resolve ({why})",
            key=key,
            allowed=["a dotted path to a function fn(cfg, trial), e.g. my_app.configure"],
        ) from exc
    return fn


def _check_trial_fn(spec: str) -> None:
    """``hydra.sweeper.trial_fn=module:function`` must name a module that exists and, where its source can be
    read, a function defined at its top level: one refusal, not one error per trial. Found without importing
    it (the sweeper process stays light; the trial processes import it)."""
    import ast
    import importlib.util

    module, _, fn = spec.partition(":")
    key = "hydra.sweeper.trial_fn"
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(
            f"{key}={spec!r}: no module {module!r} can be imported", key=key, allowed=[DEFAULT_TRIAL_FN]
        )
    origin = Path(str(found.origin or ""))
    if origin.suffix != ".py" or not origin.is_file():
        return
    try:
        tree = ast.parse(origin.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return  # the trial's import says what is wrong with the module
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if fn not in names and "*" not in names and "__getattr__" not in names:
        raise ConfigError(f"{key}={spec!r}: {origin} defines no {fn!r}", key=key, allowed=[DEFAULT_TRIAL_FN])


def _check_importable(module: str) -> None:
    """A ``preload`` module must exist (found without importing it: the sweeper process stays light)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"hydra.sweeper.preload has {module!r}, a module that cannot be imported",
            key="hydra.sweeper.preload",
            allowed=["importable module names, e.g. " + ", ".join(DEFAULT_PRELOAD[:2])],
        )


@dataclass(frozen=True)
class Objective:
    """One objective: a metric of the result JSON and its direction."""

    metric: str
    direction: str  # "minimize" | "maximize"


#: ``sweep:`` keys a :class:`~vramsweep.sweeper.plan.Plan` reads through from its :class:`SweepConfig`.
SWEEP_KEYS = ("baseline", "factors", "stack", "preflight", "confirm", "check")


def _spec_name(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        if "name" in spec:
            return str(spec["name"])
        if "_target_" in spec:
            return str(spec["_target_"])
    if not isinstance(spec, str):
        return type(spec).__name__
    return str(spec)


def _as_list(value: Any, what: str) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return list(value)
    raise ConfigError(f"{what} must be a list, got {value!r}", key=what)


def parse_objectives(raw: Any, direction: Any = None) -> list[Objective]:
    """Normalise objectives (``sweep.objectives`` / ``hydra.sweeper.objectives`` / ``direction``).

    Accepts ``eval_loss``, ``[eval_loss, tokens_per_s]`` (default direction: the metric's registered one,
    :func:`vramsweep.record.metrics.direction`), ``[{metric: m, direction: d}]`` and ``{m: d}``.
    ``direction`` (str or list) overrides the directions in order.
    """

    items = _objective_items(raw)
    if not items:
        raise ConfigError(
            "sweep.objectives is empty", key="sweep.objectives", allowed=list(OBJECTIVE_METRICS)
        )
    if direction is not None:
        items = _override_directions(items, direction)
    out = [_objective(metric, d) for metric, d in items]
    if len({o.metric for o in out}) != len(out):
        raise ConfigError("sweep.objectives names a metric twice", key="sweep.objectives")
    return out


def _objective_items(raw: Any) -> list[tuple[str, str | None]]:
    """``(metric, direction or None)`` pairs of raw objectives: ``None`` is ``eval_loss`` minimised; a dict
    without ``metric`` maps metrics to directions; else each entry (of a list, or the one name or
    ``{metric, direction}`` dict) is a metric name or such a dict."""
    if raw is None:
        return [(M.EVAL_LOSS, "minimize")]
    if isinstance(raw, dict) and "metric" not in raw:
        return [(str(k), None if v is None else str(v)) for k, v in raw.items()]
    return [
        _objective_entry(entry)
        for entry in _as_list(raw if not isinstance(raw, dict) else [raw], "sweep.objectives")
    ]


def _objective_entry(entry: Any) -> tuple[str, str | None]:
    """One objectives entry: a metric name or ``{metric: ..., direction: ...}``."""
    if isinstance(entry, str):
        return (entry, None)
    if isinstance(entry, dict) and "metric" in entry:
        d = entry.get("direction")
        return (str(entry["metric"]), None if d is None else str(d))
    raise ConfigError(
        f"sweep.objectives entry {entry!r} must be a metric name or {{metric: ..., direction: ...}}",
        key="sweep.objectives",
        allowed=list(OBJECTIVE_METRICS),
    )


def _override_directions(items: list[tuple[str, str | None]], direction: Any) -> list[tuple[str, str | None]]:
    """``hydra.sweeper.direction`` (one entry per objective) replaces the items' directions in order."""
    dirs = _as_list(direction, "hydra.sweeper.direction")
    if len(dirs) != len(items):
        raise ConfigError(
            f"hydra.sweeper.direction has {len(dirs)} entries for {len(items)} objectives "
            f"({', '.join(m for m, _ in items)})",
            key="hydra.sweeper.direction",
        )
    return [(m, str(d)) for (m, _), d in zip(items, dirs)]


def _objective(metric: str, d: str | None) -> Objective:
    """One :class:`Objective`: a known objective metric, its direction (default: the metric's registered
    one) ``minimize`` or ``maximize`` in any case."""
    if not is_objective(metric):
        raise ConfigError(
            f"unknown objective metric {metric!r}",
            key="sweep.objectives",
            allowed=list(OBJECTIVE_METRICS),
        )
    if d is None:
        d = metric_direction(metric)
    d = d.lower()
    if d not in ("minimize", "maximize"):
        raise ConfigError(
            f"objective {metric}: direction={d!r}",
            key="sweep.objectives",
            allowed=["minimize", "maximize"],
        )
    return Objective(metric, d)


def _check_choice(value: Any, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not known", key=key, allowed=list(allowed))


def _check_spec(spec: Any, allowed: tuple[str, ...], key: str) -> Any:
    if isinstance(spec, str):
        _check_choice(spec.lower(), allowed, key)
        return spec.lower()
    if type(spec).__module__.startswith("optuna."):  # an already-instantiated sampler/pruner object
        return spec
    if isinstance(spec, dict):
        if "_target_" in spec:
            return dict(spec)
        if "name" in spec:
            _check_choice(str(spec["name"]).lower(), allowed, f"{key}.name")
            return {**spec, "name": str(spec["name"]).lower()}
    raise ConfigError(
        f"{key}={spec!r} must be a name or a dict with 'name' or '_target_'", key=key, allowed=list(allowed)
    )


@dataclass
class SweepConfig:
    """The ``sweep:`` node of a sweep file (``sweep=<name>``), typed: the keys a sweep file may set.

    ``name`` names the sweep (folder, study); ``design`` picks how its points are made (:data:`DESIGNS`, or
    ``max_context``: :mod:`vramsweep.sweeper.maxctx`); ``objectives`` are metric names or
    ``{metric, direction}``; ``baseline``/``factors`` make an ablation, ``stack`` a stacking design;
    ``repeats`` seeds per point (``None``: :func:`~vramsweep.sweeper.plan.default_repeats`); ``preflight``
    estimates every point before the first trial; ``edge_screen`` records the points estimated over the
    budget before the first trial and ``edge_start`` starts a search at the edge of the budget (``None``:
    :data:`EDGE_DEFAULTS` for a search with ``preflight`` and a budget;
    :func:`~vramsweep.sweeper.plan.edge_start_setting`);
    ``configs``/``fixed``/``max_context`` are the max-context driver's.
    """

    name: str | None = None
    design: str | None = None
    objectives: Any = None
    baseline: list[str] = field(default_factory=list)
    factors: list[list[str]] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    repeats: int | None = None
    preflight: bool = False
    edge_start: bool | None = None
    edge_screen: bool | None = None
    description: str | None = None
    configs: list[Any] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    max_context: dict[str, Any] = field(default_factory=dict)
    #: the confirm stage (sweeper/confirm.py): ``null``/``auto`` the configs pick chooses between, ``n`` the
    #: first n, ``0`` off; runs only when trials shared a GPU
    confirm: Any = None
    #: ``vramsweep check`` on the baseline before any trial (sweeper/precheck.py); a FAIL: exit 2
    check: bool = False

    @classmethod
    def from_dict(cls, node: dict[str, Any] | None) -> SweepConfig:
        """Parse a composed ``sweep:`` node; :class:`ConfigError` names an unknown key or a bad value."""

        if node is not None and not isinstance(node, dict):
            raise ConfigError(
                f"sweep: is a {type(node).__name__}, not a mapping",
                key="sweep",
                allowed=["sweep: {name: ..., design: ..., objectives: ...} (docs/CONTRACTS.md)"],
            )
        node = dict(node or {})
        known = sorted(cls.__dataclass_fields__)
        for k in node:
            if k not in cls.__dataclass_fields__:
                raise ConfigError(f"unknown key sweep.{k}", key=f"sweep.{k}", allowed=known)
        repeats = node.get("repeats")
        if repeats is not None and (not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1):
            raise ConfigError(
                f"sweep.repeats={repeats!r} must be an integer >= 1", key="sweep.repeats", allowed=["1.."]
            )
        return cls(
            name=None if node.get("name") is None else str(node["name"]),
            design=str(node["design"]) if node.get("design") else None,
            objectives=node.get("objectives"),
            baseline=[str(x) for x in _as_list(node.get("baseline"), "sweep.baseline")],
            factors=[
                [str(x) for x in _as_list(f, "sweep.factors[]")]
                for f in _as_list(node.get("factors"), "sweep.factors")
            ],
            stack=[str(x) for x in _as_list(node.get("stack"), "sweep.stack")],
            repeats=repeats,
            preflight=bool(node.get("preflight", False)),
            edge_start=_optional_bool(node.get("edge_start"), "sweep.edge_start"),
            edge_screen=_optional_bool(node.get("edge_screen"), "sweep.edge_screen"),
            description=node.get("description"),
            configs=list(node.get("configs") or []),
            fixed=[str(x) for x in _as_list(node.get("fixed"), "sweep.fixed")],
            max_context=dict(node.get("max_context") or {}),
            confirm=_confirm_value(node.get("confirm")),
            check=_bool_value(node.get("check", False), "sweep.check"),
        )


def _confirm_value(value: Any) -> int | str | None:
    """``sweep.confirm``: null or ``auto``, or a count >= 0 (0: off)."""
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1000:
        return value
    raise ConfigError(
        f"sweep.confirm={value!r} must be auto, null or a number of configs in 0..1000",
        key="sweep.confirm",
        allowed=["auto", "null", "0 (off)", "1..1000"],
    )


def _bool_value(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}={value!r} must be true or false", key=key, allowed=["true", "false"])


def _optional_bool(value: Any, key: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(
        f"{key}={value!r} must be true, false or null", key=key, allowed=["true", "false", "null"]
    )


#: ``sweep.edge_screen`` / ``sweep.edge_start`` when left ``null`` in a search with ``sweep.preflight`` and a
#: budget: the screen is on, the start is off (``bench/sweep_efficiency.py``, docs/SWEEPS.md *Efficiency*:
#: over three landscapes the start paid only where the best config is the highest-memory one that fits, about
#: even where rank hurts, and never reached a good config where quality is unrelated to memory; a sweep cannot
#: know its landscape beforehand).
EDGE_DEFAULTS = {"edge_screen": True, "edge_start": False}


def sweeper_conf(sweeper: dict[str, Any]) -> SweeperConf:
    """``hydra.sweeper.*`` as a :class:`SweeperConf`: unknown keys, types and ranges checked."""

    conf = SweeperConf()
    known = set(SweeperConf.__dataclass_fields__)
    for k, v in sweeper.items():
        if k in NOT_SETTINGS:
            continue
        if k not in known:
            raise ConfigError(
                f"unknown setting hydra.sweeper.{k}", key=f"hydra.sweeper.{k}", allowed=sorted(known)
            )
        setattr(conf, k, v)
    check_conf(sweeper)  # type and range of every key (its field's Rule), before anything else
    return _normalised(conf)


#: how a checked value of each :attr:`Rule.kind` is normalised (``n_jobs=2.0`` -> 2, ``cuda_devices=[0]`` ->
#: ["0"])
_NORMALISE = {
    "int": int,
    "float": float,
    "bool": bool,
    "strs": lambda v: [str(x) for x in v] or None,
}


def _normalised(conf: SweeperConf) -> SweeperConf:
    """``conf`` with each value in its rule's type (``null`` stays; ``n_trials``/``seed`` as given)."""
    out = {}
    for f in fields(conf):
        value, norm = getattr(conf, f.name), _NORMALISE.get(f.metadata["rule"].kind)
        keep = value is None or norm is None or f.name in ("n_trials", "seed") or value == "auto"
        out[f.name] = value if keep else norm(value)
    out["preload"] = out["preload"] or []
    return SweeperConf(**out)


def _param_str(value: Any) -> str:
    """A ``params`` entry as override-grammar text (YAML may have parsed ``8`` or a list already)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "choice(" + ",".join(_param_str(v) for v in value) + ")"
    return str(value)
