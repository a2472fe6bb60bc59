"""A sweep's plan and identity: the validated settings, fixed overrides, space and points, and what makes two
runs the same sweep (stored with its study; ad-hoc sweeps are named after it). :func:`plan_sweep` builds it
from the composed config and the command line (:func:`compose_sweep`, :func:`plan_from_args`). Below the
engine and the finished-study fast path, which both build plans."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, compose
from vramsweep.config.paths import NAME_MAX
from vramsweep.config.urls import mask_url, normalise_storage_url
from vramsweep.data.reference import reference_of
from vramsweep.production.fingerprint import data_fingerprints
from vramsweep.record.metrics import PRUNABLE_METRICS
from vramsweep.record.result import is_quality_metric
from vramsweep.sweeper.design import DesignPoint, build_design, design_choices
from vramsweep.sweeper.gpus import Layout, Profile, plan_layout
from vramsweep.sweeper.multirun import check_option_names, translate_args
from vramsweep.sweeper.samplers import make_pruner, make_sampler
from vramsweep.sweeper.settings import (
    DESIGNS,
    EDGE_DEFAULTS,
    PRUNERS,
    QUALITY_REPEATS,
    SAMPLERS,
    SWEEP_KEYS,
    Objective,
    SweepConfig,
    SweeperConf,
    _check_choice,
    _check_spec,
    _param_str,
    _spec_name,
    parse_objectives,
    sweeper_conf,
)
from vramsweep.sweeper.space import (
    Param,
    cli_sweep_params,
    merge_overrides,
    override_key,
    parse_params,
    space_size,
)
from vramsweep.sweeper.validate import compose_base, int_keys, validate_design, validate_space

DEFAULT_SEARCH_TRIALS = 20
#: Trials one sweep may plan: far above any sweep of real fine-tunes, and checked by arithmetic before a
#: point is built (a 409,600-point grid took 48 s to be refused for disk space, sweep.repeats=100000 never
#: answered).
MAX_TRIALS = 10_000


@dataclass(frozen=True)
class Plan:
    """The validated sweep, built once by :func:`plan_sweep` (or, unvalidated, by the finished-study fast
    path) and named by :func:`name_sweep`; its settings part is what ``sweep.json`` records.

    It holds the checked :class:`SweeperConf` (``conf``) and :class:`SweepConfig` (``sweep``) and only the
    values derived from them: every ``hydra.sweeper.*`` key and ``sweep.baseline/factors/stack/preflight``
    read through (``plan.retry_stale`` is ``plan.conf.retry_stale``), so a new setting is one
    :class:`SweeperConf` field. A value derived from a setting has its own name (:data:`DERIVED`:
    ``plan.storage_url`` is the resolved ``hydra.sweeper.storage``; ``plan.storage`` is refused, so the
    given and the resolved value cannot be mixed up). ``design`` is the design's name; ``points`` its
    points (``None``: a search).
    """

    conf: SweeperConf
    sweep: SweepConfig
    name: str
    design: str
    #: the objectives resolved (``sweep.objectives``, ``hydra.sweeper.objectives`` and ``direction``)
    goals: list[Objective]
    repeats: int
    #: worker slots (``hydra.sweeper.n_jobs`` resolved: ``auto`` and ``isolation=inprocess``, the layout)
    n_workers: int
    #: the study's storage URL (``hydra.sweeper.storage`` resolved: default, checked, normalised)
    storage_url: str
    #: the Optuna study's name (``hydra.sweeper.study_name``, else the sweep's name)
    study_key: str
    #: the sampler (``hydra.sweeper.sampler`` checked, or the design's default)
    sampler_spec: Any
    #: the pruner (``hydra.sweeper.pruner`` checked)
    pruner_spec: Any
    #: the search space's entries as override-grammar text (``hydra.sweeper.params`` and the command
    #: line's lists, the command line's pinned keys taken out)
    space_text: dict[str, str]
    #: the sweep folder (``hydra.sweeper.sweep_dir`` resolved, absolute)
    folder: Path
    results_dir: str = "results"
    #: ``hardware.budget_gib`` of the composed base config
    budget_gib: float = 0.0
    #: named by a sweep file, ``sweep.name=`` or ``hydra.sweeper.study_name`` (else named by its identity
    #: hash)
    named: bool = True
    #: why this design (for the describe line), e.g. "command-line lists"
    design_reason: str = ""
    #: ``sweep.edge_start`` resolved: a search with a budget starts at the edge
    #: (:mod:`vramsweep.sweeper.edge`)
    edge_start: bool = False
    #: ``sweep.edge_screen`` resolved: points the estimator puts over the budget recorded before the first
    #: trial (:mod:`vramsweep.sweeper.edge`)
    edge_screen: bool = False
    #: the sweep file's fixed params, then the command line's fixed overrides (they win)
    fixed: list[str] = field(default_factory=list)
    dims: list[Param] = field(default_factory=list)
    points: list[DesignPoint] | None = None
    n_total: int = 0
    base_seed: int = 0
    identity: dict[str, Any] = field(default_factory=dict)
    sweep_id: str = ""
    wandb: bool = False  # trials log to W&B: keep the sweep-summary run current as trials finish
    #: worker slots and GPU seats (:func:`.gpus.plan_layout`); ``None`` until :func:`plan_sweep` sets it
    layout: Layout | None = None
    #: the base config's data files: ``{key: {path, sha256}}`` (a re-run on changed data is refused)
    data_files: dict[str, Any] = field(default_factory=dict)
    #: ``sweep.check=true``: the baseline's ``vramsweep check`` lines (:mod:`.precheck`); else ``None``
    check_result: dict[str, Any] | None = None
    #: what every trial's held-out records are rendered under (:mod:`vramsweep.data.reference`): the
    #: baseline's template, thinking switch and context length; trials read it from ``sweep.json``
    eval_reference: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, key: str) -> Any:
        """A ``hydra.sweeper.*`` key from ``conf``, or a ``sweep:`` key from ``sweep``; a setting with a
        derived value (:data:`DERIVED`) is refused, naming both."""
        if key in DERIVED:
            raise AttributeError(
                f"Plan.{key} is ambiguous: plan.{DERIVED[key]} (resolved) or plan.conf.{key} (as given)"
            )
        if key in SweeperConf.__dataclass_fields__:
            return getattr(self.__dict__["conf"], key)
        if key in SWEEP_KEYS:
            return getattr(self.__dict__["sweep"], key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    @property
    def storage_given(self) -> bool:
        return bool(self.conf.storage)

    @property
    def sweep_dir_given(self) -> bool:
        return bool(self.conf.sweep_dir)

    def renamed(self, name: str) -> Plan:
        """An unnamed (ad-hoc) sweep given its name: study name, folder and default storage follow it."""
        folder = self.folder
        if not self.sweep_dir_given:
            folder = Path(os.path.abspath(Path(self.results_dir) / "sweeps" / name))
        storage = self.storage_url if self.storage_given else f"sqlite:///{folder / 'study.db'}"
        return replace(self, name=name, study_key=name, folder=folder, storage_url=storage)

    @property
    def sampler_name(self) -> str:
        """Short sampler name, or the ``_target_`` class for dict samplers."""
        return _spec_name(self.sampler_spec)

    @property
    def pruner_name(self) -> str:
        return _spec_name(self.pruner_spec)

    @property
    def multi_objective(self) -> bool:
        return len(self.goals) > 1

    @property
    def pruning_active(self) -> bool:
        """Pruning needs a search (fixed designs run every point to the end: their tables need full
        numbers) and a single objective that is the loss the trial reports at intermediate evals."""
        return (
            self.pruner_name != "none"
            and self.design == "search"
            and not self.multi_objective
            and self.goals[0].metric in PRUNABLE_METRICS
            and self.goals[0].direction == "minimize"
        )

    def public_dict(self) -> dict[str, Any]:
        """JSON-safe view of the settings for ``sweep.json``: every ``hydra.sweeper.*`` setting (each
        :class:`SweeperConf` field, read off the dataclass: a new field is recorded without an edit here),
        a derived one (:data:`DERIVED`) as resolved under the setting's name, the storage password masked;
        then the sweep file's design keys."""
        out: dict[str, Any] = {f.name: _json_safe(getattr(self.conf, f.name)) for f in fields(self.conf)}
        out |= {key: _json_safe(getattr(self, derived)) for key, derived in DERIVED.items()}
        out |= {
            "name": self.name,
            "design": self.design,
            "objectives": [{"metric": o.metric, "direction": o.direction} for o in self.goals],
            "baseline": list(self.baseline),
            "factors": [list(f) for f in self.factors],
            "stack": list(self.stack),
            "repeats": self.repeats,
            "preflight": self.preflight,
            "edge_start": self.edge_start,
            "edge_screen": self.edge_screen,
            "budget_gib": self.budget_gib,
            "storage": mask_url(self.storage_url),
            "pruning_active": self.pruning_active,
            "sweep_dir": str(self.folder),
            # sweep.check=true only (the settings of a sweep without it are recorded as before)
            **({"check": True, "check_result": self.check_result} if self.check else {}),
            "eval_reference": dict(self.eval_reference) or None,
        }
        return out


