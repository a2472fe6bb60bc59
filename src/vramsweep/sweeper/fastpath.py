"""Re-running a finished sweep: print its summary without validating every point or importing torch.

``make demo`` twice, or a worker started after the others finished, should not compose every design
point (~0.3-0.8 s each) nor start the fork server (importing torch) only to find nothing to run.
:func:`finished_study` recomputes the sweep's identity from the run's draft plan
(:func:`~vramsweep.sweeper.plan.draft_plan`: its settings resolved, no config composed; the same draft the
validated path then completes) and opens the study read-only; when the fingerprint is the one stored,
every slot exists and none is WAITING or RUNNING, and no lost point may be retried, the sweep is complete.
Anything unexpected (another design, more ``n_trials``, a missing database, an error) returns ``None``:
the normal, fully validated path runs, so this shortcut can skip work but never change an outcome.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vramsweep.sweeper.plan import IDENTITY, Plan, name_sweep, plan_design, total_trials
from vramsweep.sweeper.storage import JOB_LOST, RETRIES, SLOT, make_storage, requeue_lost, sqlite_path


def finished_study(draft: Plan, task_cfg: dict[str, Any]) -> tuple[Any, Any] | None:
    """``(plan, study)`` when the sweep of ``draft`` (this command line's
    :func:`~vramsweep.sweeper.plan.draft_plan`) is already complete, else ``None``."""
    try:
        return _finished_study(draft, task_cfg)
    except Exception:  # broad on purpose: any doubt (storage, optuna, design) takes the validated path
        return None


def _finished_study(draft: Plan, task_cfg: dict[str, Any]) -> tuple[Any, Any] | None:
    base_seed = int((task_cfg.get("train") or {}).get("seed", 0))
    design = plan_design(draft, draft.dims, base_seed)
    # the study name (ad-hoc sweeps: <keys>-<identity hash>) and the identity to match
    plan = name_sweep(
        replace(
            draft,
            points=design,
            n_total=int(total_trials(draft, design, draft.dims)),
            base_seed=base_seed,
        )
    )
    db = sqlite_path(plan.storage_url)
    if db is None or not db.is_file():  # remote storages (and new sweeps) take the normal path
        return None
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name=plan.study_key,
        storage=make_storage(plan.storage_url, child=True),  # read-only: no table creation, no migration
        sampler=optuna.samplers.RandomSampler(),
        pruner=optuna.pruners.NopPruner(),
    )
    if study.user_attrs.get(IDENTITY) != plan.identity:
        return None
    if [d.name.lower() for d in study.directions] != [o.direction for o in plan.goals]:
        return None
    if list(study.metric_names or []) != [o.metric for o in plan.goals]:
        return None
    trials = study.get_trials(deepcopy=False)
    if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials):
        return None
    slots = {t.system_attrs.get(SLOT) for t in trials}
    if any(k not in slots for k in range(plan.n_total)):
        return None
    if any(
        t.system_attrs.get(JOB_LOST) or int(t.system_attrs.get(RETRIES, 0)) < plan.retry_stale
        for t in requeue_lost(study)
    ):
        return None  # a lost point may be retried now: the normal path does it
    return plan, study
