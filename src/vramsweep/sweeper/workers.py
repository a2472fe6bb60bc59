"""A sweep's worker pool (:class:`WorkerPool`): each worker thread pops a job from the study book
(:mod:`.study`), runs its trial through the runner (:mod:`.isolation`, :mod:`.launch`) and records the
outcome; a heartbeat thread stamps the running trials. What the workers learn together (counts, the abort
flag and its reason) is a :class:`RunState` the loop (:mod:`.engine`) reads for its summary.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramsweep.config.compose import compose, hydra_state
from vramsweep.estimate import estimate
from vramsweep.record.diskfull import NO_SPACE
from vramsweep.record.result import write_result
from vramsweep.sweeper import gpus
from vramsweep.sweeper.gpus import GpuSeats, needs_gpu_alone, needs_probe
from vramsweep.sweeper.job import Job
from vramsweep.sweeper.progress import Progress, trial_line
from vramsweep.sweeper.space import merge_overrides
from vramsweep.sweeper.storage import SLOT
from vramsweep.sweeper.study import StudyBook
from vramsweep.sweeper.trialproc import RunReport, TrialSpec, provisional_share


@dataclass
class RunState:
    """What this run of the sweeper has done so far (shared by the workers; read by the summary)."""

    finished: int = 0  # trials finished by this process
    failures: int = 0  # of those, failures (status error or no objective)
    statuses: dict[str, int] = field(default_factory=dict)
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: str | None = None
    interrupted: bool = False  # Ctrl-C or SIGTERM
    signal: str = "Ctrl-C"  # which of the two

    def stop(self, reason: str) -> None:
        """Abort the sweep with ``reason`` (the first reason wins)."""
        if not self.abort.is_set():
            self.abort_reason = reason
            self.abort.set()


class WorkerPool:
    """The workers of one sweeper process: ``run_worker(i)`` in each of ``n_jobs`` threads."""

    def __init__(
        self,
        book: StudyBook,
        runner: Any,
        state: RunState,
        progress: Progress,
        wandb_summary: Any = None,
        seats: GpuSeats | None = None,
    ):
        self.book = book
        self.plan = book.plan
        self.runner = runner
        self.state = state
        self.progress = progress
        self.wandb_summary = wandb_summary  # report.wandb_summary.SummaryUpdater when trials log to W&B
        self._job_losses: dict[int, int] = {}  # slot -> launcher jobs lost in this run (retry_stale bound)
        self.seats = seats  # the GPUs' seats (None: CPU, or a launcher's nodes)
        self._alone: dict[tuple[str, ...], str | None] = {}  # overrides -> why the trial runs alone

    def run_worker(self, idx: int) -> None:
        """One worker slot: pop, run, tell, until no slot is left (or the sweep aborts)."""
        book, state = self.book, self.state
        while not state.abort.is_set():
            job = book.next_job()
            if job is None:
                if book.lost.reap_stale():
                    continue
                return
            if job.duplicate_of is not None:
                book.record_duplicate(job)
                continue
            gpu = self._take_gpu(job)
            if gpu is False:  # the sweep stopped while the trial waited for a GPU
                self._requeue_unstarted(job)
                return
            spec = TrialSpec.for_job(
                job, self.plan, worker=idx, parent_ctime=book.identity.get("ctime"), gpu=gpu or None
            )
            self._show_running()
            report = self._run_on(spec, gpu or None)
            if state.interrupted:
                left_running = getattr(self.runner, "left_running", None)
                if left_running is not None and left_running(job.number):
                    # its job may still run: the trial stays RUNNING, a re-run stops the job first
                    book.leave_running(job)
                else:
                    self._requeue_interrupted(job)
                return
            lost = (report.result.get("meta") or {}).get("lost_job")
            if lost:
                self._record_lost_job(job, report, lost)
                continue
            self._record(job, report)

    def _take_gpu(self, job: Job) -> dict[str, Any] | bool | None:
        """A seat for ``job`` (``{"device", "per_gpu", "alone"}``), ``None`` without GPUs, ``False`` when the
        sweep stopped while it waited. A trial that must run alone (:func:`.gpus.needs_gpu_alone`) waits
        for an empty GPU."""
        if self.seats is None:
            return None
        alone = self.alone_reason(job) if self.seats.per_gpu > 1 else "one trial per GPU"
        device = self.seats.take(job.number, alone is not None and self.seats.per_gpu > 1, self.state.abort)
        if device is None:
            return False
        return {"device": device, "per_gpu": self.seats.per_gpu, "alone": alone}

    def alone_reason(self, job: Job) -> str | None:
        """Why ``job`` must have its GPU alone (``None``: it may share): from its memory estimate, composed
        here (torch-free) once per point."""
        return self._alone_for(job.overrides)

    def _alone_for(self, overrides: list[str]) -> str | None:
        key = tuple(overrides)
        if key not in self._alone:
            self._alone[key] = _alone_reason(list(overrides), self.plan.share_below)
        return self._alone[key]

    def prime(self) -> None:
        """Estimate a fixed design's first wave (the ``n_jobs`` lowest waiting slots) before the workers
        start, so its trials start together instead of one compose apart."""
        if self.seats is None or self.seats.per_gpu <= 1 or self.plan.points is None:
            return
        from optuna.trial import TrialState

        waiting = self.book.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        ordered = sorted(waiting, key=lambda t: t.number)
        slots = [int(t.system_attrs[SLOT]) for t in ordered if SLOT in t.system_attrs]
        for slot in [s for s in slots if s < len(self.plan.points)][: self.plan.n_workers]:
            self._alone_for(merge_overrides(self.plan.fixed, self.plan.points[slot].overrides))

    def _run_on(self, spec: TrialSpec, gpu: dict[str, Any] | None) -> RunReport:
        """Run ``spec``'s trial; on a GPU seat, give the seat back (blocked first when the GPU must pass a
        probe, so no other trial takes it meanwhile), mark who shared it, probe it if needed."""
        report = None
        try:
            report = self.runner.run(spec, tick_s=1.0, timeout_s=self.plan.timeout_s)
        finally:
            if gpu is not None and self.seats is not None:
                probe = report is not None and not self.state.interrupted and needs_probe(report.result)
                if probe:
                    self.seats.block(gpu["device"], f"probing after trial {spec.number:04d}")
                shared_with = self.seats.give_back(gpu["device"], spec.number)
        if gpu is not None and report is not None:
            mark_share(report, spec, shared_with)
            if probe:
                self._probe(gpu["device"], spec.number)
        return report

    def _probe(self, gpu: str, number: int) -> None:
        """After a trial that died of anything but an OOM its GPU takes no trial until a probe allocation
        (in a child process) succeeds; a GPU that fails it is not used again in this run, and the sweep
        stops when no GPU is left."""
        assert self.seats is not None
        why = gpus.probe_gpu(gpu)
        if why is None:
            self.seats.unblock(gpu)
            self.book.say(f"vramsweep: GPU {gpu} passed its probe after trial {number:04d} ended error")
            return
        self.seats.block(gpu, why)
        self.book.say(
            f"vramsweep: GPU {gpu} failed its probe after trial {number:04d} ended error ({why}): "
            "not used again in this run"
        )
        if set(self.seats.blocked) >= set(self.seats.gpus):
            self.state.stop(f"every GPU failed its probe ({'; '.join(self.seats.blocked.values())})")

    def _requeue_unstarted(self, job: Job) -> None:
        """The sweep stopped while ``job`` waited for a GPU: closed unstarted, its point back in its slot."""
        self.book.lost.requeue(job, "not started (the sweep stopped)")

    def heartbeat(self, stop: threading.Event) -> None:
        """Stamp the running trials every ``heartbeat_s`` until ``stop`` is set."""
        while not stop.wait(self.plan.heartbeat_s):
            self.book.lost.stamp_running()

    def _record(self, job: Job, report: RunReport) -> None:
        book, state, s = self.book, self.state, self.plan
        book.lost.note_retries(job, report)
        status = str(report.result.get("status"))
        with book.recording(job, report):
            if self.wandb_summary is not None:
                self.wandb_summary.poke()
            state.finished += 1
            state.failures += int(report.outcome.failure)
            state.statuses[status] = state.statuses.get(status, 0) + 1
            shown = list(job.label)
            if job.retry_of is not None:
                shown.append(f"(retry of {job.retry_of:04d})")
            if job.duplicate_of is not None:
                shown.append(f"(same point as {job.duplicate_of:04d}: not re-run)")
            done, running, best = book.progress_counts()
            self.progress.finished(
                trial_line(job.number, report.result, report.wall_s, s.goals, shown),
                wall_s=report.wall_s if job.duplicate_of is None else None,
                done=done,
                running=running,
                best=best,
            )
            if str(report.result.get("reason") or "").startswith(NO_SPACE):
                # a full disk: every later trial would train and then fail to record its result
                state.stop(
                    f"{report.result['reason']} (trial {job.number:04d}): the sweep stops, later trials "
                    "could not be recorded either"
                )
            if (
                state.finished >= s.min_trials_for_failure_rate
                and state.failures / state.finished > s.max_failure_rate
            ):
                state.stop(
                    f"{state.failures}/{state.finished} trials failed (status error or no objective) "
                    f"> hydra.sweeper.max_failure_rate={s.max_failure_rate}"
                )

    def _show_running(self) -> None:
        if self.progress.live:
            done, running, best = self.book.progress_counts()
            self.progress.update(done=done, running=running, best=best)

    def _requeue_interrupted(self, job: Job) -> None:
        """Ctrl-C: a stop, not a failure of the config. The trial is closed (reason ``interrupted``) and
        its point put back in its slot, within the same bound as a dead worker (``retry_stale``)."""
        self.book.lost.requeue(job, f"interrupted ({self.state.signal})")

    def _record_lost_job(self, job: Job, report: RunReport, lost: dict) -> None:
        """A launcher job lost to the infrastructure (cancelled, preempted, node lost, never submitted): not
        a trial outcome. The trial is closed (marked lost) and its point re-enqueued into its slot, up to
        ``retry_stale`` times in this run; a later run of the same command retries it again. A job that
        could not be submitted, with no retry left, stops the sweep (the launcher is down: say so)."""

        book, state, s = self.book, self.state, self.plan
        n = self._job_losses.get(job.slot, 0)
        will_retry = n < s.retry_stale and not state.abort.is_set()
        if will_retry:
            self._job_losses[job.slot] = n + 1
        note = (
            f"retried ({n + 1}/{s.retry_stale} in this run)"
            if will_retry
            else f"not retried again in this run (hydra.sweeper.retry_stale={s.retry_stale}): "
            "re-run the same command to retry it"
        )
        res = report.result
        was = res.get("reason")
        book.lost.close_lost_job(
            job,
            report,
            f"{was}; lost infrastructure, not a result: {note}"[:2000],
            job_lost=str(lost.get("kind") or "gone"),
            retry=will_retry,
        )
        book.say(f"vramsweep: trial {job.number:04d} {' '.join(job.label)}: {res['reason']}")
        if lost.get("kind") == "submit":
            if not will_retry:
                state.stop(
                    f"the launcher could not submit jobs ({_clip(str(res.get('reason')), 300)}); "
                    "nothing was lost: re-run the same command when the cluster is back"
                )
            else:
                state.abort.wait(min(2.0**n, 10.0))  # a controller restarting: back off before the retry


_COMPOSE = threading.Lock()  # Hydra's global state: one compose at a time in this process


def _alone_reason(overrides: list[str], share_below: float) -> str | None:
    """:func:`.gpus.needs_gpu_alone` of the trial composed from ``overrides`` (no estimate: alone)."""

    try:
        with _COMPOSE, hydra_state():
            cfg = compose(list(overrides), rules="none")
            est = estimate(cfg)
    except Exception as exc:  # the trial itself reports a config that does not compose
        return f"no memory estimate ({type(exc).__name__}: {str(exc)[:120]})"
    return needs_gpu_alone(cfg, est, share_below)


def mark_share(report: RunReport, spec: TrialSpec, shared_with: list[int] | None) -> None:
    """Rewrite the trial's ``meta.gpu_share`` with who ran on its GPU while it ran (``exact``), in the
    result JSON (atomic) and in ``report``. Its throughput (tokens/s, MFU, step times) is the card's own
    only when ``shared`` is false."""

    meta = report.result.setdefault("meta", {})
    exact = {"shared": bool(shared_with), "with": list(shared_with or []), "exact": True}
    meta["gpu_share"] = provisional_share(spec.gpu) | exact
    if Path(spec.result_path).is_file():
        try:
            write_result(spec.result_path, report.result)
        except OSError:
            pass  # the JSON keeps the conservative mark (shared unless it held the GPU alone)


def _clip(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters at a word boundary, with an ellipsis when cut."""
    if len(text) <= n:
        return text
    cut = text[: n - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "…"