#: ``hydra.sweeper.*`` settings whose value a :class:`Plan` resolves, and the name the resolved value has
#: there (``sweep.json`` records the resolved value under the setting's name)
DERIVED = {
    "n_jobs": "n_workers",
    "storage": "storage_url",
    "study_name": "study_key",
    "sampler": "sampler_spec",
    "pruner": "pruner_spec",
    "objectives": "goals",
    "params": "space_text",
    "sweep_dir": "folder",
}


def _json_safe(value: Any) -> Any:
    """A setting as ``sweep.json`` holds it: plain values as they are, a sampler/pruner object by its class
    name, an objective by ``{metric, direction}``, a path as text."""
    if isinstance(value, Objective):
        return {"metric": value.metric, "direction": value.direction}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Path):
        return str(value)
    return type(value).__name__


#: Fixed overrides that do not change what a trial measures (not part of a sweep's identity).
NOT_IDENTITY = ("results_dir", "sweep.name", "sweep.confirm", "sweep.check", "train.resume_on_changed_data")
IDENTITY = "vramsweep:identity"
#: study attributes: the data files' sha256 as the study started (docs/RUNS.md "Changed data"), and the
#: changes ``train.resume_on_changed_data=true`` let a re-run continue on
DATA_ATTR = "vramsweep:data"
DATA_CHANGES_ATTR = "vramsweep:data_changes"


