"""The sweep engine: validate, create the study once, then N worker slots pop trials and run them.

Flow of :func:`run_sweep`:

1. The settings (``hydra.sweeper.*`` + the sweep file's ``sweep:``) and the search space are parsed; every
   value is composed and range-checked (:func:`.plan.plan_sweep`, :mod:`.validate`). Any ConfigError ->
   exit 2, nothing written.
2. The sweep folder, ``sweep.json`` and the study are created once (under the storage lock); stale
   trials of dead workers are reconciled and the study is topped up to ``n_trials`` slots
   (:mod:`.study`, :mod:`.storage`).
3. ``n_jobs`` worker threads (:mod:`.workers`) each pop a slot, let the sampler fill it (or take the
   design point), run it in a fresh process (:mod:`.isolation`, :mod:`.trialproc`) or as a Hydra
   launcher job (:mod:`.launch`), and tell Optuna the outcome (:mod:`.outcome`). A heartbeat thread
   stamps running trials.
4. A summary, and ``results: <sweep folder>``.

:class:`Sweep` is the loop of a sweeper process (open, run the workers, summarise); it is composed of a
:class:`~.study.StudyBook` (the study), a :class:`~.workers.WorkerPool` (the threads) and a
:class:`~.workers.RunState` (what this run did); launcher mode is a runner (:mod:`.launch`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.config.errors import error_line
from vramsweep.preflight import check_fault_env, check_named_options, preflight_sweep
from vramsweep.record.diskfull import disk_full_reason
from vramsweep.report.wandb_summary import SummaryUpdater
from vramsweep.sweeper.confirm import confirm_stage, may_confirm
from vramsweep.sweeper.fastpath import finished_study
from vramsweep.sweeper.gpus import GpuSeats
from vramsweep.sweeper.isolation import effective_preload, make_runner
from vramsweep.sweeper.launch import LauncherRunner
from vramsweep.sweeper.maxctx import run_max_context
from vramsweep.sweeper.plan import (  # noqa: F401 - re-exported
    DEFAULT_SEARCH_TRIALS,
    IDENTITY,
    NOT_IDENTITY,
    Plan,
    compose_sweep,
    identity_hash,
    name_sweep,
    plan_design,
    plan_from_args,
    plan_sweep,
    sweep_identity,
    total_trials,
)
from vramsweep.sweeper.progress import Progress, fmt_override, plural, status_label
from vramsweep.sweeper.settings import SweepConfig
from vramsweep.sweeper.storage import COPY_OF, JOB_LOST, RETRY_OF, SCREENED, requeue_lost, sqlite_path
from vramsweep.sweeper.storage_check import check_storage
from vramsweep.sweeper.study import StudyBook
from vramsweep.sweeper.workers import RunState, WorkerPool

log = logging.getLogger("vramsweep.sweeper")


def dashboard_hint(storage: str) -> str | None:
    """``vramsweep: dashboard: optuna-dashboard <storage>`` where optuna-dashboard is installed (the
    ``dashboard`` extra installs it), else ``None``: a hint to a command that is not there only confuses."""
    import importlib.util

    if importlib.util.find_spec("optuna_dashboard") is None:
        return None
    return f"vramsweep: dashboard: optuna-dashboard {storage if '@' not in storage else '<storage URL>'}"


def summary_status(trial: Any) -> str:
    """What the summary counts a finished study trial as: :func:`.progress.status_label` (the progress line's
    rule: ``over budget`` for an ``ok`` trial over its budget) of its recorded status and the largest budget
    constraint the study holds for it (``constraints:<name>``; the dashboard's list copy is the same
    value)."""
    constraints = [
        v
        for k, v in trial.system_attrs.items()
        if k.startswith("constraints") and isinstance(v, int | float) and not isinstance(v, bool)
    ]
    status = trial.user_attrs.get("status", trial.state.name.lower())
    return status_label(
        {"status": status, "meta": {"optuna": {"constraint": max(constraints, default=None)}}}
    )


class Sweep:
    """One sweeper process working on a study (other processes/machines may work on it too): the loop in
    the shape of Hydra's ``sweep()`` over three parts with one job each: the study book (:class:`StudyBook`:
    ask, tell, reconcile), the worker pool (:class:`WorkerPool`: run trials) and the run state
    (:class:`RunState`: counts and the abort flag)."""

    def __init__(self, plan: Plan, runner: Any = None, launcher_factory: Any = None):
        self.plan = plan
        s = plan
        if s.isolation == "launcher":
            if launcher_factory is None and runner is None:
                raise ConfigError(
                    "hydra.sweeper.isolation=launcher needs the Hydra sweeper plugin (vramsweep train -m)",
                    key="hydra.sweeper.isolation",
                )
            self.runner = runner or LauncherRunner(launcher_factory, s.sweep_dir, batch_size=s.n_jobs)
        else:
            self.runner = runner or make_runner(s.isolation, s.preload)
        self.progress = Progress(plan.n_total, enabled=s.progress)
        self.book = StudyBook(plan, say=self.progress.say)
        if isinstance(self.runner, LauncherRunner):  # each job kept in the study: a re-run adopts orphans
            self.runner.on_submit = self.book.record_job
        self.state = RunState()

    @classmethod
    def report_complete(cls, plan: Plan, study: Any, **kw: Any) -> int:
        """A complete study: say so and print its summary (nothing is written, no trial process)."""
        sweep = cls(plan, **kw)
        sweep.book.study = study
        print(
            f"vramsweep: study '{plan.study_name}' is complete ({plan.n_total}/{plan.n_total} "
            "finished): nothing to run",
            flush=True,
        )
        sweep.summary(0.0)
        return 0

    def run(self) -> int:
        """Open the study, run the workers to completion; returns the exit code (0 done, 1 aborted or
        interrupted)."""
        s, state = self.plan, self.state
        self.progress.done = self.book.open()
        if self.book.waiting() == 0:  # no trial to start: no fork server (no torch import), just the summary
            self.summary(0.0)
            return 0
        wandb_summary = None
        if self.plan.wandb:
            wandb_summary = SummaryUpdater(s.sweep_dir, on_warning=self.progress.say)
        pool = WorkerPool(self.book, self.runner, state, self.progress, wandb_summary, seats=self.seats())
        stop_beat = threading.Event()
        t0 = time.perf_counter()
        threading.Thread(
            target=pool.heartbeat, args=(stop_beat,), name="vramsweep-heartbeat", daemon=True
        ).start()
        started = False
        try:
            self.progress.say(self.describe())
            self.runner.start()
            started = True
            pool.prime()
            self.progress.start()
            self._run_workers(pool, max(1, s.n_jobs))
        finally:
            stop_beat.set()
            self.progress.stop()
            if started:
                self.runner.stop()
            if wandb_summary is not None:
                wandb_summary.close()
        self.summary(time.perf_counter() - t0)
        checkpoint_wal(s.storage)
        # an aborted sweep exits non-zero whatever stopped it (a reason set without the event included)
        return 1 if state.abort.is_set() or state.abort_reason or state.interrupted else 0

    def seats(self) -> GpuSeats | None:
        """The GPUs' seats of this run (``None``: CPU, or trials run as launcher jobs elsewhere)."""
        layout = self.plan.layout
        if layout is None or not layout.gpus or isinstance(self.runner, LauncherRunner):
            return None
        return GpuSeats(layout.gpus, layout.per_gpu)

    def _run_workers(self, pool: WorkerPool, n_threads: int) -> None:
        """``n_threads`` workers until every slot is done; Ctrl-C stops them (running trials re-enqueued)."""
        state = self.state
        # Completion is signalled with events, not Thread.join(): a KeyboardInterrupt that lands in
        # join() can leave CPython's thread state saying "finished" while the worker still runs.
        done = [threading.Event() for _ in range(n_threads)]

        def work(i: int) -> None:
            try:
                pool.run_worker(i)
            except BaseException as exc:  # a bug, not a trial failure: stop the sweep, say why
                full = disk_full_reason(exc, sqlite_path(self.plan.storage) or self.plan.sweep_dir)
                if full is not None:  # the study or a result could not be written: one line, no traceback
                    state.abort_reason = full
                    state.abort.set()
                    return
                state.abort_reason = f"internal error in worker {i}: {type(exc).__name__}: {exc}"
                state.abort.set()
                raise
            finally:
                done[i].set()

        for i in range(n_threads):
            threading.Thread(target=work, args=(i,), name=f"vramsweep-worker-{i}", daemon=True).start()
        with _sigterm_as_interrupt() as signalled:
            try:
                while not all(e.is_set() for e in done):
                    time.sleep(0.2)
            except KeyboardInterrupt:
                state.interrupted = True
                state.signal = "SIGTERM" if signalled else "Ctrl-C"
                state.abort.set()
                state.abort_reason = (
                    f"interrupted ({state.signal}); running trials re-enqueued: re-run the same "
                    "command to resume"
                )
                if isinstance(self.runner, LauncherRunner):
                    self.runner.kill_all(state.signal)
                else:
                    self.runner.kill_all()
                while not all(e.is_set() for e in done):
                    time.sleep(0.2)

    def describe(self) -> str:
        """One line: what runs and how (sampler, pruning, isolation, workers)."""
        s = self.plan
        if s.pruning_active:
            pruning = f"pruner {s.pruner_name} on {s.objectives[0].metric}"
        elif s.pruner_name == "none":
            pruning = "no pruning"
        elif s.design != "search":
            pruning = "no pruning (fixed design: every point runs to the end)"
        else:
            pruning = (
                "no pruning (needs a single objective eval_loss/eval_ppl; Optuna cannot prune "
                "multi-objective)"
            )
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
        workers = s.layout.line if s.layout is not None else f"{s.n_jobs} worker(s)"
        return (
            f"vramsweep: '{s.name}': {what}, {plural(self.plan.n_total, 'trial')}, {objs}{budget}; "
            f"{pruning}; {workers}, each trial in a {how}"
        )

    def summary(self, wall_s: float) -> None:
        """Counts by status, the best feasible trial(s), where the results are."""
        from optuna.trial import TrialState

        trials = self.book.study.get_trials(deepcopy=False)
        retried = {t.system_attrs.get(RETRY_OF) for t in trials} - {None}
        by_status: dict[str, int] = {}
        jobs_lost = 0
        for t in trials:
            if (
                t.number in retried
                or t.system_attrs.get(COPY_OF) is not None
                or t.system_attrs.get(SCREENED)  # sweep.edge_screen's estimate-only records: not counted
                or t.state in (TrialState.WAITING, TrialState.RUNNING)
            ):
                continue
            if t.system_attrs.get(JOB_LOST):  # lost infrastructure, not a result: never an "error"
                jobs_lost += 1
                continue
            st = summary_status(t)
            by_status[st] = by_status.get(st, 0) + 1
        lines = [
            f"vramsweep: sweep '{self.plan.name}' - this run: "
            f"{plural(self.state.finished, 'trial')} in {wall_s:.0f} s; study total: "
            + (", ".join(f"{v} {k}" for k, v in sorted(by_status.items())) or "no finished trials")
            + (f"; {plural(jobs_lost, 'launcher job')} lost (not results)" if jobs_lost else "")
        ]
        try:
            best = self.book.study.best_trials
        except Exception:
            best = []
        if best:
            if len(self.plan.objectives) == 1:
                b = best[0]
                lines.append(
                    f"vramsweep: best feasible: trial {b.number:04d} "
                    f"{self.plan.objectives[0].metric}={b.values[0]:.6g} "
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
        left = requeue_lost(self.book.study)
        lost = [t.number for t in left if not t.system_attrs.get(JOB_LOST)]
        job_lost = [t.number for t in left if t.system_attrs.get(JOB_LOST)]
        if lost:
            lines.append(
                f"vramsweep: {len(lost)} design point(s) lost for good (their worker died or was stopped "
                f"{self.plan.retry_stale + 1} times: trial(s) {', '.join(f'{n:04d}' for n in lost)}): "
                f"re-run with hydra.sweeper.retry_stale={self.plan.retry_stale + 1} to retry them"
            )
        if self.state.abort_reason:
            lines.append(f"vramsweep: ABORTED: {self.state.abort_reason}")
        if (hint := dashboard_hint(self.plan.storage)) is not None:
            lines.append(hint)
        lines.append(f"results: {self.plan.sweep_dir}")
        waiting = self.book.waiting()
        if job_lost or waiting:  # the last line: how to retry what is left
            what = (
                [f"{plural(len(job_lost), 'trial')} whose launcher job was lost ({_numbers(job_lost)})"]
                if job_lost
                else []
            )
            what += [f"{plural(waiting, 'trial')} waiting"] if waiting else []
            lines.append(
                f"vramsweep: left: {' and '.join(what)}: re-run the same command to run "
                f"{'it' if len(job_lost) + waiting == 1 else 'them'}"
            )
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

    try:
        SweepConfig.from_dict(
            task_cfg.get("sweep")
        )  # `sweep:` as a list or a string: one line, not a traceback
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2
    if str((task_cfg.get("sweep") or {}).get("design")) == "max_context":
        try:
            check_fault_env()
            check_named_options(arguments)
        except ConfigError as exc:
            print(error_line("train", str(exc)), file=sys.stderr)
            return 2
        return run_max_context(sweeper_cfg, task_cfg, arguments, runner=runner)
    done = finished_study(sweeper_cfg, task_cfg, arguments)
    # nothing to run (and no confirm stage to finish): the summary, without composing every point or torch
    if done is not None and not may_confirm(done[0]):
        return Sweep.report_complete(*done, runner=runner, launcher_factory=launcher_factory)
    try:
        check_fault_env()
        check_named_options(arguments)  # sweep=<typo>: Hydra ignores an unknown option of an optional group
        plan = plan_sweep(sweeper_cfg, task_cfg, arguments)
        # before the study, any folder or any trial
        preflight_sweep(plan, task_cfg, arguments, check_storage=check_storage)
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2
    try:
        code = Sweep(plan, runner=runner, launcher_factory=launcher_factory).run()
        stage = confirm_stage(plan) if code == 0 else None
        return Sweep(stage, runner=runner).run() if stage is not None else code
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM (``kill``, a job scheduler, a container stop) is handled as Ctrl-C while the workers run:
    running trials are stopped and re-enqueued, launcher jobs cancelled, the exit is non-zero (a sweeper
    that died at once left its launcher jobs running: their points ran twice). Yields a list that holds
    the signal number once SIGTERM came. Only in the main thread (signal handlers live there)."""
    import signal

    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def handler(signum: int, _frame: Any) -> None:
        if not came:  # the first SIGTERM interrupts; later ones wait for the cancellation to finish
            came.append(signum)
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, previous)


def checkpoint_wal(url: str) -> None:
    """Fold a SQLite study's write-ahead log into ``study.db`` (a folder copied without ``study.db-wal``
    would otherwise hold an empty study). Best effort: another process may hold the log open."""
    import contextlib
    import sqlite3

    path = sqlite_path(url)
    if path is None or not path.is_file():
        return
    with (
        contextlib.suppress(sqlite3.Error),
        contextlib.closing(sqlite3.connect(str(path), timeout=30)) as conn,
    ):
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _numbers(numbers: list[int]) -> str:
    return "trial " + ", ".join(f"{n:04d}" for n in numbers)


def _fork_how(preload: list[str]) -> str:
    """How the fork server starts trials on this host (CUDA hosts leave out CUDA-initialising modules)."""

    modules, left_out = effective_preload(preload)
    text = f"fork server (preloads {', '.join(modules) or 'nothing'}"
    if left_out:
        text += f"; not {', '.join(left_out)}: they initialise CUDA on import, or import a module that does"
    return text + ")"
