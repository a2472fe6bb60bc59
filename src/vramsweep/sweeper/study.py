"""A sweep's ask/tell ledger (:class:`StudyBook`): the folder and study, slots popped and filled (design
point or sampler), outcomes told, duplicates of measured points. Trials lost by dead workers, stops or lost
launcher jobs are its recovery's (:class:`~vramsweep.sweeper.recovery.LostTrials`, ``book.lost``). The
worker pool (:mod:`.workers`) asks it for jobs and tells it outcomes; the loop (:mod:`.engine`) opens it
and reads its study for the summary.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.production.fingerprint import changed_data, describe, trial_hashes
from vramsweep.record.result import atomic_write_json, write_result
from vramsweep.record.status import Status
from vramsweep.sweeper.design import design_choices
from vramsweep.sweeper.edge import start_at_the_edge
from vramsweep.sweeper.folder import check_evidence, check_owner, folder_lock, result_numbers, unmake
from vramsweep.sweeper.job import Job
from vramsweep.sweeper.launch import JOB
from vramsweep.sweeper.outcome import CONSTRAINT_KEY, DASHBOARD_CONSTRAINTS_KEY, Outcome, user_attrs
from vramsweep.sweeper.plan import DATA_ATTR, DATA_CHANGES_ATTR, IDENTITY, NOT_IDENTITY, Plan, identity_diff
from vramsweep.sweeper.recovery import LostTrials
from vramsweep.sweeper.samplers import make_pruner, make_sampler
from vramsweep.sweeper.space import (
    merge_overrides,
    override_key,
    params_to_overrides,
    suggest,
    unmeasured_point,
)
from vramsweep.sweeper.storage import (
    COPY_OF,
    FINGERPRINT,
    HEARTBEAT,
    OWNER,
    RETRIES,
    RETRY_OF,
    SLOT,
    load_or_create_study,
    make_storage,
    pop_slot,
    process_identity,
    remaining_slots,
    sqlite_path,
    storage_lock,
    top_up,
    trial_counts,
)
from vramsweep.sweeper.trialproc import RunReport, TrialSpec, _load_child_result

#: After this many re-proposed points in a row for one slot, the slot gets an unmeasured point at random.
DEDUP_PATIENCE = 3
DUP_STREAK = "vramsweep:dup_streak"
#: Statuses whose outcome is a property of the config (copied for a duplicate point, not re-run).
COPYABLE = tuple(s.value for s in Status if s is not Status.ERROR)


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


class StudyBook:
    """One sweeper process's ask/tell ledger of its study: opened once (:meth:`open`), then shared by the
    workers; ``lost`` is its lost-trial recovery (:class:`~vramsweep.sweeper.recovery.LostTrials`).

    ``say`` prints a line (the progress display's, once there is one); ``running`` holds the trial ids this
    process runs (never reaped as stale; stamped by the heartbeat)."""

    def __init__(self, plan: Plan, say: Callable[[str], None] | None = None):
        self.plan = plan
        self.trials_dir = self.plan.folder / "trials"
        self.identity = process_identity()
        self.choices = design_choices(plan.points) if plan.points is not None else {}
        self.study: Any = None
        self.admin: Any = None  # the same study with a neutral sampler: reaps and retries never sample
        self.storage: Any = None
        self.ask_lock = threading.Lock()
        self.tell_lock = threading.Lock()
        self.running: set[int] = set()
        self.edge: list[dict[str, Any]] = []  # sweep.edge_start's points, slot by slot (:mod:`.edge`)
        self._say = say
        self.lost = LostTrials(self)  # lost-trial recovery and the heartbeat, on this ledger

    def result_path(self, number: int) -> Path:
        return self.trials_dir / f"{number:04d}.json"

    def _slot_attrs(self, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.plan.points is None:  # a search: the edge start's points fill the first slots
            return ({"fixed_params": dict(self.edge[k])} if k < len(self.edge) else {}), {}
        point = self.plan.points[k]
        return {"fixed_params": dict(point.params)}, {"design": point.design}

    def stored_attrs(self) -> dict[str, Any] | None:
        """The study's user attributes, without creating storage or study (``None``: new)."""
        path = sqlite_path(self.plan.storage_url)
        if path is not None and not path.is_file():
            return None
        with storage_lock(self.plan.storage_url, self.plan.study_key):  # table creation races other workers
            try:
                storage = make_storage(self.plan.storage_url)
                study_id = storage.get_study_id_from_name(self.plan.study_key)
            except KeyError:
                return None
            return storage.get_study_user_attrs(study_id)

    def check_data(self) -> None:
        """A study resumed on data files whose sha256 changed since it started: a ConfigError (exit 2) naming
        the file and both hashes, unless ``train.resume_on_changed_data=true`` is among the fixed overrides
        (the change is then recorded in the study's ``vramsweep:data_changes``)."""
        attrs = self.stored_attrs()
        if not attrs:
            return  # a new study
        if DATA_ATTR in attrs:
            self.data_changes = changed_data(attrs[DATA_ATTR], self.plan.data_files)
        else:  # a study from before data hashes: its trials' results are the record (recorded now)
            self.data_changes = self._changes_since_old_trials()
        if not self.data_changes or "train.resume_on_changed_data=true" in self.plan.fixed:
            return
        raise ConfigError(
            f"sweep '{self.plan.name}': the data changed since the study started: "
            f"{describe(self.data_changes[0])}; the resumed trials would not be comparable with the finished "
            "ones. Restore the file, or give this sweep a new name (sweep.name=<new>), or add "
            "train.resume_on_changed_data=true to continue on the new data (recorded in the study)",
            key="train.resume_on_changed_data",
        )

    def _changes_since_old_trials(self) -> list[dict[str, Any]]:
        """A study started before vramsweep recorded data hashes: the files compared with the hashes its
        trials' result files recorded (``meta.data_sources`` or the older ``meta.data.source_sha256``).
        None recorded: one line says the data cannot be verified; the study records the hashes now."""
        now = self.plan.data_files
        seen: dict[str, set[str]] = {}
        for path in sorted(self.trials_dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                for key, h in trial_hashes(json.loads(path.read_text()).get("meta")).items():
                    seen.setdefault(key, set()).add(h)
        if not seen:
            if now:
                files = ", ".join(f"{k}={v['path']}" for k, v in now.items())
                print(
                    f"vramsweep: sweep '{self.plan.name}': its study was started before vramsweep recorded "
                    f"data hashes and no trial result names one: cannot verify that {files} is the data "
                    "its trials trained on; continuing, the study records the hash now (a later re-run "
                    "checks it)",
                    file=sys.stderr,
                )
            return []
        recorded = {}
        for key, hashes in seen.items():
            cur = (now.get(key) or {}).get("sha256")
            other = sorted(h for h in hashes if h != cur)
            recorded[key] = {"path": (now.get(key) or {}).get("path"), "sha256": other[0] if other else cur}
        return changed_data(recorded, {k: v for k, v in now.items() if k in recorded})

    def stored_identity(self) -> dict[str, Any] | None:
        """The identity stored with this sweep's study, without creating storage or study (``None``: new)."""

        attrs = self.stored_attrs()
        if attrs is None:
            return None
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
        where = self.plan.storage_url if "@" not in self.plan.storage_url else "<storage URL>"
        raise ConfigError(
            f"sweep '{self.plan.name}' (study '{self.plan.study_key}' in {where}) was started by a "
            f"different sweep: {identity_diff(old, self.plan.identity)}. A sweep resumes only with the same "
            "design, search space and fixed overrides: run the original command to resume it, or give this "
            "one its own name (sweep.name=<new> or hydra.sweeper.study_name=<new>), or delete "
            f"{self.plan.folder}",
            key="sweep.name",
        )

    def open(self) -> int:
        """Create the folder, ``sweep.json`` and the study; reconcile stale trials; top up the slots.
        Returns how many trials of the study are finished already (a resumed sweep)."""
        import optuna

        s = self.plan
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        # the folder's owner and the study's identity checked, sweep.json written and the study made under
        # one lock on the folder: two sweeps started together cannot both pass (folder.py)
        with folder_lock(s.folder) as made:
            try:
                self.check_folder()
            except ConfigError:
                unmake(made)  # nothing written: the folders this call made go again
                raise
            return self._open_locked()

    def check_folder(self) -> None:
        """Whose folder, which sweep, and no result the study does not know: a ConfigError (exit 2) before
        anything is written. Call under :func:`folder_lock`."""
        check_owner(self.plan)
        on_disk = result_numbers(self.trials_dir)  # listed before the study is read (folder.py)
        self.check_identity()  # a different sweep under this name
        self.check_data()  # the data files' sha256 as the study started
        if on_disk:
            check_evidence(self.plan, on_disk, self.known_numbers())

    def known_numbers(self) -> set[int] | None:
        """Numbers of the study's trials that ran or run (not WAITING); ``None``: no such study."""
        from optuna.trial import TrialState

        path = sqlite_path(self.plan.storage_url)
        if path is not None and not path.is_file():
            return None
        with storage_lock(self.plan.storage_url, self.plan.study_key):
            try:
                storage = make_storage(self.plan.storage_url)
                study_id = storage.get_study_id_from_name(self.plan.study_key)
            except KeyError:
                return None
            trials = storage.get_all_trials(study_id, deepcopy=False)
        return {t.number for t in trials if t.state != TrialState.WAITING}

    def _open_locked(self) -> int:
        """:meth:`open` once the folder is locked and checked: write, create or load, reconcile, top up."""
        import optuna

        s = self.plan
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            s.folder / "sweep.json",
            s.public_dict()
            | {
                "fixed_overrides": self.plan.fixed,
                "n_total": self.plan.n_total,
                "design_points": len(self.plan.points) if self.plan.points is not None else None,
                "sweep_id": self.plan.sweep_id,
                "identity": self.plan.identity,
                # worker slots and GPU seats of the run that wrote this file (gpus.Layout)
                "workers": s.layout.public() if s.layout is not None else None,
            },
        )
        if self.plan.points is None:
            sampler = make_sampler(s.sampler_spec, seed=s.seed, n_jobs=s.n_workers, n_objectives=len(s.goals))
        else:
            sampler = optuna.samplers.RandomSampler(seed=s.seed)  # every param is fixed per point
        self.study = load_or_create_study(s, sampler, make_pruner(s.pruner_spec, active=s.pruning_active))
        self.storage = self.study._storage
        self.admin = optuna.load_study(
            study_name=s.study_key,
            storage=self.storage,
            sampler=optuna.samplers.RandomSampler(),
            pruner=optuna.pruners.NopPruner(),
        )
        with storage_lock(s.storage_url, s.study_key):
            attrs = self.study.user_attrs
            if DATA_ATTR not in attrs or getattr(self, "data_changes", None):
                self.study.set_user_attr(DATA_ATTR, self.plan.data_files)
                if getattr(self, "data_changes", None):  # train.resume_on_changed_data=true: recorded
                    log = list(attrs.get(DATA_CHANGES_ATTR) or [])
                    self.study.set_user_attr(DATA_CHANGES_ATTR, log + self.data_changes)
            if IDENTITY not in self.study.user_attrs:
                self.study.set_user_attr(IDENTITY, self.plan.identity)
                self.study.set_user_attr("vramsweep:sweep_id", self.plan.sweep_id)
                self.study.set_user_attr(
                    "sweep",
                    {"name": s.name, "design": s.design, "objectives": [o.metric for o in s.goals]},
                )
            self.lost.reconcile()
            self.lost.stop_lost_jobs()  # every job the study recorded for a lost point, before it is retried
            self.lost.requeue_lost_slots()
            self.edge = start_at_the_edge(self)  # edge screen/start: a new study only (then read back)
            added = top_up(self.study, self.plan.n_total, self._slot_attrs)
        counts = trial_counts(self.study)
        done = sum(v for k, v in counts.items() if k in ("COMPLETE", "PRUNED", "FAIL"))
        if done or added < self.plan.n_total:
            self.say(
                f"vramsweep: resuming study '{s.study_key}': {done}/{self.plan.n_total} finished, "
                f"{counts.get('WAITING', 0)} to run, {counts.get('RUNNING', 0)} running elsewhere"
            )
        return done

    def waiting(self) -> int:
        """Slots of the study waiting for a trial."""
        return remaining_slots(self.study, self.plan.n_total)[0]

    def progress_counts(self) -> tuple[int | None, int | None, str | None]:
        """``(done, running, best so far)`` counted from the study: right with several workers."""
        try:
            counts = trial_counts(self.study)
        # broad on purpose: a progress line must not stop a worker; a storage hiccup shows no counts
        except Exception:
            return None, None, None
        done = sum(v for k, v in counts.items() if k in ("COMPLETE", "PRUNED", "FAIL"))
        best = None
        objectives = self.plan.goals
        # broad on purpose: no feasible trial or no front yet: no best in the progress line
        with contextlib.suppress(Exception):
            front = self.study.best_trials
            if front and len(objectives) == 1:
                b = front[0]
                best = f"{objectives[0].metric} {b.values[0]:.4g} (trial {b.number:04d})"
            elif front:
                best = f"Pareto front of {len(front)} trial{'s' if len(front) != 1 else ''}"
        return min(done, self.plan.n_total), counts.get("RUNNING", 0), best

    def leave_running(self, job: Job) -> None:
        """Stop stamping ``job``'s trial without closing it: it stays RUNNING in the study (its launcher job
        may still run), and the next run reconciles it (:meth:`_reap` stops the job first)."""
        self.running.discard(job.trial._trial_id)

    @contextlib.contextmanager
    def recording(self, job: Job, report: RunReport) -> Iterator[None]:
        """Tell ``job``'s outcome and stop stamping its trial; the block runs under the tell lock too (one
        worker counts and prints a finished trial at a time)."""
        with self.tell_lock:
            self.tell(self.study, job.trial, report.result, report.outcome)
            self.running.discard(job.trial._trial_id)
            yield

    def record_job(self, spec: TrialSpec, record: dict[str, Any]) -> None:
        """Keep a trial's launcher job in the study (a re-run stops it before retrying: :mod:`.orphans`)."""
        self.storage.set_trial_system_attr(spec.trial_id, JOB, record)

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

    def _claim(self, trial_id: int) -> None:
        """Stamp this process as the owner of ``trial_id`` (before :func:`pop_slot` makes it RUNNING)."""
        self.storage.set_trial_system_attr(trial_id, OWNER, self.identity)
        self.storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())

    def next_job(self) -> Job | None:
        """Pop a slot and fill in its config; ``None`` when no slot is waiting."""
        import optuna

        with self.ask_lock:
            with storage_lock(self.plan.storage_url, self.plan.study_key):
                trial_id = pop_slot(self.study, self.plan.n_total, claim=self._claim)
            if trial_id is None:
                return None
            self.running.add(trial_id)
            self.storage.set_trial_system_attr(trial_id, OWNER, self.identity)
            self.storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())
            trial = optuna.Trial(self.study, trial_id)
            frozen = self.storage.get_trial(trial_id)
            slot = int(frozen.system_attrs[SLOT])
            retry_of = frozen.system_attrs.get(RETRY_OF)
            retries = int(frozen.system_attrs.get(RETRIES, 0))
            if self.plan.points is not None:
                point = self.plan.points[slot]
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
            if self.plan.points is None and self.plan.dedup and retry_of is None:
                dup = self._find_duplicate(trial.params, trial.number)
                if dup is not None:
                    job.duplicate_of, job.source = dup
            return job

    def _copy_duplicate(self, job: Job) -> RunReport:
        res = copy.deepcopy(job.source or {})
        res["trial"] = job.number
        meta = res.setdefault("meta", {})
        meta["duplicate_of"] = job.duplicate_of
        meta["wall_s"] = 0.0
        meta["design"] = job.design
        meta["optuna"] = dict(meta.get("optuna") or {}) | {"trial_number": job.number}
        write_result(self.result_path(job.number), res)
        return RunReport(res, Outcome.from_dict(meta["optuna"]), 0.0, None)

    def record_duplicate(self, job: Job) -> None:
        """A re-proposed point: tell the sampler the earlier outcome (so it learns), but do not count it:
        the slot gets a fresh trial (an unmeasured point at random after DEDUP_PATIENCE copies in a row)."""
        from optuna.trial import TrialState, create_trial

        report = self._copy_duplicate(job)
        with self.tell_lock:
            self.storage.set_trial_system_attr(job.trial._trial_id, COPY_OF, job.duplicate_of)
            job.trial.set_user_attr("duplicate_of", job.duplicate_of)
            self.tell(self.study, job.trial, report.result, report.outcome)
            self.running.discard(job.trial._trial_id)
        streak = job.dup_streak + 1
        attrs: dict[str, Any] = {SLOT: job.slot, DUP_STREAK: streak}
        note = "re-sampled"
        with storage_lock(self.plan.storage_url, self.plan.study_key):
            if streak >= DEDUP_PATIENCE:
                point = self._unmeasured_point(job.number)
                if point is None:
                    self.say(
                        f"vramsweep: trial {job.number:04d} repeats trial {job.duplicate_of:04d} "
                        "and every point of the search space is measured: slot left empty"
                    )
                    return
                attrs["fixed_params"] = point
                note = "given an unmeasured point at random"
            self.study.add_trial(create_trial(state=TrialState.WAITING, system_attrs=attrs))
        self.say(
            f"vramsweep: trial {job.number:04d} = trial {job.duplicate_of:04d} (re-proposed point: "
            f"outcome copied, not counted); slot {job.slot} {note}"
        )

    def _unmeasured_point(self, salt: int) -> dict[str, Any] | None:
        """A point of the search space no trial has taken yet, drawn by :func:`.space.unmeasured_point`
        (``None`` when the space is exhausted). Copies of a measured point do not count as taking one."""
        from optuna.trial import TrialState

        taken = []
        for t in self.study.get_trials(deepcopy=False):
            if t.system_attrs.get(COPY_OF) is not None:
                continue
            params = t.params or (
                t.system_attrs.get("fixed_params") if t.state == TrialState.WAITING else None
            )
            if params:
                taken.append(params)
        return unmeasured_point(self.plan.dims, taken, f"{self.plan.seed}:{salt}")

    def tell(self, study: Any, trial: Any, result: dict[str, Any], outcome: Outcome) -> None:
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        rel = os.path.relpath(self.result_path(trial.number), self.plan.folder)
        try:
            for k, v in user_attrs(result, outcome, rel).items():
                trial.set_user_attr(k, v)
            if outcome.constraint is not None:
                trial.set_constraint(CONSTRAINT_KEY, float(outcome.constraint))
                # optuna-dashboard 0.21 reads the pre-Optuna-5 list attribute `constraints`
                # (feasible: all <= 0)
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
            self.say(
                f"vramsweep: trial {trial.number:04d} was already finished by another worker "
                "(judged stale); its result file is kept"
            )

    def say(self, text: str) -> None:
        if self._say is not None:
            self._say(text)
        else:
            print(text, file=sys.stderr)