def sweep_identity(plan: Plan) -> dict[str, Any]:
    """What makes two runs the same sweep: design and its points (or the search space), the fixed
    overrides, the objectives and the trial function. Stored with the study; a resume must match it."""
    import dataclasses

    ident: dict[str, Any] = {
        "design": plan.design,
        "objectives": [f"{o.direction} {o.metric}" for o in plan.goals],
        "fixed": sorted(o for o in plan.fixed if override_key(o) not in NOT_IDENTITY),
        "trial_fn": plan.trial_fn,
    }
    if plan.points is not None:
        ident["points"] = [list(p.overrides) for p in plan.points]
    else:
        ident["space"] = {
            d.key: {k: v for k, v in dataclasses.asdict(d).items() if k not in ("key", "texts")}
            for d in plan.dims
        }
    return json.loads(json.dumps(ident, default=str))


def identity_hash(identity: dict[str, Any]) -> str:
    """A short stable hash of a sweep's identity (names ad-hoc sweeps)."""
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def name_sweep(plan: Plan) -> Plan:
    """``plan`` with its identity and hash; an ad-hoc sweep (no sweep file, ``sweep.name`` or ``study_name``)
    is named ``<swept keys>-<hash>``, so each distinct sweep gets its own folder and study, and the same
    command resumes its own."""
    identity = sweep_identity(plan)
    sweep_id = identity_hash(identity)
    if not plan.named:
        keys = [d.key for d in plan.dims] or list(design_choices(plan.points or []))
        stem = re.sub(r"[^A-Za-z0-9_.\-]+", "_", "-".join(keys))[:48].strip("-_") or "multirun"
        plan = plan.renamed(f"{stem}-{sweep_id}")
    return replace(plan, identity=identity, sweep_id=sweep_id)


