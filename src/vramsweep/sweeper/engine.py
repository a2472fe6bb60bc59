"""The sweep engine: validate, create the study once, then N worker slots pop trials and run them.

Flow of :func:`run_sweep`:

1. Settings (``hydra.sweeper.*`` + the sweep file's ``sweep:``) and the search space are parsed; every
   value is composed and range-checked (:mod:`.validate`). Any ConfigError -> exit 2, nothing written.
2. The sweep folder, ``sweep.json`` and the study are created once (under the storage lock); stale
   trials of dead workers are reconciled and the study is topped up to ``n_trials`` slots
   (:mod:`.storage`).
3. ``n_jobs`` worker threads each pop a slot, let the sampler fill it (or take the design point),
   run it in a fresh process (:mod:`.runner`), and tell Optuna the outcome (:mod:`.outcome`). A
   heartbeat thread stamps running trials.
4. A summary, and ``results: <sweep folder>``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.design import design_choices
from vramsweep.sweeper.isolation import make_runner
from vramsweep.sweeper.outcome import CONSTRAINT_KEY, Outcome, user_attrs
from vramsweep.sweeper.plan import (  # noqa: F401 - re-exported
    DEFAULT_SEARCH_TRIALS,
    IDENTITY,
    NOT_IDENTITY,
    Plan,
    identity_hash,
    name_sweep,
    plan_design,
    sweep_identity,
    total_trials,
)
from vramsweep.sweeper.progress import Progress, fmt_override, plural, trial_line
from vramsweep.sweeper.settings import Settings, resolve_settings
from vramsweep.sweeper.space import (
    cli_sweep_params,
    merge_overrides,
    override_key,
    params_to_overrides,
    parse_params,
    space_size,
    suggest,
)
from vramsweep.sweeper.storage import (
    COPY_OF,
    FINGERPRINT,
    HEARTBEAT,
    LOST,
    OWNER,
    RETRIES,
    RETRY_OF,
    SLOT,
    is_stale,
    load_or_create_study,
    pop_slot,
    process_identity,
    requeue_lost,
    storage_lock,
    top_up,
    trial_counts,
)
from vramsweep.sweeper.trialproc import RunReport, TrialSpec, _load_child_result

log = logging.getLogger("vramsweep.sweeper")

#: After this many re-proposed points in a row for one slot, the slot gets an unmeasured point at random.
DEDUP_PATIENCE = 3
DUP_STREAK = "vramsweep:dup_streak"
#: System attribute optuna-dashboard reads a trial's constraints from (a list; Optuna 5 itself writes
#: ``constraints:<name>``; it reads both, so the budget constraint shows up once more as ``"0"``).
DASHBOARD_CONSTRAINTS_KEY = "constraints"
#: Statuses whose outcome is a property of the config (copied for a duplicate point, not re-run).
COPYABLE = ("ok", "oom", "unsupported", "infeasible_estimate", "diverged", "pruned")


@dataclass
class Job:
    """A popped trial, ready to run."""

    trial: Any
    number: int
    slot: int
    overrides: list[str]
    label: list[str]  # what the point changes, for progress lines
    design: dict[str, Any]
    retry_of: int | None = None
    duplicate_of: int | None = None
    source: dict[str, Any] | None = None
    dup_streak: int = 0
    retries: int = 0  # how many earlier trials of this point were lost (dead worker, Ctrl-C)


def plan_sweep(sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]) -> Plan:
    """Parse and validate everything; raise ConfigError before anything is written."""
    from optuna.exceptions import ExperimentalWarning

    from vramsweep.sweeper.validate import compose_base, int_keys, validate_design, validate_space

    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # TPE's `group`, metric names

    cli_params, cli_fixed = cli_sweep_params(arguments)
    sweep_node = task_cfg.get("sweep") or {}
    settings = resolve_settings(
        sweeper_cfg,
        task_cfg,
        cli_params=cli_params,
        sweep_file=sweep_node.get("name") if sweep_node else None,
    )
    pinned = {override_key(o) for o in cli_fixed}
    params = {k: v for k, v in settings.params.items() if k not in pinned}
    for k in settings.params:
        if k in pinned:
            print(
                f"vramsweep: {k} is fixed on the command line: removed from the search space", file=sys.stderr
            )
    settings.params = params
    # the sweep file's fixed params first, the command line's fixed overrides last (they win)
    dims0, fixed_params = parse_params(params)
    fixed = merge_overrides(fixed_params, cli_fixed)
    base = compose_base(fixed)
    dims, _ = parse_params(params, int_keys=int_keys(base, [d.key for d in dims0 if d.kind == "interval"]))
    settings.budget_gib = float(base.hardware.budget_gib or 0.0)
    base_seed = int(base.train.seed)
    if dims:
        validate_space(fixed, dims)
    design = plan_design(settings, dims, base_seed)
    n_total = total_trials(settings, design, dims)
    if design is not None:
        if settings.design != "grid":  # a grid's values were all probed above; its combinations run as data
            validate_design(fixed, design)
        if settings.n_trials is not None and settings.n_trials > len(design):
            print(
                f"vramsweep: the {settings.design} design has {len(design)} points; n_trials={settings.n_trials} "
                f"capped to {len(design)}",
                file=sys.stderr,
            )
    else:
        size = space_size(dims)
        if settings.dedup and n_total > size:
            print(
                f"vramsweep: the search space has {int(size)} distinct points; n_trials={n_total} capped to "
                f"{int(size)} (a point is measured once; use hydra.sweeper.dedup=false to re-run points)",
                file=sys.stderr,
            )
            n_total = int(size)
        from vramsweep.sweeper.samplers import make_sampler

        make_sampler(
            settings.sampler,
            seed=settings.seed,
            n_jobs=settings.n_jobs,
            n_objectives=len(settings.objectives),
        )  # fail now on a bad sampler spec
    from vramsweep.sweeper.samplers import make_pruner

    make_pruner(settings.pruner, active=True)
    if (
        settings.pruning_active
        and _pruner_chosen(settings)
        and int(base.train.eval_every) == 0
        and not any(override_key(o) == "train.eval_every" for d in (design or []) for o in d.overrides)
    ):
        print(
            "vramsweep: pruning is on but train.eval_every=0 (no intermediate evals): set train.eval_every",
            file=sys.stderr,
        )
    if settings.isolation == "inprocess" and settings.n_jobs > 1:
        print("vramsweep: isolation=inprocess runs one trial at a time: n_jobs set to 1", file=sys.stderr)
        settings.n_jobs = 1
    plan = Plan(settings, fixed, dims, design, int(n_total), base_seed)
    plan.wandb = str((task_cfg.get("logger") or {}).get("name")) == "wandb" or "logger=wandb" in fixed
    name_sweep(plan)
    return plan


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


def _point_key(params: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), repr(v)) for k, v in params.items()))


def _pruner_chosen(settings: Settings) -> bool:
    """Whether the user chose the pruner (a warning about it is actionable); the default one on a
    default search without intermediate evals simply never prunes, which is fine."""
    from vramsweep.sweeper.settings import SweeperConf

    return settings.pruner != SweeperConf.pruner


def _wall(result: dict[str, Any], fallback: float) -> float:
    w = (result.get("meta") or {}).get("wall_s")
    return float(w) if isinstance(w, int | float) else fallback


def _design_label(design: dict[str, Any], overrides: list[str]) -> list[str]:
    """What a design point changes, for progress lines."""
    rep = [f"(seed repeat {design['repeat']})"] if design.get("repeat") else []
    if design.get("kind") == "ablation":
        return (
            ["(baseline)"] if design.get("role") == "baseline" else list(design.get("change") or [])
        ) + rep
    if design.get("kind") == "stacking":
        return ([f"+{design['added']}"] if design.get("added") else ["(baseline)"]) + rep
    return list(overrides)


def compose_sweep(args: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Compose ``conf/train.yaml`` the way ``vramsweep train -m <args>`` would, without running anything.

    Returns:
        ``(hydra.sweeper node, task config, task arguments)`` as plain containers, ready for
        :func:`plan_sweep` (tests and tools use this to check sweep files).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from vramsweep.config.compose import _translate_hydra_error, conf_dir
    from vramsweep.config.schema import register_configs
    from vramsweep.sweeper.isolation import preserved_global_hydra
    from vramsweep.sweeper.multirun import check_option_names, translate_args

    check_option_names(args)
    args = translate_args(args)
    hydra_ovs = [a for a in args if a.lstrip("+").startswith("hydra")]
    task_args = [a for a in args if a not in hydra_ovs]
    _, fixed = cli_sweep_params(task_args)
    if not any(a.startswith("hydra/sweeper=") for a in hydra_ovs):
        hydra_ovs = ["hydra/sweeper=vramsweep", *hydra_ovs]
    register_configs()
    with preserved_global_hydra():
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
                cfg = compose(config_name="train", overrides=[*hydra_ovs, *fixed], return_hydra_config=True)
        except Exception as exc:
            raise _translate_hydra_error(exc) from exc
        finally:
            GlobalHydra.instance().clear()
    sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    task = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    return dict(sweeper), dict(OmegaConf.to_container(task, resolve=True)), task_args


def plan_from_args(args: list[str]) -> Plan:
    """:func:`compose_sweep` + :func:`plan_sweep`: the validated plan of ``vramsweep train -m <args>``."""
    sweeper, task, task_args = compose_sweep(args)
    return plan_sweep(sweeper, task, task_args)


class Sweep:
    """One sweeper process working on a study (other processes/machines may work on it too)."""

    def __init__(self, plan: Plan, runner: Any = None, launcher_factory: Any = None):
        self.plan = plan
        self.s = plan.settings
        self.wandb_summary: Any = None  # report.wandb_summary.SummaryUpdater when trials log to W&B
        self.trials_dir = self.s.sweep_dir / "trials"
        self.launcher_factory = launcher_factory
        if self.s.isolation == "launcher":
            if launcher_factory is None:
                raise ConfigError(
                    "hydra.sweeper.isolation=launcher needs the Hydra sweeper plugin (vramsweep train -m)",
                    key="hydra.sweeper.isolation",
                )
            self.runner = make_runner("inprocess", [])  # only for describe(); trials go through the launcher
            self.runner.name = "launcher"
        else:
            self.runner = runner or make_runner(self.s.isolation, self.s.preload)
        self.choices = design_choices(plan.design) if plan.design is not None else {}
        self.identity = process_identity()
        self.study: Any = None
        self.admin: Any = None
        self.storage: Any = None
        self.progress: Progress | None = None
        self._ask_lock = threading.Lock()
        self._tell_lock = threading.Lock()
        self._running: set[int] = set()
        self._stop = threading.Event()
        self.abort = threading.Event()
        self.interrupted = False
        self.abort_reason: str | None = None
        self.finished = 0
        self.failures = 0
        self.statuses: dict[str, int] = {}

    # ------------------------------------------------------------------ set-up
    def result_path(self, number: int) -> Path:
        return self.trials_dir / f"{number:04d}.json"

    def _slot_attrs(self, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.plan.design is None:
            return {}, {}
        point = self.plan.design[k]
        return {"fixed_params": dict(point.params)}, {"design": point.design}

    def stored_identity(self) -> dict[str, Any] | None:
        """The identity stored with this sweep's study, without creating storage or study (``None``: new)."""
        from vramsweep.sweeper.storage import make_storage, sqlite_path

        path = sqlite_path(self.s.storage)
        if path is not None and not path.is_file():
            return None
        with storage_lock(self.s.storage, self.s.study_name):  # table creation races other workers
            try:
                storage = make_storage(self.s.storage)
                study_id = storage.get_study_id_from_name(self.s.study_name)
            except KeyError:
                return None
            attrs = storage.get_study_user_attrs(study_id)
        ident = attrs.get(IDENTITY)
        if ident is None and FINGERPRINT in attrs:  # a study from before identities: compare what it kept
            fp = attrs[FINGERPRINT]
            ident = dict(self.plan.identity) | {
                "fixed": sorted(o for o in fp.get("fixed") or [] if override_key(o) not in NOT_IDENTITY)
            }
            if fp.get("points") is not None:
                ident["points"] = fp["points"]
        return ident

    def check_identity(self) -> None:
        """Resume only the same sweep; else a ConfigError (exit 2) naming both."""
        old = self.stored_identity()
        if old is None or old == self.plan.identity:
            return
        where = self.s.storage if "@" not in self.s.storage else "<storage URL>"
        raise ConfigError(
            f"sweep '{self.s.name}' (study '{self.s.study_name}' in {where}) was started by a different sweep: "
            f"{identity_diff(old, self.plan.identity)}. A sweep resumes only with the same design, search space "
            f"and fixed overrides: run the original command to resume it, or give this one its own name "
            f"(sweep.name=<new> or hydra.sweeper.study_name=<new>), or delete {self.s.sweep_dir}",
            key="sweep.name",
        )

    def prepare(self) -> None:
        """Create the folder, ``sweep.json`` and the study; reconcile stale trials; top up the slots."""
        import optuna

        from vramsweep.record.result import atomic_write_json
        from vramsweep.sweeper.samplers import make_pruner, make_sampler

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.progress = Progress(self.plan.n_total, enabled=self.s.progress)
        self.check_identity()  # a different sweep under this name: exit 2 before anything is written
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            self.s.sweep_dir / "sweep.json",
            self.s.public_dict()
            | {
                "fixed_overrides": self.plan.fixed,
                "n_total": self.plan.n_total,
                "design_points": len(self.plan.design) if self.plan.design is not None else None,
                "sweep_id": self.plan.sweep_id,
                "identity": self.plan.identity,
            },
        )
        if self.plan.design is None:
            sampler = make_sampler(
                self.s.sampler, seed=self.s.seed, n_jobs=self.s.n_jobs, n_objectives=len(self.s.objectives)
            )
        else:
            sampler = optuna.samplers.RandomSampler(seed=self.s.seed)  # every param is fixed per point
        pruner = make_pruner(self.s.pruner, active=self.s.pruning_active)
        self.study = load_or_create_study(self.s, sampler, pruner)
        self.storage = self.study._storage
        self.admin = optuna.load_study(
            study_name=self.s.study_name,
            storage=self.storage,
            sampler=optuna.samplers.RandomSampler(),
            pruner=optuna.pruners.NopPruner(),
        )
        with storage_lock(self.s.storage, self.s.study_name):
            if IDENTITY not in self.study.user_attrs:
                self.study.set_user_attr(IDENTITY, self.plan.identity)
                self.study.set_user_attr("vramsweep:sweep_id", self.plan.sweep_id)
                self.study.set_user_attr(
                    "sweep",
                    {
                        "name": self.s.name,
                        "design": self.s.design,
                        "objectives": [o.metric for o in self.s.objectives],
                    },
                )
            self.reconcile()
            self._requeue_lost()
            added = top_up(self.study, self.plan.n_total, self._slot_attrs)
        counts = trial_counts(self.study)
        done = sum(v for k, v in counts.items() if k in ("COMPLETE", "PRUNED", "FAIL"))
        self.progress.done = done
        if done or added < self.plan.n_total:
            self.progress.say(
                f"vramsweep: resuming study '{self.s.study_name}': {done}/{self.plan.n_total} finished, "
                f"{counts.get('WAITING', 0)} to run, {counts.get('RUNNING', 0)} running elsewhere"
            )

    # ------------------------------------------------------------------ reconciliation
    def reconcile(self) -> int:
        """Fail (and retry once) or tell-from-JSON every stale RUNNING trial. Call under the lock."""
        from optuna.trial import TrialState

        reaped = 0
        now = time.time()
        for t in self.admin.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t._trial_id in self._running or not is_stale(t, self.s.grace_s, now):
                continue
            self._reap(t, now)
            reaped += 1
        return reaped

    def _reap(self, t: Any, now: float) -> None:
        import optuna

        trial = optuna.Trial(self.admin, t._trial_id)
        data = _load_child_result(str(self.result_path(t.number)))
        for tmp in self.trials_dir.glob(f".{t.number:04d}.json.*.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()
        if data is not None:
            outcome = Outcome.from_dict(data["meta"]["optuna"])
            self._tell(self.admin, trial, data, outcome)
            self._say(
                f"vramsweep: trial {t.number:04d} finished while its worker died: told from its result file"
            )
            return
        slot = t.system_attrs.get(SLOT)
        retries = int(t.system_attrs.get(RETRIES, 0))
        owner = t.system_attrs.get(OWNER) or {}
        beat = t.system_attrs.get(HEARTBEAT)
        age = f"{now - float(beat):.0f} s ago" if beat else "never"
        will_retry = self._retry_lost(self.admin, t, retries)
        reason = (
            f"stale: the worker running this trial died (host {owner.get('host', '?')} pid {owner.get('pid', '?')}, "
            f"last heartbeat {age}); {self._retry_note(retries, will_retry)}"
        )
        spec = self._spec_for(
            t.number,
            t._trial_id,
            int(slot) if slot is not None else -1,
            list(t.user_attrs.get("overrides") or []),
            dict(t.user_attrs.get("design") or {}),
            t.system_attrs.get(RETRY_OF),
            worker=0,
        )
        res = self._lost_result(spec, reason, retries, t._trial_id)
        self._tell(self.admin, trial, res, Outcome.from_dict(res["meta"]["optuna"]))
        self._say(
            f"vramsweep: trial {t.number:04d} was left RUNNING by a dead worker: failed"
            + (
                f" and re-enqueued (retry {retries + 1}/{self.s.retry_stale})"
                if will_retry
                else "; not retried again"
            )
        )

    # ------------------------------------------------------------------ lost points (dead worker, Ctrl-C)
    def _retry_lost(self, study: Any, t: Any, retries: int) -> bool:
        """Re-enqueue a lost trial's point into its slot when it has retries left; whether it did."""
        from optuna.trial import TrialState, create_trial

        slot = t.system_attrs.get(SLOT)
        if slot is None or retries >= self.s.retry_stale:
            return False
        study.add_trial(
            create_trial(
                state=TrialState.WAITING,
                system_attrs={
                    "fixed_params": dict(t.params),
                    SLOT: slot,
                    RETRY_OF: t.number,
                    RETRIES: retries + 1,
                },
                user_attrs={
                    "retry_of": t.number,
                    "retries": retries + 1,
                    **({"design": t.user_attrs["design"]} if "design" in t.user_attrs else {}),
                },
            )
        )
        return True

    def _retry_note(self, retries: int, will_retry: bool) -> str:
        n = self.s.retry_stale
        if will_retry:
            return f"its config is retried ({retries + 1}/{n})"
        return (
            f"not retried again: lost {retries + 1} time(s), hydra.sweeper.retry_stale={n}; "
            "re-run with a higher hydra.sweeper.retry_stale to retry it"
        )

    def _lost_result(self, spec: TrialSpec, reason: str, retries: int, trial_id: int) -> dict[str, Any]:
        """The result JSON of a lost trial (``meta.retries`` = earlier losses of its point); marks it lost."""
        from vramsweep.record.result import atomic_write_json
        from vramsweep.sweeper.trialproc import parent_side_result

        res = parent_side_result(spec, reason, 0.0)
        res["meta"]["retries"] = retries
        res["meta"]["lost"] = True
        atomic_write_json(spec.result_path, res)
        self.storage.set_trial_system_attr(trial_id, LOST, True)
        return res

    def _requeue_lost(self) -> int:
        """Slots whose last trial was lost (and not retried: the bound was reached) get a retry when
        ``retry_stale`` now allows one. Call under the lock."""
        n = 0
        for t in requeue_lost(self.admin):
            retries = int(t.system_attrs.get(RETRIES, 0))
            if self._retry_lost(self.admin, t, retries):
                n += 1
                self._say(
                    f"vramsweep: trial {t.number:04d}'s point was lost {retries + 1} time(s): "
                    f"retried again (hydra.sweeper.retry_stale={self.s.retry_stale})"
                )
        return n

    def _note_retries(self, job: Job, report: RunReport) -> None:
        """Record in a retried point's result JSON how many earlier trials of it were lost."""
        if not job.retries or job.duplicate_of is not None:
            return
        from vramsweep.record.result import atomic_write_json

        report.result.setdefault("meta", {})["retries"] = job.retries
        path = self.result_path(job.number)
        if path.exists():
            atomic_write_json(path, report.result)

    # ------------------------------------------------------------------ trials
    def _spec_for(
        self,
        number: int,
        trial_id: int,
        slot: int,
        overrides: list[str],
        design: dict[str, Any],
        retry_of: int | None,
        worker: int,
    ) -> TrialSpec:
        env = dict(os.environ)
        env["VRAMSWEEP_SWEEP_DIR"] = str(self.s.sweep_dir)  # trial W&B runs go to <sweep dir>/wandb
        if self.s.cuda_devices:
            env["CUDA_VISIBLE_DEVICES"] = self.s.cuda_devices[worker % len(self.s.cuda_devices)]
        return TrialSpec(
            number=number,
            trial_id=trial_id,
            slot=slot,
            overrides=overrides,
            result_path=str(self.result_path(number)),
            sweep_name=self.s.name,
            study_name=self.s.study_name,
            storage=self.s.storage,
            objectives=list(self.s.objectives),
            trial_fn=self.s.trial_fn,
            design=design,
            pruner=self.s.pruner,
            pruning=self.s.pruning_active,
            budget_gib=self.s.budget_gib,
            preflight=self.s.preflight,
            retry_of=retry_of,
            log_path=None if self.s.isolation == "inprocess" else str(self.trials_dir / f"{number:04d}.log"),
            parent_pid=os.getpid(),
            parent_ctime=self.identity.get("ctime"),
            env=env,
            cwd=os.getcwd(),
        )

    def _find_duplicate(self, params: dict[str, Any], number: int) -> tuple[int, dict[str, Any]] | None:
        from optuna.trial import TrialState

        for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        ):
            if t.number == number or t.params != params or t.user_attrs.get("status") not in COPYABLE:
                continue
            data = _load_child_result(str(self.result_path(t.number)))
            if data is None:
                continue
            return int(t.user_attrs.get("duplicate_of", t.number)), data
        return None

    def next_job(self) -> Job | None:
        """Pop a slot and fill in its config; ``None`` when no slot is waiting."""
        import optuna

        with self._ask_lock:
            with storage_lock(self.s.storage, self.s.study_name):
                trial_id = pop_slot(self.study, self.plan.n_total)
            if trial_id is None:
                return None
            self._running.add(trial_id)
            self.storage.set_trial_system_attr(trial_id, OWNER, self.identity)
            self.storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())
            trial = optuna.Trial(self.study, trial_id)
            frozen = self.storage.get_trial(trial_id)
            slot = int(frozen.system_attrs[SLOT])
            retry_of = frozen.system_attrs.get(RETRY_OF)
            retries = int(frozen.system_attrs.get(RETRIES, 0))
            if self.plan.design is not None:
                point = self.plan.design[slot]
                for k in point.params:
                    trial.suggest_categorical(k, self.choices[k])
                design = dict(point.design)
                point_overrides = list(point.overrides)
                label = _design_label(design, point_overrides)
            else:
                params = {d.key: suggest(trial, d) for d in self.plan.dims}
                point_overrides = params_to_overrides(params, self.plan.dims)
                label = point_overrides
                design = {"kind": "search"}
            overrides = merge_overrides(self.plan.fixed, point_overrides)
            trial.set_user_attr("overrides", overrides)
            trial.set_user_attr("design", design)
            job = Job(trial, trial.number, slot, overrides, label, design, retry_of, retries=retries)
            job.dup_streak = int(frozen.system_attrs.get(DUP_STREAK, 0))
            if self.plan.design is None and self.s.dedup and retry_of is None:
                dup = self._find_duplicate(trial.params, trial.number)
                if dup is not None:
                    job.duplicate_of, job.source = dup
            return job

    def _copy_duplicate(self, job: Job) -> RunReport:
        from vramsweep.record.result import atomic_write_json

        res = copy.deepcopy(job.source or {})
        res["trial"] = job.number
        meta = res.setdefault("meta", {})
        meta["duplicate_of"] = job.duplicate_of
        meta["wall_s"] = 0.0
        meta["design"] = job.design
        meta["optuna"] = dict(meta.get("optuna") or {}) | {"trial_number": job.number}
        atomic_write_json(self.result_path(job.number), res)
        return RunReport(res, Outcome.from_dict(meta["optuna"]), 0.0, None)

    def _record_duplicate(self, job: Job) -> None:
        """A re-proposed point: tell the sampler the earlier outcome (so it learns), but do not count it:
        the slot gets a fresh trial (an unmeasured point at random after DEDUP_PATIENCE copies in a row)."""
        from optuna.trial import TrialState, create_trial

        report = self._copy_duplicate(job)
        with self._tell_lock:
            self.storage.set_trial_system_attr(job.trial._trial_id, COPY_OF, job.duplicate_of)
            job.trial.set_user_attr("duplicate_of", job.duplicate_of)
            self._tell(self.study, job.trial, report.result, report.outcome)
            self._running.discard(job.trial._trial_id)
        streak = job.dup_streak + 1
        attrs: dict[str, Any] = {SLOT: job.slot, DUP_STREAK: streak}
        note = "re-sampled"
        with storage_lock(self.s.storage, self.s.study_name):
            if streak >= DEDUP_PATIENCE:
                point = self._unmeasured_point(job.number)
                if point is None:
                    self._say(
                        f"vramsweep: trial {job.number:04d} repeats trial {job.duplicate_of:04d} and every point of "
                        "the search space is measured: slot left empty"
                    )
                    return
                attrs["fixed_params"] = point
                note = "given an unmeasured point at random"
            self.study.add_trial(create_trial(state=TrialState.WAITING, system_attrs=attrs))
        self._say(
            f"vramsweep: trial {job.number:04d} = trial {job.duplicate_of:04d} (re-proposed point: outcome copied, "
            f"not counted); slot {job.slot} {note}"
        )

    def _unmeasured_point(self, salt: int) -> dict[str, Any] | None:
        """A point of the search space no trial has taken yet (``None`` when the space is exhausted)."""
        import itertools
        import math
        import random

        from optuna.trial import TrialState

        taken = set()
        for t in self.study.get_trials(deepcopy=False):
            if t.system_attrs.get(COPY_OF) is not None:
                continue
            params = t.params or (
                t.system_attrs.get("fixed_params") if t.state == TrialState.WAITING else None
            )
            if params:
                taken.add(_point_key(params))
        rng = random.Random(f"{self.s.seed}:{salt}")
        dims = self.plan.dims
        size = space_size(dims)
        if size <= 200_000:
            axes = [
                list(d.values) if d.discrete else list(range(int(d.low), int(d.high) + 1))  # type: ignore[arg-type]
                for d in dims
            ]
            free = [
                c
                for c in itertools.product(*axes)
                if _point_key(dict(zip([d.key for d in dims], c))) not in taken
            ]
            return dict(zip([d.key for d in dims], rng.choice(free))) if free else None
        for _ in range(1000):
            point: dict[str, Any] = {}
            for d in dims:
                if d.discrete:
                    point[d.key] = rng.choice(list(d.values))
                elif d.integer:
                    point[d.key] = rng.randint(int(d.low), int(d.high))  # type: ignore[arg-type]
                elif d.log:
                    point[d.key] = math.exp(rng.uniform(math.log(d.low), math.log(d.high)))  # type: ignore[arg-type]
                else:
                    point[d.key] = rng.uniform(d.low, d.high)  # type: ignore[arg-type]
            if _point_key(point) not in taken:
                return point
        return None

    def _tell(self, study: Any, trial: Any, result: dict[str, Any], outcome: Outcome) -> None:
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        rel = os.path.relpath(self.result_path(trial.number), self.s.sweep_dir)
        try:
            for k, v in user_attrs(result, outcome, rel).items():
                trial.set_user_attr(k, v)
            if outcome.constraint is not None:
                trial.set_constraint(CONSTRAINT_KEY, float(outcome.constraint))
                # optuna-dashboard 0.21 reads the pre-Optuna-5 list attribute `constraints` (feasible: all <= 0)
                trial.storage.set_trial_system_attr(
                    trial._trial_id, DASHBOARD_CONSTRAINTS_KEY, [float(outcome.constraint)]
                )
            if outcome.state == "COMPLETE":
                try:
                    study.tell(trial, list(outcome.values or []))
                    return
                except ValueError as exc:  # belt and braces: never crash on a bad value
                    trial.set_user_attr("objective_error", str(exc))
                    study.tell(trial, state=TrialState.FAIL)
                    return
            study.tell(trial, state=TrialState[outcome.state])
        except UpdateFinishedTrialError:
            self._say(
                f"vramsweep: trial {trial.number:04d} was already finished by another worker "
                "(judged stale); its result file is kept"
            )

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.say(text)
        else:
            print(text, file=sys.stderr)

    def _record(self, job: Job, report: RunReport) -> None:
        self._note_retries(job, report)
        status = str(report.result.get("status"))
        with self._tell_lock:
            self._tell(self.study, job.trial, report.result, report.outcome)
            if self.wandb_summary is not None:
                self.wandb_summary.poke()
            self._running.discard(job.trial._trial_id)
            self.finished += 1
            self.failures += int(report.outcome.failure)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            shown = list(job.label)
            if job.retry_of is not None:
                shown.append(f"(retry of {job.retry_of:04d})")
            if job.duplicate_of is not None:
                shown.append(f"(same point as {job.duplicate_of:04d}: not re-run)")
            if self.progress is not None:
                done, running, best = self._study_progress()
                self.progress.finished(
                    trial_line(job.number, report.result, report.wall_s, self.s.objectives, shown),
                    wall_s=report.wall_s if job.duplicate_of is None else None,
                    done=done,
                    running=running,
                    best=best,
                )
            if (
                self.finished >= self.s.min_trials_for_failure_rate
                and self.failures / self.finished > self.s.max_failure_rate
                and not self.abort.is_set()
            ):
                self.abort_reason = (
                    f"{self.failures}/{self.finished} trials failed (status error or no objective) "
                    f"> hydra.sweeper.max_failure_rate={self.s.max_failure_rate}"
                )
                self.abort.set()

    def _study_progress(self) -> tuple[int | None, int | None, str | None]:
        """``(done, running, best so far)`` counted from the study: right with several workers."""
        try:
            counts = trial_counts(self.study)
        except Exception:
            return None, None, None
        done = sum(v for k, v in counts.items() if k in ("COMPLETE", "PRUNED", "FAIL"))
        best = None
        with contextlib.suppress(Exception):
            front = self.study.best_trials
            if front and len(self.s.objectives) == 1:
                b = front[0]
                best = f"{self.s.objectives[0].metric} {b.values[0]:.4g} (trial {b.number:04d})"
            elif front:
                best = f"Pareto front of {len(front)} trial{'s' if len(front) != 1 else ''}"
        return min(done, self.plan.n_total), counts.get("RUNNING", 0), best

    def _show_running(self) -> None:
        if self.progress is not None and self.progress.live:
            done, running, best = self._study_progress()
            self.progress.update(done=done, running=running, best=best)

    def _requeue_interrupted(self, job: Job) -> None:
        """Ctrl-C: a stop, not a failure of the config. The trial is closed (reason ``interrupted``) and
        its point put back in its slot, within the same bound as a dead worker (``retry_stale``)."""
        with self._tell_lock, storage_lock(self.s.storage, self.s.study_name):
            frozen = self.storage.get_trial(job.trial._trial_id)
            will_retry = self._retry_lost(self.study, frozen, job.retries)
            spec = self._spec_for(
                job.number, job.trial._trial_id, job.slot, job.overrides, job.design, job.retry_of, 0
            )
            reason = "interrupted (Ctrl-C); " + self._retry_note(job.retries, will_retry)
            res = self._lost_result(spec, reason, job.retries, job.trial._trial_id)
            self._tell(self.study, job.trial, res, Outcome.from_dict(res["meta"]["optuna"]))
            self._running.discard(job.trial._trial_id)

    def worker(self, idx: int) -> None:
        """One worker slot: pop, run, tell, until no slot is left (or the sweep aborts)."""
        while not self.abort.is_set():
            job = self.next_job()
            if job is None:
                with storage_lock(self.s.storage, self.s.study_name):
                    reaped = self.reconcile()
                if reaped:
                    continue
                return
            if job.duplicate_of is not None:
                self._record_duplicate(job)
                continue
            spec = self._spec_for(
                job.number, job.trial._trial_id, job.slot, job.overrides, job.design, job.retry_of, idx
            )
            self._show_running()
            report = self.runner.run(spec, tick_s=1.0, timeout_s=self.s.timeout_s)
            if self.interrupted:
                self._requeue_interrupted(job)
                return
            self._record(job, report)

    def run_launcher(self) -> None:
        """``isolation=launcher``: batches of ``n_jobs`` trials through Hydra's launcher (submitit, ...).

        Each job gets ``VRAMSWEEP_TRIAL_SPEC`` (via ``hydra.job.env_set``) pointing at its spec JSON and
        runs it like a fork-server child: result JSON next to the study, pruning reports through the
        storage. This process keeps the trials' heartbeat while the launcher waits for them.
        """
        from vramsweep.sweeper.trialproc import SPEC_ENV, parent_side_result, report_from_json, save_spec

        launcher = self.launcher_factory()
        cfg = getattr(launcher, "config", None)
        if cfg is not None:  # the launcher makes its sweep dir: ours (not the unnamed default's)
            from omegaconf import open_dict

            with contextlib.suppress(Exception), open_dict(cfg):
                cfg.hydra.sweep.dir = str(self.s.sweep_dir)
        while not self.abort.is_set():
            batch: list[tuple[Job, TrialSpec]] = []
            for _ in range(max(1, self.s.n_jobs)):
                job = self.next_job()
                if job is None:
                    break
                if job.duplicate_of is not None:
                    self._record_duplicate(job)
                    continue
                spec = self._spec_for(
                    job.number, job.trial._trial_id, job.slot, job.overrides, job.design, job.retry_of, 0
                )
                spec.env, spec.parent_pid, spec.parent_ctime, spec.log_path = (
                    {},
                    0,
                    None,
                    None,
                )  # runs elsewhere
                batch.append((job, spec))
            if not batch:
                with storage_lock(self.s.storage, self.s.study_name):
                    if self.reconcile():
                        continue
                return
            job_overrides = []
            for job, spec in batch:
                path = str(self.s.sweep_dir / "jobs" / f"{job.number:04d}.spec.json")
                save_spec(spec, path)
                job_overrides.append(
                    [
                        *job.overrides,
                        f"++hydra.job.env_set.{SPEC_ENV}='{path}'",
                        f"hydra.sweep.dir='{self.s.sweep_dir}'",
                    ]
                )
            t0 = time.perf_counter()
            returns = launcher.launch(job_overrides, initial_job_idx=batch[0][0].number)
            wall = time.perf_counter() - t0
            for (job, spec), ret in zip(batch, list(returns) + [None] * (len(batch) - len(list(returns)))):
                data = _load_child_result(spec.result_path)
                if data is not None:
                    report = report_from_json(data, _wall(data, wall), None)
                else:
                    why = getattr(ret, "_return_value", None) if ret is not None else None
                    status = getattr(getattr(ret, "status", None), "name", "no return")
                    reason = f"launcher job ended without a result (job status {status}{f': {why}' if why else ''})"
                    report = report_from_json(parent_side_result(spec, reason[:1000], wall), wall, None)
                self._record(job, report)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.s.heartbeat_s):
            for tid in list(self._running):
                with contextlib.suppress(Exception):
                    self.storage.set_trial_system_attr(tid, HEARTBEAT, time.time())

    # ------------------------------------------------------------------ main
    @classmethod
    def finished(cls, plan: Plan, study: Any, **kw: Any) -> int:
        """A complete study: say so and print its summary (nothing is written, no trial process)."""
        sweep = cls(plan, **kw)
        sweep.study = study
        print(
            f"vramsweep: study '{plan.settings.study_name}' is complete ({plan.n_total}/{plan.n_total} "
            "finished): nothing to run",
            flush=True,
        )
        sweep.summary(0.0)
        return 0

    def _nothing_waiting(self) -> bool:
        from vramsweep.sweeper.storage import remaining_slots

        return remaining_slots(self.study, self.plan.n_total)[0] == 0

    def run(self) -> int:
        """Run to completion; returns the exit code (0 done, 1 aborted or interrupted)."""
        self.prepare()
        assert self.progress is not None
        if self._nothing_waiting() and self.s.isolation != "launcher":
            self._stop.set()  # no trial to start: no fork server (no torch import), just the summary
            self.summary(0.0)
            return 0
        if self.plan.wandb:
            from vramsweep.report.wandb_summary import SummaryUpdater

            self.wandb_summary = SummaryUpdater(self.s.sweep_dir, on_warning=self.progress.say)
        t0 = time.perf_counter()
        beat = threading.Thread(target=self._heartbeat, name="vramsweep-heartbeat", daemon=True)
        beat.start()
        started = False
        try:
            n_threads = max(1, self.s.n_jobs)
            self.progress.say(self.describe())
            if self.s.isolation == "launcher":
                self.run_launcher()
                self._stop.set()
                self.summary(time.perf_counter() - t0)
                return 1 if self.abort.is_set() else 0
            self.runner.start()
            started = True
            self.progress.start()
            # Completion is signalled with events, not Thread.join(): a KeyboardInterrupt that lands in
            # join() can leave CPython's thread state saying "finished" while the worker still runs.
            done = [threading.Event() for _ in range(n_threads)]

            def work(i: int) -> None:
                try:
                    self.worker(i)
                except BaseException as exc:  # a bug, not a trial failure: stop the sweep, say why
                    self.abort_reason = f"internal error in worker {i}: {type(exc).__name__}: {exc}"
                    self.abort.set()
                    raise
                finally:
                    done[i].set()

            for i in range(n_threads):
                threading.Thread(target=work, args=(i,), name=f"vramsweep-worker-{i}", daemon=True).start()
            try:
                while not all(e.is_set() for e in done):
                    time.sleep(0.2)
            except KeyboardInterrupt:
                self.interrupted = True
                self.abort.set()
                self.abort_reason = (
                    "interrupted (Ctrl-C); running trials re-enqueued: re-run the same command to resume"
                )
                self.runner.kill_all()
                while not all(e.is_set() for e in done):
                    time.sleep(0.2)
        finally:
            self._stop.set()
            self.progress.stop()
            if started:
                self.runner.stop()
            if self.wandb_summary is not None:
                self.wandb_summary.close()
        self.summary(time.perf_counter() - t0)
        return 1 if self.abort.is_set() else 0

    def describe(self) -> str:
        """One line: what runs and how (sampler, pruning, isolation, workers)."""
        s = self.s
        if s.pruning_active:
            pruning = f"pruner {s.pruner_name} on {s.objectives[0].metric}"
        elif s.pruner_name == "none":
            pruning = "no pruning"
        elif s.design != "search":
            pruning = "no pruning (fixed design: every point runs to the end)"
        else:
            pruning = "no pruning (needs a single objective eval_loss/eval_ppl; Optuna cannot prune multi-objective)"
        how = {
            "fork": _fork_how(s.preload),
            "spawn": "fresh interpreter",
            "inprocess": "in-process (debug)",
            "launcher": "Hydra launcher job",
        }.get(self.runner.name, self.runner.name)
        what = f"{s.design} design" if s.design != "search" else f"{s.sampler_name} sampler"
        if s.design_reason:
            what += f" ({s.design_reason})"
        objs = ", ".join(f"{o.direction} {o.metric}" for o in s.objectives)
        budget = f"; budget {s.budget_gib:g} GiB" if s.budget_gib else ""
        return (
            f"vramsweep: '{s.name}': {what}, {plural(self.plan.n_total, 'trial')}, {objs}{budget}; {pruning}; "
            f"{s.n_jobs} worker(s), each trial in a {how}"
        )

    def summary(self, wall_s: float) -> None:
        """Counts by status, the best feasible trial(s), where the results are."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        retried = {t.system_attrs.get(RETRY_OF) for t in trials} - {None}
        by_status: dict[str, int] = {}
        for t in trials:
            if (
                t.number in retried
                or t.system_attrs.get(COPY_OF) is not None
                or t.state in (TrialState.WAITING, TrialState.RUNNING)
            ):
                continue
            st = str(t.user_attrs.get("status", t.state.name.lower()))
            if st == "ok" and any(
                isinstance(v, int | float) and v > 0
                for k, v in t.system_attrs.items()
                if k.startswith("constraints") and not isinstance(v, list)
            ):
                st = "over budget"
            by_status[st] = by_status.get(st, 0) + 1
        lines = [
            f"vramsweep: sweep '{self.s.name}' - this run: {plural(self.finished, 'trial')} in {wall_s:.0f} s; "
            "study total: "
            + (", ".join(f"{v} {k}" for k, v in sorted(by_status.items())) or "no finished trials")
        ]
        try:
            best = self.study.best_trials
        except Exception:
            best = []
        if best:
            if len(self.s.objectives) == 1:
                b = best[0]
                lines.append(
                    f"vramsweep: best feasible: trial {b.number:04d} {self.s.objectives[0].metric}={b.values[0]:.6g} "
                    + " ".join(
                        fmt_override(o)
                        for o in b.user_attrs.get("overrides") or []
                        if o not in self.plan.fixed
                    )
                )
            else:
                lines.append(
                    f"vramsweep: Pareto front (feasible): trials {', '.join(f'{t.number:04d}' for t in best)}"
                )
        lost = [t.number for t in requeue_lost(self.study)]
        if lost:
            lines.append(
                f"vramsweep: {len(lost)} design point(s) lost for good (their worker died or was stopped "
                f"{self.s.retry_stale + 1} times: trial(s) {', '.join(f'{n:04d}' for n in lost)}): re-run with "
                f"hydra.sweeper.retry_stale={self.s.retry_stale + 1} to retry them"
            )
        if self.abort_reason:
            lines.append(f"vramsweep: ABORTED: {self.abort_reason}")
        lines.append(
            f"vramsweep: dashboard: optuna-dashboard {self.s.storage if '@' not in self.s.storage else '<storage URL>'}"
        )
        lines.append(f"results: {self.s.sweep_dir}")
        for line in lines:
            print(line, flush=True)


def run_sweep(
    sweeper_cfg: dict[str, Any],
    task_cfg: dict[str, Any],
    arguments: list[str],
    *,
    runner: Any = None,
    launcher_factory: Any = None,
) -> int:
    """Validate and run a sweep. Returns 0 (done), 1 (aborted: failure-rate cap or Ctrl-C), 2 (bad config)."""
    from optuna.exceptions import ExperimentalWarning

    warnings.filterwarnings("ignore", category=ExperimentalWarning)
    from vramsweep.config.errors import error_line
    from vramsweep.preflight import check_fault_env, check_named_options, preflight_sweep
    from vramsweep.sweeper.fastpath import finished_study

    if str((task_cfg.get("sweep") or {}).get("design")) == "max_context":
        from vramsweep.sweeper.maxctx import run_max_context

        try:
            check_fault_env()
            check_named_options(arguments)
        except ConfigError as exc:
            print(error_line("train", str(exc)), file=sys.stderr)
            return 2
        return run_max_context(sweeper_cfg, task_cfg, arguments, runner=runner)
    done = finished_study(sweeper_cfg, task_cfg, arguments)
    if done is not None:  # nothing to run: the summary, without composing every point or importing torch
        return Sweep.finished(*done, runner=runner, launcher_factory=launcher_factory)
    try:
        check_fault_env()
        check_named_options(arguments)  # sweep=<typo>: Hydra ignores an unknown option of an optional group
        plan = plan_sweep(sweeper_cfg, task_cfg, arguments)
        preflight_sweep(plan, task_cfg, arguments)  # before the study, any folder or any trial
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2
    try:
        return Sweep(plan, runner=runner, launcher_factory=launcher_factory).run()
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2


def _fork_how(preload: list[str]) -> str:
    """How the fork server starts trials on this host (CUDA hosts leave out CUDA-initialising modules)."""
    from vramsweep.sweeper.isolation import effective_preload

    modules, left_out = effective_preload(preload)
    text = f"fork server (preloads {', '.join(modules) or 'nothing'}"
    if left_out:
        text += f"; not {', '.join(left_out)}: they initialise CUDA on import"
    return text + ")"
