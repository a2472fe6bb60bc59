"""A sweep's worker threads: each pops a slot, runs its trial through the runner (:mod:`.isolation`) and
records the outcome; a heartbeat thread stamps the running trials. Mixed into
:class:`vramsweep.sweeper.engine.Sweep` (uses its attributes).
"""

from __future__ import annotations

import contextlib
import time

from vramsweep.record.diskfull import NO_SPACE
from vramsweep.sweeper.outcome import Outcome
from vramsweep.sweeper.progress import trial_line
from vramsweep.sweeper.storage import HEARTBEAT, JOB_LOST, LOST, storage_lock, trial_counts
from vramsweep.sweeper.study import Job
from vramsweep.sweeper.trialproc import RunReport


class WorkerMixin:
    """The worker side of :class:`~vramsweep.sweeper.engine.Sweep`."""

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
            if str(report.result.get("reason") or "").startswith(NO_SPACE) and not self.abort.is_set():
                # a full disk: every later trial would train and then fail to record its result
                self.abort_reason = (
                    f"{report.result['reason']} (trial {job.number:04d}): the sweep stops, later trials "
                    "could not be recorded either"
                )
                self.abort.set()
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
            lost = (report.result.get("meta") or {}).get("lost_job")
            if lost:
                self._record_lost_job(job, report, lost)
                continue
            self._record(job, report)

    def _record_lost_job(self, job: Job, report: RunReport, lost: dict) -> None:
        """A launcher job lost to the infrastructure (cancelled, preempted, node lost, never submitted): not
        a trial outcome. The trial is closed (marked lost) and its point re-enqueued into its slot, up to
        ``retry_stale`` times in this run; a later run of the same command retries it again. A job that
        could not be submitted, with no retry left, stops the sweep (the launcher is down: say so)."""
        from vramsweep.record.result import write_result

        tid = job.trial._trial_id
        n = self._job_losses.get(job.slot, 0)
        will_retry = n < self.s.retry_stale and not self.abort.is_set()
        with self._tell_lock, storage_lock(self.s.storage, self.s.study_name):
            frozen = self.storage.get_trial(tid)
            if will_retry:
                self._retry_lost(self.study, frozen, job.retries, force=True)
                self._job_losses[job.slot] = n + 1
            self.storage.set_trial_system_attr(tid, LOST, True)
            self.storage.set_trial_system_attr(tid, JOB_LOST, str(lost.get("kind") or "gone"))
            note = (
                f"retried ({n + 1}/{self.s.retry_stale} in this run)"
                if will_retry
                else f"not retried again in this run (hydra.sweeper.retry_stale={self.s.retry_stale}): "
                "re-run the same command to retry it"
            )
            res = report.result
            res["reason"] = f"{res.get('reason')}; lost infrastructure, not a result: {note}"[:2000]
            res["meta"]["retries"] = job.retries
            res["meta"]["lost"] = True
            write_result(self.result_path(job.number), res)
            self._tell(self.study, job.trial, res, report.outcome)
            self._running.discard(tid)
        self._say(f"vramsweep: trial {job.number:04d} {' '.join(job.label)}: {res['reason']}")
        if lost.get("kind") == "submit":
            if not will_retry and not self.abort.is_set():
                self.abort_reason = (
                    f"the launcher could not submit jobs ({str(res.get('reason'))[:300]}); "
                    "nothing was lost: re-run the same command when the cluster is back"
                )
                self.abort.set()
            else:
                self.abort.wait(min(2.0**n, 10.0))  # a controller restarting: back off before the retry

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.s.heartbeat_s):
            for tid in list(self._running):
                with contextlib.suppress(Exception):
                    self.storage.set_trial_system_attr(tid, HEARTBEAT, time.time())