def check_trial_cap(plan: Plan, dims: list[Param]) -> None:
    """More than :data:`MAX_TRIALS` trials planned: a ConfigError naming what multiplies them, counted
    without building a point."""
    repeats = int(plan.repeats)
    if plan.design == "grid":
        points, what = space_size(dims), f"a grid of {space_size(dims):,.0f} points x {repeats:,} repeat(s)"
        key = "sweep.repeats" if repeats > MAX_TRIALS else "hydra.sweeper.params"
    elif plan.design == "ablation":
        points, what = (
            1 + len(plan.factors),
            f"{1 + len(plan.factors)} ablation points x {repeats:,} repeat(s)",
        )
        key = "sweep.repeats"
    elif plan.design == "stacking":
        points, what = (
            1 + len(plan.stack),
            f"{1 + len(plan.stack)} stacking steps x {repeats:,} repeat(s)",
        )
        key = "sweep.repeats"
    else:
        if plan.n_trials is None:
            return  # a search without n_trials runs DEFAULT_SEARCH_TRIALS at most
        points, what, key = (
            float(plan.n_trials),
            f"n_trials={plan.n_trials:,}",
            "hydra.sweeper.n_trials",
        )
        repeats = 1
    total = points * repeats
    if plan.design != "search" and plan.n_trials is not None:
        total = min(total, plan.n_trials)  # a design capped by n_trials runs that many
    if total > MAX_TRIALS:
        raise ConfigError(
            f"{key}: the sweep plans {total:,.0f} trials ({what}); one sweep runs at most "
            f"{MAX_TRIALS:,}: use fewer values or repeats, or split it into several sweeps",
            key=key,
            allowed=[f"1..{MAX_TRIALS:,} trials"],
        )


def plan_design(plan: Plan, dims: list[Param], base_seed: int) -> list[DesignPoint] | None:
    """The fixed design's points (grid/ablation/stacking), or None for a search."""
    return build_design(
        plan.design,
        dims=dims,
        baseline=plan.baseline,
        factors=plan.factors,
        stack=plan.stack,
        repeats=plan.repeats,
        base_seed=base_seed,
    )


def total_trials(plan: Plan, design: list[DesignPoint] | None, dims: list[Param]) -> int:
    """The study's total: every design point (at most ``n_trials``), or ``n_trials`` / the default for a
    search (before the engine caps it to the space size when duplicates are not re-run)."""
    if design is not None:
        return len(design) if plan.n_trials is None else min(plan.n_trials, len(design))
    if plan.n_trials is not None:
        return int(plan.n_trials)
    return int(min(DEFAULT_SEARCH_TRIALS, space_size(dims)))


def default_repeats(design: str, objectives: list[Objective]) -> int:
    """``sweep.repeats`` when the sweep file leaves it out: :data:`QUALITY_REPEATS` seeds per point for an
    ablation/stacking design with a quality objective (eval loss moves by run-to-run noise as much as by
    many knobs: one seed cannot tell them apart), else 1 (memory is deterministic; speed repeats cost
    as much as they help on a shared machine, so a sweep asks for them explicitly)."""

    quality = any(is_quality_metric(o.metric) for o in objectives)
    return QUALITY_REPEATS if design in ("ablation", "stacking") and quality else 1


def _all_discrete(params: dict[str, str]) -> bool:
    """Whether every entry is a comma list / ``choice`` / ``range`` (a grid can enumerate it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for key, text in params.items():
        try:
            ov = parser.parse_overrides([f"{key}={text}"])[0]
        except Exception:
            return True  # parse errors are reported (naming the entry) when the space is parsed
        if ov.is_interval_sweep():
            return False
    return True


def edge_start_setting(sweep: SweepConfig, design: str, budget_gib: float, key: str = "edge_start") -> bool:
    """``sweep.edge_start`` (or ``key="edge_screen"``) resolved: ``null`` (default) is
    :data:`~vramsweep.sweeper.settings.EDGE_DEFAULTS` for a search with ``sweep.preflight`` and a budget, else
    off; ``true`` needs a search and a budget (else a ConfigError); ``false`` is off."""
    value = getattr(sweep, key)
    if value is None:
        return EDGE_DEFAULTS[key] and design == "search" and sweep.preflight and budget_gib > 0
    if value and (design != "search" or budget_gib <= 0):
        raise ConfigError(
            f"sweep.{key}=true needs a search design and a memory budget (this sweep: design {design}, "
            f"hardware.budget_gib={budget_gib:g})",
            key=f"sweep.{key}",
            allowed=["false", "null", "true with sweep.design=search and hardware.budget_gib > 0"],
        )
    return bool(value)


def _sampler_spec(conf: SweeperConf) -> Any:
    """``hydra.sweeper.sampler`` checked; hydra-optuna-sweeper's GridSampler config means our grid."""

    sampler = None if conf.sampler is None else _check_spec(conf.sampler, SAMPLERS, "hydra.sweeper.sampler")
    if isinstance(sampler, dict) and str(sampler.get("_target_", "")).endswith("GridSampler"):
        if sampler.get("search_space"):
            raise ConfigError(
                "hydra.sweeper.sampler: GridSampler takes its grid from the search space "
                "(hydra.sweeper.params or the command line's lists), not from search_space",
                key="hydra.sweeper.sampler",
            )
        sampler = "grid"  # hydra-optuna-sweeper's GridSampler config: the grid is our search space
    return sampler


