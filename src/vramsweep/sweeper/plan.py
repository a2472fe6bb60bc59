"""A sweep's plan and identity: the validated settings, fixed overrides, space and points, and what makes two
runs the same sweep (stored with its study; ad-hoc sweeps are named after it). Below the engine and the
finished-study fast path, which both build plans."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from vramsweep.sweeper.design import DesignPoint, build_design, design_choices
from vramsweep.sweeper.settings import Settings
from vramsweep.sweeper.space import Param, override_key, space_size

DEFAULT_SEARCH_TRIALS = 20


@dataclass
class Plan:
    """The validated sweep: settings, fixed overrides, space and (for fixed designs) points."""

    settings: Settings
    fixed: list[str]
    dims: list[Param]
    design: list[DesignPoint] | None
    n_total: int
    base_seed: int = 0
    identity: dict[str, Any] = field(default_factory=dict)
    sweep_id: str = ""
    wandb: bool = False  # trials log to W&B: keep the sweep-summary run current as trials finish


#: Fixed overrides that do not change what a trial measures (not part of a sweep's identity).
NOT_IDENTITY = ("results_dir", "sweep.name")
IDENTITY = "vramsweep:identity"


def sweep_identity(plan: Plan) -> dict[str, Any]:
    """What makes two runs the same sweep: design and its points (or the search space), the fixed
    overrides, the objectives and the trial function. Stored with the study; a resume must match it."""
    import dataclasses

    s = plan.settings
    ident: dict[str, Any] = {
        "design": s.design,
        "objectives": [f"{o.direction} {o.metric}" for o in s.objectives],
        "fixed": sorted(o for o in plan.fixed if override_key(o) not in NOT_IDENTITY),
        "trial_fn": s.trial_fn,
    }
    if plan.design is not None:
        ident["points"] = [list(p.overrides) for p in plan.design]
    else:
        ident["space"] = {
            d.key: {k: v for k, v in dataclasses.asdict(d).items() if k not in ("key", "texts")}
            for d in plan.dims
        }
    return json.loads(json.dumps(ident, default=str))


def identity_hash(identity: dict[str, Any]) -> str:
    """A short stable hash of a sweep's identity (names ad-hoc sweeps)."""
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def name_sweep(plan: Plan) -> None:
    """An ad-hoc sweep (no sweep file, ``sweep.name`` or ``study_name``) is named ``<swept keys>-<hash>``,
    so each distinct sweep gets its own folder and study, and the same command resumes its own."""
    s = plan.settings
    plan.identity = sweep_identity(plan)
    plan.sweep_id = identity_hash(plan.identity)
    if s.named:
        return
    keys = [d.key for d in plan.dims] or list(design_choices(plan.design or []))
    stem = re.sub(r"[^A-Za-z0-9_.\-]+", "_", "-".join(keys))[:48].strip("-_") or "multirun"
    s.rename(f"{stem}-{plan.sweep_id}")


def plan_design(settings: Settings, dims: list[Param], base_seed: int) -> list[DesignPoint] | None:
    """The fixed design's points (grid/ablation/stacking), or None for a search."""
    return build_design(
        settings.design,
        dims=dims,
        baseline=settings.baseline,
        factors=settings.factors,
        stack=settings.stack,
        repeats=settings.repeats,
        base_seed=base_seed,
    )


def total_trials(settings: Settings, design: list[DesignPoint] | None, dims: list[Param]) -> int:
    """The study's total: every design point (at most ``n_trials``), or ``n_trials`` / the default for a
    search (before the engine caps it to the space size when duplicates are not re-run)."""
    if design is not None:
        return len(design) if settings.n_trials is None else min(settings.n_trials, len(design))
    if settings.n_trials is not None:
        return int(settings.n_trials)
    return int(min(DEFAULT_SEARCH_TRIALS, space_size(dims)))
