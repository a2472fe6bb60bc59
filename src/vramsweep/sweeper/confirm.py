"""The confirm stage (``sweep.confirm``): after a sweep whose trials shared GPUs (``trials_per_gpu``), the
configs ``pick`` would choose between run again, each alone on a GPU, so the final ranking's throughput is the
card's own.

1. :func:`configs_to_confirm`: from the sweep's results (``vramsweep report``'s loader), the eligible configs
   (every ok trial within ``hardware.budget_gib``) ranked as ``pick --prefer quality`` ranks them; ``auto``
   (``null``, the default) takes those tied with the best on eval loss (where throughput decides), at most
   :data:`AUTO_MAX`; ``<n>`` the first n; ``0`` none. Only configs whose every trial's throughput was shared
   are re-run.
2. :func:`confirm_plan`: a second fixed-design study ``<study>.confirm`` in ``<sweep dir>/confirm`` (its own
   resume: a re-run of the same command finishes it exactly), one trial per GPU, each point the config's
   full overrides, ``meta.design = {kind: confirm, of: <trial>}``.
3. ``vramsweep report`` reads ``confirm/trials`` beside ``trials`` (shared vs alone, one table); ``pick``
   ranks on the alone figure.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vramsweep.report import ReportError, load_sweep
from vramsweep.report.pick import BEST, EQUAL, eligible, quality_tiers, rank_key
from vramsweep.sweeper.design import DesignPoint
from vramsweep.sweeper.gpus import Layout
from vramsweep.sweeper.plan import Plan, name_sweep

#: Most configs ``sweep.confirm: auto`` re-runs (the tie with the best can be wide on noisy losses).
AUTO_MAX = 4
CONFIRM_DIR = "confirm"


def confirm_setting(plan: Plan) -> int | None:
    """``sweep.confirm`` resolved: ``None`` = auto, else how many configs (0 = off)."""
    value = getattr(plan.sweep, "confirm", None)
    return None if value in (None, "auto") else int(value)


def configs_to_confirm(sweep_dir: Path, budget_gib: float, setting: int | None) -> list[Any]:
    """The representative trials (``TrialRecord``) of the configs to re-run alone, best first."""

    if setting == 0:
        return []
    try:
        sweep = load_sweep(str(sweep_dir))
    except ReportError:
        return []
    ok = eligible(sweep, budget_gib if budget_gib > 0 else float("inf"), None)
    tiers = quality_tiers(sweep, [t for c in ok for t in c.trials])
    ranked = sorted(ok, key=lambda c: rank_key(c, "quality", tiers))
    if setting is None:
        tied = [c for c in ranked if c.number in tiers and tiers[c.number].verdict in (BEST, EQUAL)]
        ranked = tied[:AUTO_MAX]
    else:
        ranked = ranked[:setting]
    return [c.rep for c in ranked if all(t.gpu_shared for t in c.trials)]


def confirm_plan(plan: Plan, trials: list[Any]) -> Plan:
    """The confirm stage's plan: one point per trial in ``trials`` (its full overrides), one trial per GPU."""
    sweep_dir = plan.folder / CONFIRM_DIR
    storage = plan.storage_url if plan.storage_given else f"sqlite:///{sweep_dir / 'study.db'}"
    points = [
        DesignPoint(i, list(t.overrides), {}, {"kind": "confirm", "role": "confirm", "of": t.number})
        for i, t in enumerate(trials)
    ]
    layout = plan.layout or Layout(1)
    n_gpus = len(layout.gpus)
    alone = replace(
        layout,
        per_gpu=1,
        n_jobs=max(1, min(n_gpus or 1, len(points))),
        line=(
            f"{min(n_gpus, len(points))} worker(s) on GPU(s) {','.join(layout.gpus)}, one trial per GPU"
            if n_gpus
            else "1 worker"
        ),
        why="sweep.confirm: each config alone on a GPU",
    )
    conf = replace(plan.conf, sweep_dir=str(sweep_dir), study_name=None, trials_per_gpu=1, n_trials=None)
    cplan = replace(
        plan,
        conf=conf,
        name=f"{plan.name}.confirm",
        study_key=f"{plan.study_key}.confirm",
        design="grid",
        design_reason="sweep.confirm: the configs pick chooses between, each alone on a GPU",
        folder=sweep_dir,
        storage_url=storage,
        fixed=[],
        dims=[],
        points=points,
        n_total=len(points),
        repeats=1,
        named=True,
        edge_start=False,
        layout=alone,
        n_workers=alone.n_jobs,
    )
    return name_sweep(cplan)


def may_confirm(plan: Plan) -> bool:
    """Whether a finished sweep may still have a confirm stage to run or finish (its ``sweep.json`` says its
    trials shared GPUs and ``sweep.confirm`` is not 0): then a re-run takes the normal path, not the
    finished-study shortcut."""
    import json

    if confirm_setting(plan) == 0:
        return False
    try:
        workers = json.loads((plan.folder / "sweep.json").read_text()).get("workers") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return int(workers.get("trials_per_gpu") or 1) > 1


def confirm_stage(plan: Plan) -> Plan | None:
    """The plan of ``plan``'s confirm stage when its sweep shared GPUs (``None`` when there is nothing to
    confirm); the engine runs it (this module does not import the engine: no cycle)."""
    if plan.layout is None or not plan.layout.shares or plan.isolation in ("launcher", "inprocess"):
        return None
    setting = confirm_setting(plan)
    trials = configs_to_confirm(plan.folder, plan.budget_gib, setting)
    if not trials:
        return None
    print(
        f"vramsweep: confirm: {len(trials)} config(s) pick chooses between measured their throughput on a "
        f"shared GPU (trial(s) {', '.join(f'{t.number:04d}' for t in trials)}): each runs again alone "
        f"(sweep.confirm; results in {plan.folder / CONFIRM_DIR})",
        flush=True,
    )
    return confirm_plan(plan, trials)