def _choose_design(
    sweep: SweepConfig, conf: SweeperConf, sampler: Any, cli_params: dict[str, str], sweep_file: str
) -> tuple[str, str, Any]:
    """``(design, why, sampler)``: a sweep file's ``sweep.design`` wins; else ``hydra.sweeper.sampler``
    (``grid`` -> grid, any other -> search); else ``hydra.sweeper.params`` -> search; else the command
    line's lists are a grid, or a search when one of them is an ``interval``."""
    if sweep.design:
        design, reason = sweep.design, f"sweep.design in sweep {sweep_file!r}"
    elif sampler is not None:
        design = "grid" if sampler == "grid" else "search"
        reason = f"hydra.sweeper.sampler={_spec_name(sampler)}"
    elif conf.params:
        design, reason = (
            "search",
            "hydra.sweeper.params" + (f" of sweep {sweep_file!r}" if sweep.name else ""),
        )
    elif _all_discrete(cli_params):
        design, reason = "grid", "command-line lists (every combination once)"
    else:
        design, reason = "search", "an interval on the command line can only be searched"
    _check_choice(design, DESIGNS, "sweep.design")
    if design == "search" and sampler == "grid":
        design = "grid"
    if sampler is None:
        sampler = "grid" if design == "grid" else "tpe"
    return design, reason, sampler


def _check_design_parts(sweep: SweepConfig, design: str, params: dict[str, str]) -> None:
    if design == "ablation" and not (sweep.baseline or sweep.factors):
        raise ConfigError("sweep.design=ablation needs sweep.baseline and sweep.factors", key="sweep.factors")
    if design == "stacking" and not sweep.stack:
        raise ConfigError("sweep.design=stacking needs sweep.stack", key="sweep.stack")
    if design in ("search", "grid") and not params:
        raise ConfigError(
            f"sweep.design={design} needs a search space: hydra.sweeper.params or sweep overrides "
            "on the command line",
            key="hydra.sweeper.params",
        )


def _storage_url(conf: SweeperConf, sweep_dir: Path) -> str:
    """The study's storage URL (default: ``sqlite:///<sweep dir>/study.db``), checked and normalised."""

    storage = conf.storage or f"sqlite:///{sweep_dir / 'study.db'}"
    if storage in ("memory", ":memory:"):
        raise ConfigError(
            "hydra.sweeper.storage=memory cannot be shared with trial processes or resumed; use "
            "sqlite or postgresql",
            key="hydra.sweeper.storage",
        )
    if not re.match(r"^(sqlite|postgresql(\+\w+)?|mysql(\+\w+)?)://", storage):
        raise ConfigError(
            f"hydra.sweeper.storage={mask_url(storage)!r} is not a supported URL",
            key="hydra.sweeper.storage",
            allowed=["sqlite:///path/study.db", "postgresql://user@host:5432/db", "mysql://..."],
        )
    return normalise_storage_url(storage)


