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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, compose
from vramsweep.config.urls import mask_url
from vramsweep.production.fingerprint import data_fingerprints
from vramsweep.record.metrics import PRUNABLE_METRICS
from vramsweep.sweeper.design import DesignPoint, build_design, design_choices
from vramsweep.sweeper.gpus import Layout, Profile, plan_layout
from vramsweep.sweeper.multirun import check_option_names, translate_args
from vramsweep.sweeper.samplers import make_pruner, make_sampler
from vramsweep.sweeper.settings import (
    SWEEP_KEYS,
    Objective,
    SweepConfig,
    SweeperConf,
    _spec_name,
    resolve_settings,
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
    :class:`SweeperConf` field. ``design`` is the design's name; ``points`` its points (``None``: a search).
    """

    conf: SweeperConf
    sweep: SweepConfig
    name: str
    design: str
    objectives: list[Objective]
    repeats: int
    n_jobs: int
    storage: str
    study_name: str
    sampler: Any
    pruner: Any
    #: the search space's entries as override-grammar text (the command line's pinned keys taken out)
    params: dict[str, str]
    sweep_dir: Path
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

    def __getattr__(self, key: str) -> Any:
        """A ``hydra.sweeper.*`` key from ``conf``, or a ``sweep:`` key from ``sweep``."""
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
        sweep_dir = self.sweep_dir
        if not self.sweep_dir_given:
            sweep_dir = Path(os.path.abspath(Path(self.results_dir) / "sweeps" / name))
        storage = self.storage if self.storage_given else f"sqlite:///{sweep_dir / 'study.db'}"
        return replace(self, name=name, study_name=name, sweep_dir=sweep_dir, storage=storage)

    @property
    def sampler_name(self) -> str:
        """Short sampler name, or the ``_target_`` class for dict samplers."""
        return _spec_name(self.sampler)

    @property
    def pruner_name(self) -> str:
        return _spec_name(self.pruner)

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def pruning_active(self) -> bool:
        """Pruning needs a search (fixed designs run every point to the end: their tables need full
        numbers) and a single objective that is the loss the trial reports at intermediate evals."""
        return (
            self.pruner_name != "none"
            and self.design == "search"
            and not self.multi_objective
            and self.objectives[0].metric in PRUNABLE_METRICS
            and self.objectives[0].direction == "minimize"
        )

    def public_dict(self) -> dict[str, Any]:
        """JSON-safe view of the settings for ``sweep.json`` (the storage password is masked)."""
        return {
            "name": self.name,
            "design": self.design,
            "objectives": [{"metric": o.metric, "direction": o.direction} for o in self.objectives],
            "baseline": list(self.baseline),
            "factors": [list(f) for f in self.factors],
            "stack": list(self.stack),
            "repeats": self.repeats,
            "preflight": self.preflight,
            "edge_start": self.edge_start,
            "edge_screen": self.edge_screen,
            "budget_gib": self.budget_gib,
            "storage": mask_url(self.storage),
            "study_name": self.study_name,
            "n_trials": self.n_trials,
            "n_jobs": self.n_jobs,
            "sampler": self.sampler if isinstance(self.sampler, str | dict) else type(self.sampler).__name__,
            "pruner": self.pruner if isinstance(self.pruner, str | dict) else type(self.pruner).__name__,
            "pruning_active": self.pruning_active,
            "params": dict(self.params),
            "seed": self.seed,
            "isolation": self.isolation,
            "trial_fn": self.trial_fn,
            "max_failure_rate": self.max_failure_rate,
            "timeout_s": self.timeout_s,
            "sweep_dir": str(self.sweep_dir),
        }


#: Fixed overrides that do not change what a trial measures (not part of a sweep's identity).
NOT_IDENTITY = ("results_dir", "sweep.name", "sweep.confirm", "train.resume_on_changed_data")
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
        "objectives": [f"{o.direction} {o.metric}" for o in plan.objectives],
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


def _say_pinned(sweeper_cfg: dict[str, Any], arguments: list[str]) -> None:
    """One line per search-space key the command line fixes (it is taken out of the space)."""
    cli_params, cli_fixed = cli_sweep_params(arguments)
    pinned = {override_key(o) for o in cli_fixed}
    for k in dict.fromkeys([*(str(k) for k in sweeper_cfg.get("params") or {}), *cli_params]):
        if k in pinned:
            print(
                f"vramsweep: {k} is fixed on the command line: removed from the search space", file=sys.stderr
            )


def sweep_frame(plan: Plan, cli_fixed: list[str]) -> tuple[list[Param], list[str]]:
    """``(dims, fixed overrides)``: the search space as given (not yet typed by a composed config) and the
    sweep file's fixed params followed by the command line's fixed overrides (they win), the trial cap
    checked before any config is composed or point built. Shared by :func:`plan_sweep` and the fast path."""
    dims, fixed_params = parse_params(plan.params)
    check_trial_cap(plan, dims)
    return dims, merge_overrides(fixed_params, cli_fixed)


def plan_sweep(sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]) -> Plan:
    """Parse and validate everything; raise ConfigError before anything is written."""
    from optuna.exceptions import ExperimentalWarning

    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # TPE's `group`, metric names

    plan, cli_fixed = pinned_plan(sweeper_cfg, task_cfg, arguments)
    dims0, fixed = sweep_frame(plan, cli_fixed)
    base = compose_base(fixed)
    _say_pinned(sweeper_cfg, arguments)
    intervals = [d.key for d in dims0 if d.kind == "interval"]
    dims, _ = parse_params(plan.params, int_keys=int_keys(base, intervals))
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
            plan.sampler, seed=plan.seed, n_jobs=plan.n_jobs, n_objectives=len(plan.objectives)
        )  # fail now on a bad sampler spec

    make_pruner(plan.pruner, active=True)
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
        n_jobs=layout.n_jobs,
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
    )
    return name_sweep(planned)


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

    return plan.pruner != SweeperConf.pruner


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
