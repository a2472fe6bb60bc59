"""Lost-trial recovery (:class:`LostTrials`): trials whose worker died (stale heartbeat), that a stop left
unstarted or interrupted (Ctrl-C, SIGTERM), or whose launcher job was lost are closed and their points put
back in their slots, within ``hydra.sweeper.retry_stale``; launcher jobs that outlived their sweeper are
stopped first, so no point runs twice; the heartbeat stamps this process's running trials. It works on the
ask/tell ledger (:class:`~vramsweep.sweeper.study.StudyBook`), which owns the study and tells outcomes.
Each entry point has one job: :meth:`LostTrials.reconcile` / :meth:`~LostTrials.reap_stale` (stale
trials), :meth:`~LostTrials.requeue` (stopped before the end), :meth:`~LostTrials.close_lost_job` (a lost
launcher job), :meth:`~LostTrials.requeue_lost_slots` (a new run's retries),
:meth:`~LostTrials.stop_lost_jobs`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.record.result import write_result
from vramsweep.sweeper.job import Job
from vramsweep.sweeper.launch import JOB
from vramsweep.sweeper.orphans import pending_first, stop_orphan
from vramsweep.sweeper.outcome import Outcome
from vramsweep.sweeper.storage import (
    HEARTBEAT,
    JOB_LOST,
    JOB_STOPPED,
    LOST,
    OWNER,
    RETRIES,
    RETRY_OF,
    SLOT,
    is_stale,
    requeue_lost,
    storage_lock,
)
from vramsweep.sweeper.trialproc import RunReport, TrialSpec, _load_child_result, parent_side_result


class LostTrials:
    """Lost-trial recovery of one sweeper process, on its ledger ``book`` (the study, the trials it runs,
    the tell): see the module's docstring."""

    def __init__(self, book: Any):
        self.book = book
        self.plan = book.plan
        self._stamp_failing = False  # the last heartbeat stamp failed (said once)

    def reconcile(self) -> int:
        """Fail (and retry once) or tell-from-JSON every stale RUNNING trial. Call under the lock."""
        from optuna.trial import TrialState

        reaped = 0
        now = time.time()
        stale = [
            t
            for t in self.book.admin.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t._trial_id not in self.book.running and is_stale(t, self.plan.grace_s, now)
        ]
        # their launcher jobs stopped PENDING first (:func:`pending_first`): a stopped RUNNING job frees its
        # node, where the scheduler could start a PENDING one before it is stopped
        for t in sorted(stale, key=lambda t: pending_first(t.system_attrs.get(JOB))):
            reaped += int(self._reap(t, now))
        return reaped

    def reap_stale(self) -> int:
        """:meth:`reconcile` under the storage lock; how many stale trials it closed."""
        with storage_lock(self.plan.storage_url, self.plan.study_key):
            return self.reconcile()

    def stamp_running(self) -> None:
        """Stamp the heartbeat of every trial this process runs. A failed stamp waits for the next beat, but
        a stamp that fails is said once (and once more when stamps work again): while it fails, another
        host judges these trials stale after ``grace_s`` and reaps them while they run."""
        failed = None
        for tid in list(self.book.running):
            try:
                self.book.storage.set_trial_system_attr(tid, HEARTBEAT, time.time())
            # broad on purpose: any storage error (sqlalchemy, optuna, OS) waits for the next beat; said once
            except Exception as exc:
                failed = f"{type(exc).__name__}: {str(exc)[:200]}"
        if failed is not None and not self._stamp_failing:
            self.book.say(
                f"vramsweep: the heartbeat of the running trials cannot be stamped ({failed}): retried "
                f"every {self.plan.heartbeat_s:g} s; while it fails, another worker of this study judges "
                f"them stale after hydra.sweeper.grace_s={self.plan.grace_s:g} s and re-runs their points"
            )
        elif failed is None and self._stamp_failing:
            self.book.say("vramsweep: the heartbeat of the running trials is stamped again")
        self._stamp_failing = failed is not None

    def stop_lost_jobs(self) -> None:
        """Stop the launcher jobs of closed trials whose job was lost or cancelled (Ctrl-C, SIGTERM, a
        controller that did not answer): a job still PENDING or RUNNING would run its point a second time
        beside the retry. Each is asked once (then marked); one that cannot be stopped (the controller is
        down) is a ConfigError: nothing runs until it can be. Call under the storage lock."""
        from optuna.trial import TrialState

        stuck = []
        stopped = set(self.book.study.user_attrs.get(JOB_STOPPED) or [])  # a finished trial takes no attrs
        lost = [
            (t, t.system_attrs.get(JOB))
            for t in self.book.admin.get_trials(deepcopy=False, states=(TrialState.FAIL,))
            if t.system_attrs.get(JOB) is not None
            and t.system_attrs.get(JOB_LOST)
            and t.number not in stopped
        ]
        for t, rec in sorted(lost, key=lambda pair: pending_first(pair[1])):  # the PENDING ones first
            running, why = stop_orphan(rec)
            if why is not None:
                stuck.append(f"trial {t.number:04d}'s job {rec.get('id')} ({why})")
                continue
            stopped.add(t.number)
            self.book.study.set_user_attr(JOB_STOPPED, sorted(stopped))
            if running:
                self.book.say(
                    f"vramsweep: trial {t.number:04d}'s launcher job {rec.get('id')} was still queued or "
                    "running: stopped before its point is retried"
                )
        if stuck:
            raise ConfigError(
                f"the launcher jobs of {len(stuck)} lost trial(s) could not be stopped: "
                f"{'; '.join(stuck[:3])}; retrying their points now would run them twice. Nothing was run: "
                "re-run the same command "
                "when the controller answers (or cancel the jobs by hand)",
                key="hydra/launcher",
            )

    def _adopt_job(self, t: Any) -> bool:
        """A stale trial's launcher job that may still run is stopped (and waited for) before the trial is
        reaped, so its point never runs twice; ``False`` when it could not be stopped (the trial stays)."""
        rec = t.system_attrs.get(JOB)
        if rec is None:
            return True
        running, why = stop_orphan(rec)
        what = f"trial {t.number:04d}'s launcher job {rec.get('id')} ({rec.get('kind')})"
        if why is not None:
            self.book.say(
                f"vramsweep: {what} outlived its sweeper and could not be stopped ({why}): the trial stays "
                "running, its point is not retried; re-run the same command once the job is gone"
            )
            return False
        if running:
            self.book.say(f"vramsweep: {what} outlived its sweeper: stopped before its point is retried")
        return True

    def _reap(self, t: Any, now: float) -> bool:
        """Close a stale trial (told from its result file, or failed and retried); ``False``: left RUNNING
        (its launcher job could not be stopped)."""
        import optuna

        if not self._adopt_job(t):
            return False
        trial = optuna.Trial(self.book.admin, t._trial_id)
        data = _load_child_result(str(self.book.result_path(t.number)))
        for tmp in self.book.trials_dir.glob(f".{t.number:04d}.json.*.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()
        if data is not None and (data.get("meta") or {}).get("lost_job"):
            data = None  # the interrupted sweeper's own placeholder (its job was not stopped): not a result
        if data is not None:
            outcome = Outcome.from_dict(data["meta"]["optuna"])
            self.book.tell(self.book.admin, trial, data, outcome)
            self.book.say(
                f"vramsweep: trial {t.number:04d} finished while its worker died: told from its result file"
            )
            return True
        slot = t.system_attrs.get(SLOT)
        retries = int(t.system_attrs.get(RETRIES, 0))
        owner = t.system_attrs.get(OWNER) or {}
        beat = t.system_attrs.get(HEARTBEAT)
        age = f"{now - float(beat):.0f} s ago" if beat else "never"
        job = Job(
            trial,
            t.number,
            int(slot) if slot is not None else -1,
            list(t.user_attrs.get("overrides") or []),
            [],
            dict(t.user_attrs.get("design") or {}),
            t.system_attrs.get(RETRY_OF),
            retries=retries,
        )
        will_retry = self._close_stale(
            job,
            f"stale: the worker running this trial died (host {owner.get('host', '?')} pid "
            f"{owner.get('pid', '?')}, last heartbeat {age})",
        )
        self.book.say(
            f"vramsweep: trial {t.number:04d} was left RUNNING by a dead worker: failed"
            + (
                f" and re-enqueued (retry {retries + 1}/{self.plan.retry_stale})"
                if will_retry
                else "; not retried again"
            )
        )
        return True

    def retry_lost(self, study: Any, t: Any, retries: int, *, force: bool = False) -> bool:
        """Re-enqueue a lost trial's point into its slot when it has retries left (``force``: the caller
        decided, a lost launcher job); whether it did."""
        from optuna.trial import TrialState, create_trial

        slot = t.system_attrs.get(SLOT)
        if slot is None or (not force and retries >= self.plan.retry_stale):
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

    def retry_note(self, retries: int, will_retry: bool) -> str:
        n = self.plan.retry_stale
        if will_retry:
            return f"its config is retried ({retries + 1}/{n})"
        return (
            f"not retried again: lost {retries + 1} time(s), hydra.sweeper.retry_stale={n}; "
            "re-run with a higher hydra.sweeper.retry_stale to retry it"
        )

    def requeue(self, job: Job, why: str) -> bool:
        """A trial stopped before its end (not started as the sweep stopped, Ctrl-C or SIGTERM): closed with
        reason ``why`` and its point put back in its slot within ``retry_stale``; whether it was. Takes the
        tell and storage locks."""
        with self.book.tell_lock, storage_lock(self.plan.storage_url, self.plan.study_key):
            again = self._retry_within_bound(job)
            self._close(job, f"{why}; {self.retry_note(job.retries, again)}")
        return again

    def close_lost_job(self, job: Job, report: RunReport, reason: str, *, job_lost: str, retry: bool) -> None:
        """A trial whose launcher job was lost (``job_lost``: its fate): its point retried when ``retry``
        (the pool's bound for this run), the runner's ``report`` recorded with ``reason``. Takes the tell and
        storage locks."""
        with self.book.tell_lock, storage_lock(self.plan.storage_url, self.plan.study_key):
            if retry:
                frozen = self.book.storage.get_trial(job.trial._trial_id)
                self.retry_lost(job.trial.study, frozen, job.retries, force=True)
            self._close(job, reason, report=report, job_lost=job_lost)

    def _close_stale(self, job: Job, why: str) -> bool:
        """A stale trial (its worker died): closed with reason ``why``, its point retried within
        ``retry_stale``; whether it was. The caller holds the storage lock (a reap)."""
        again = self._retry_within_bound(job)
        self._close(job, f"{why}; {self.retry_note(job.retries, again)}")
        return again

    def _retry_within_bound(self, job: Job) -> bool:
        """Re-enqueue ``job``'s point when ``retry_stale`` allows; whether it did."""
        frozen = self.book.storage.get_trial(job.trial._trial_id)
        return self.retry_lost(job.trial.study, frozen, job.retries)

    def _close(
        self, job: Job, reason: str, *, report: RunReport | None = None, job_lost: str | None = None
    ) -> None:
        """Mark ``job``'s trial lost (``job_lost``: its launcher job's fate), write its result JSON with
        ``reason``, ``meta.retries`` (earlier losses of its point) and ``meta.lost`` (the runner's ``report``
        when there is one, else an ``error`` result written here), tell it to the study it belongs to and
        stop counting it as running. The caller holds the storage lock."""
        tid = job.trial._trial_id
        self.book.storage.set_trial_system_attr(tid, LOST, True)
        if job_lost is not None:
            self.book.storage.set_trial_system_attr(tid, JOB_LOST, job_lost)
        if report is None:
            spec = TrialSpec.for_job(job, self.plan, parent_ctime=self.book.identity.get("ctime"))
            res = parent_side_result(spec, reason, 0.0)
            outcome = Outcome.from_dict(res["meta"]["optuna"])
        else:
            res, outcome = report.result, report.outcome
            res["reason"] = reason
        res["meta"]["retries"] = job.retries
        res["meta"]["lost"] = True
        write_result(self.book.result_path(job.number), res)
        self.book.tell(job.trial.study, job.trial, res, outcome)
        self.book.running.discard(tid)

    def requeue_lost_slots(self) -> int:
        """Slots whose last trial was lost (and not retried: the bound was reached) get a retry when
        ``retry_stale`` now allows one. Call under the lock."""
        n = 0
        for t in requeue_lost(self.book.admin):
            retries = int(t.system_attrs.get(RETRIES, 0))
            if t.system_attrs.get(JOB_LOST):  # its launcher job was lost: a new run retries it again
                self.retry_lost(self.book.admin, t, retries, force=True)
                n += 1
                self.book.say(
                    f"vramsweep: trial {t.number:04d}'s launcher job was lost "
                    f"({t.system_attrs[JOB_LOST]}): retried"
                )
                continue
            if self.retry_lost(self.book.admin, t, retries):
                n += 1
                self.book.say(
                    f"vramsweep: trial {t.number:04d}'s point was lost {retries + 1} time(s): "
                    f"retried again (hydra.sweeper.retry_stale={self.plan.retry_stale})"
                )
        return n

    def note_retries(self, job: Job, report: RunReport) -> None:
        """Record in a retried point's result JSON how many earlier trials of it were lost."""
        if not job.retries or job.duplicate_of is not None:
            return

        report.result.setdefault("meta", {})["retries"] = job.retries
        path = self.book.result_path(job.number)
        if path.exists():
            write_result(path, report.result)