def _checked_name(name: str) -> str:
    """``sweep.name``, refused unless it is a plain file name a folder can carry."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name) or name in (".", ".."):
        raise ConfigError(f"sweep.name={name!r} must be a plain file name", key="sweep.name")
    if len(name.encode()) > NAME_MAX:
        raise ConfigError(
            f"sweep.name is {len(name.encode())} bytes long; a folder name holds at most {NAME_MAX}",
            key="sweep.name",
            allowed=[f"a plain file name of 1..{NAME_MAX} bytes"],
        )
    return name


def resolve_settings(
    sweeper: dict[str, Any],
    task_cfg: dict[str, Any],
    *,
    cli_params: dict[str, str] | None = None,
    sweep_file: str | None = None,
    pinned: set[str] | None = None,
    budget_gib: float | None = None,
) -> dict[str, Any]:
    """Merge ``hydra.sweeper.*`` (``sweeper``, a :class:`SweeperConf`) with the task config's ``sweep:``
    node (a :class:`SweepConfig`): the keyword arguments of a :class:`~vramsweep.sweeper.plan.Plan` (the
    checked ``conf`` and ``sweep`` and the values derived from them; the space and points come later).

    Args:
        sweeper: the ``hydra.sweeper`` node as a plain dict (``_target_`` ignored).
        task_cfg: the composed task config as a plain dict (``sweep``, ``results_dir``, ``hardware``).
        cli_params: search-space entries from the command line (override ``params``).
        sweep_file: the selected ``sweep=<name>`` option, if any (a sweep file may ask for a search).
        pinned: keys the command line fixes: taken out of the search space once the design is chosen.
        budget_gib: ``hardware.budget_gib`` of the composed base config (``None``: the task config's).

    The design: :func:`_choose_design`.
    """

    conf = sweeper_conf(sweeper)
    if conf.custom_search_space:
        raise ConfigError(
            f"hydra.sweeper.custom_search_space={conf.custom_search_space!r} is for function mode (a Hydra "
            "app that returns its objective); vramsweep's trials take their space from hydra.sweeper.params",
            key="hydra.sweeper.custom_search_space",
            allowed=["null", "hydra.sweeper.params entries"],
        )
    sweep = SweepConfig.from_dict(task_cfg.get("sweep"))
    named = bool(sweep.name or conf.study_name)
    # sweep.name=<x> on the command line arrives as study_name (it names the folder and the study)
    name = _checked_name(str(conf.study_name or sweep.name or "multirun"))
    design, reason, sampler = _choose_design(
        sweep, conf, _sampler_spec(conf), dict(cli_params or {}), sweep_file or name
    )
    objectives = parse_objectives(
        conf.objectives if conf.objectives is not None else sweep.objectives, conf.direction
    )
    params = {str(k): _param_str(v) for k, v in (conf.params or {}).items()} | dict(cli_params or {})
    _check_design_parts(sweep, design, params)
    results_dir = str(task_cfg.get("results_dir") or "results")
    sweep_dir = Path(os.path.abspath(conf.sweep_dir or Path(results_dir) / "sweeps" / name))
    task_budget = float((task_cfg.get("hardware") or {}).get("budget_gib") or 0.0)
    params = {k: v for k, v in params.items() if k not in (pinned or ())}
    return dict(
        conf=conf,
        sweep=sweep,
        name=name,
        design=design,
        goals=objectives,
        repeats=sweep.repeats if sweep.repeats is not None else default_repeats(design, objectives),
        # isolation=inprocess runs one trial at a time
        n_workers=1 if conf.isolation == "inprocess" or conf.n_jobs == "auto" else int(conf.n_jobs),
        storage_url=_storage_url(conf, sweep_dir),
        study_key=str(conf.study_name or name),
        sampler_spec=sampler,
        pruner_spec=_check_spec(conf.pruner, PRUNERS, "hydra.sweeper.pruner"),
        space_text=params,
        folder=sweep_dir,
        results_dir=results_dir,
        budget_gib=budget_gib if budget_gib is not None else task_budget,
        named=named,
        design_reason=reason,
        edge_start=edge_start_setting(sweep, design, task_budget),
        edge_screen=edge_start_setting(sweep, design, task_budget, key="edge_screen"),
    )


def pinned_plan(
    sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]
) -> tuple[Plan, list[str]]:
    """The sweep's settings resolved into a :class:`Plan` (no space or points yet), the command line's lists
    as parameters and its fixed overrides taken out of the search space (they win); returns ``(plan, the
    command line's fixed overrides)``."""
    cli_params, cli_fixed = cli_sweep_params(arguments)
    sweep_node = task_cfg.get("sweep") or {}
    plan = Plan(
        **resolve_settings(
            sweeper_cfg,
            task_cfg,
            cli_params=cli_params,
            sweep_file=sweep_node.get("name") if sweep_node else None,
            pinned={override_key(o) for o in cli_fixed},
        )
    )
    return plan, cli_fixed


def _say_pinned(conf: SweeperConf, arguments: list[str]) -> None:
    """One line per search-space key the command line fixes (it is taken out of the space)."""
    cli_params, cli_fixed = cli_sweep_params(arguments)
    pinned = {override_key(o) for o in cli_fixed}
    for k in dict.fromkeys([*(str(k) for k in conf.params or {}), *cli_params]):
        if k in pinned:
            print(
                f"vramsweep: {k} is fixed on the command line: removed from the search space", file=sys.stderr
            )


def sweep_frame(plan: Plan, cli_fixed: list[str]) -> tuple[list[Param], list[str]]:
    """``(dims, fixed overrides)``: the search space as given (not yet typed by a composed config) and the
    sweep file's fixed params followed by the command line's fixed overrides (they win), the trial cap
    checked before any config is composed or point built. Shared by :func:`plan_sweep` and the fast path."""
    dims, fixed_params = parse_params(plan.space_text)
    check_trial_cap(plan, dims)
    return dims, merge_overrides(fixed_params, cli_fixed)


def draft_plan(sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]) -> Plan:
    """The sweep's settings resolved (:func:`pinned_plan`), its fixed overrides and its search space as given
    (not yet typed by a composed config), the trial cap checked: what the finished-study fast path
    (:mod:`.fastpath`) needs, and what :func:`plan_sweep` completes. No config is composed, nothing printed;
    a ConfigError for bad settings."""
    plan, cli_fixed = pinned_plan(sweeper_cfg, task_cfg, arguments)
    dims, fixed = sweep_frame(plan, cli_fixed)
    return replace(plan, fixed=fixed, dims=dims)


def plan_sweep(
    sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str], *, draft: Plan | None = None
) -> Plan:
    """Parse and validate everything; raise ConfigError before anything is written. ``draft``: this command
    line's :func:`draft_plan`, built already (the settings are resolved once per run)."""
    from optuna.exceptions import ExperimentalWarning

    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # TPE's `group`, metric names

    plan = draft if draft is not None else draft_plan(sweeper_cfg, task_cfg, arguments)
    dims0, fixed = plan.dims, plan.fixed
    base = compose_base(fixed)
    _say_pinned(plan.conf, arguments)
    intervals = [d.key for d in dims0 if d.kind == "interval"]
    dims, _ = parse_params(plan.space_text, int_keys=int_keys(base, intervals))
    base_seed = int(base.train.seed)
    if dims:
        validate_space(fixed, dims)
    design = plan_design(plan, dims, base_seed)
    n_total = total_trials(plan, design, dims)
    if design is not None:
        if plan.design != "grid":  # a grid's values were all probed above; its combinations run as data
            validate_design(fixed, design)
        if plan.n_trials is not None and plan.n_trials > len(design):
            print(
                f"vramsweep: the {plan.design} design has {len(design)} points; "
                f"n_trials={plan.n_trials} capped to {len(design)}",
                file=sys.stderr,
            )
    else:
        size = space_size(dims)
        if plan.dedup and n_total > size:
            print(
                f"vramsweep: the search space has {int(size)} distinct points; n_trials={n_total} capped to "
                f"{int(size)} (a point is measured once; use hydra.sweeper.dedup=false to re-run points)",
                file=sys.stderr,
            )
            n_total = int(size)

        make_sampler(
            plan.sampler_spec, seed=plan.seed, n_jobs=plan.n_workers, n_objectives=len(plan.goals)
        )  # fail now on a bad sampler spec

    make_pruner(plan.pruner_spec, active=True)
    if (
        plan.pruning_active
        and _pruner_chosen(plan)
        and int(base.train.eval_every) == 0
        and not any(override_key(o) == "train.eval_every" for d in (design or []) for o in d.overrides)
    ):
        print(
            "vramsweep: pruning is on but train.eval_every=0 (no intermediate evals): set train.eval_every",
            file=sys.stderr,
        )
    if plan.isolation == "inprocess" and plan.conf.n_jobs not in ("auto", 1):
        print("vramsweep: isolation=inprocess runs one trial at a time: n_jobs set to 1", file=sys.stderr)
    wandb = str((task_cfg.get("logger") or {}).get("name")) == "wandb" or "logger=wandb" in fixed
    hw = Profile.of(base.hardware, swept=hardware_swept(dims, design))
    layout = plan_layout(plan.conf, plan.isolation, hw)
    for note in layout.notes:
        print(f"vramsweep: {note}", file=sys.stderr)
    planned = replace(
        plan,
        n_workers=layout.n_jobs,
        layout=layout,
        # the composed base config's budget (the sweep file's fixed params may set it)
        budget_gib=float(base.hardware.budget_gib or 0.0),
        fixed=fixed,
        dims=dims,
        points=design,
        n_total=int(n_total),
        base_seed=base_seed,
        wandb=wandb,
        data_files=data_fingerprints(base),
        eval_reference=eval_reference(base, plan, dims),
    )
    return name_sweep(planned)


def eval_reference(base: Any, plan: Plan, dims: list[Param]) -> dict[str, Any]:
    """The held-out records' reference (:mod:`vramsweep.data.reference`): an ablation's or a stacking's
    baseline; for a grid or a search, the base config with the shortest ``context.max_tokens`` the space
    holds (a context every trial can score at)."""
    if plan.design in ("ablation", "stacking"):
        return reference_of(base, plan.baseline)
    ref = reference_of(base)
    for d in dims:
        if d.key == "context.max_tokens":
            ref["context.max_tokens"] = int(min(d.values) if d.discrete and d.values else d.low)
    return ref


def hardware_swept(dims: list[Param], design: list[DesignPoint] | None) -> bool:
    """Whether the sweep varies the hardware profile (then each trial's cap may differ)."""
    keys = [d.key for d in dims] + [override_key(o) for p in design or [] for o in p.overrides]
    return any(k == "hardware" or k.startswith("hardware.") for k in keys)


def identity_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two sweep identities, in override terms."""
    parts = []
    for key, what in (("design", "design"), ("objectives", "objectives"), ("trial_fn", "trial function")):
        if old.get(key) != new.get(key):
            parts.append(f"{what}: study {old.get(key)} vs this run {new.get(key)}")
    if old.get("fixed") != new.get("fixed"):
        o, n = old.get("fixed") or [], new.get("fixed") or []
        parts.append(
            f"fixed overrides: study [{' '.join(x for x in o if x not in n)}] vs this run "
            f"[{' '.join(x for x in n if x not in o)}]"
        )
    if old.get("points") != new.get("points"):
        o = [" ".join(p) for p in old.get("points") or []]
        n = [" ".join(p) for p in new.get("points") or []]
        gone, added = [x for x in o if x not in n], [x for x in n if x not in o]
        parts.append(
            "design points: "
            + (f"only in the study: {'; '.join(gone)[:300]}" if gone else "")
            + ("; " if gone and added else "")
            + (f"only in this run: {'; '.join(added)[:300]}" if added else "")
            + ("" if gone or added else "same points, other order")
        )
    if old.get("space") != new.get("space"):
        o, n = old.get("space") or {}, new.get("space") or {}
        for k in sorted(set(o) | set(n)):
            if o.get(k) != n.get(k):
                parts.append(
                    f"search space {k}: study {_space_text(o.get(k))} vs this run {_space_text(n.get(k))}"
                )
    return "; ".join(parts) or "identity differs"


def _space_text(d: dict[str, Any] | None) -> str:
    if not d:
        return "(absent)"
    if d.get("kind") in ("choice", "range"):
        return "{" + ",".join(str(v) for v in d.get("values") or []) + "}"
    return f"interval({d.get('low')}, {d.get('high')}{', log' if d.get('log') else ''})"


def _pruner_chosen(plan: Plan) -> bool:
    """Whether the user chose the pruner (a warning about it is actionable); the default one on a
    default search without intermediate evals simply never prunes, which is fine."""

    return plan.pruner_spec != SweeperConf.pruner


def compose_sweep(args: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Compose ``train.yaml`` the way ``vramsweep train -m <args>`` would, without running anything.

    Returns:
        ``(hydra.sweeper node, task config, task arguments)`` as plain containers, ready for
        :func:`plan_sweep` (tests and tools use this to check sweep files).
    """
    from omegaconf import OmegaConf

    check_option_names(args)
    args = translate_args(args)
    hydra_ovs = [a for a in args if a.lstrip("+").startswith("hydra")]
    task_args = [a for a in args if a not in hydra_ovs]
    _, fixed = cli_sweep_params(task_args)
    if not any(a.startswith("hydra/sweeper=") for a in hydra_ovs):
        hydra_ovs = ["hydra/sweeper=vramsweep", *hydra_ovs]
    cfg = compose([*hydra_ovs, *fixed], rules="none", return_hydra_config=True)
    sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    task = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    return dict(sweeper), dict(OmegaConf.to_container(task, resolve=True)), task_args


def plan_from_args(args: list[str]) -> Plan:
    """:func:`compose_sweep` + :func:`plan_sweep`: the validated plan of ``vramsweep train -m <args>``."""
    sweeper, task, task_args = compose_sweep(args)
    return plan_sweep(sweeper, task, task_args)
