"""The sweep engine: validate, create the study once, then N worker slots pop trials and run them.

Flow of :func:`run_sweep`:

1. Settings (``hydra.sweeper.*`` + the sweep file's ``sweep:``) and the search space are parsed; every
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

:class:`Sweep` is the one object of a sweeper process: it holds the state, the run loop and the summary;
its study and worker sides are mixins from those modules; launcher mode is a runner (:mod:`.launch`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.design import design_choices
from vramsweep.sweeper.isolation import make_runner
from vramsweep.sweeper.launch import LauncherRunner
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
from vramsweep.sweeper.progress import Progress, fmt_override, plural
from vramsweep.sweeper.storage import COPY_OF, JOB_LOST, RETRY_OF, process_identity, requeue_lost
from vramsweep.sweeper.study import StudyMixin
from vramsweep.sweeper.workers import WorkerMixin

log = logging.getLogger("vramsweep.sweeper")


class Sweep(StudyMixin, WorkerMixin):
    """One sweeper process working on a study (other processes/machines may work on it too)."""

    def __init__(self, plan: Plan, runner: Any = None, launcher_factory: Any = None):
        self.plan = plan
        self.s = plan.settings
        self.wandb_summary: Any = None  # report.wandb_summary.SummaryUpdater when trials log to W&B
        self.trials_dir = self.s.sweep_dir / "trials"
        self.launcher_factory = launcher_factory
        if self.s.isolation == "launcher":
            if launcher_factory is None and runner is None:
                raise ConfigError(
                    "hydra.sweeper.isolation=launcher needs the Hydra sweeper plugin (vramsweep train -m)",
                    key="hydra.sweeper.isolation",
                )
            self.runner = runner or LauncherRunner(
                launcher_factory, self.s.sweep_dir, batch_size=self.s.n_jobs
            )
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
        self._job_losses: dict[int, int] = {}  # slot -> launcher jobs lost in this run (retry_stale bound)

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
        if self._nothing_waiting():
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
                    from vramsweep.preflight import sqlite_path
                    from vramsweep.record.diskfull import disk_full_reason

                    full = disk_full_reason(exc, sqlite_path(self.s.storage) or self.s.sweep_dir)
                    if full is not None:  # the study or a result could not be written: one line, no traceback
                        self.abort_reason = full
                        self.abort.set()
                        return
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
        checkpoint_wal(self.s.storage)
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
        left = requeue_lost(self.study)
        lost = [t.number for t in left if not t.system_attrs.get(JOB_LOST)]
        job_lost = [t.number for t in left if t.system_attrs.get(JOB_LOST)]
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
        from vramsweep.sweeper.storage import remaining_slots

        waiting = remaining_slots(self.study, self.plan.n_total)[0]
        if job_lost or waiting:  # the last line: how to retry what is left
            what = (
                [f"{plural(len(job_lost), 'trial')} whose launcher job was lost ({_numbers(job_lost)})"]
                if job_lost
                else []
            )
            what += [f"{plural(waiting, 'trial')} waiting"] if waiting else []
            lines.append(
                f"vramsweep: left: {' and '.join(what)}: re-run the same command to run {'it' if len(job_lost) + waiting == 1 else 'them'}"
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
    from vramsweep.config.errors import error_line
    from vramsweep.preflight import check_fault_env, check_named_options, preflight_sweep
    from vramsweep.sweeper.fastpath import finished_study
    from vramsweep.sweeper.storage_check import check_storage

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
        # before the study, any folder or any trial
        preflight_sweep(plan, task_cfg, arguments, check_storage=check_storage)
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2
    try:
        return Sweep(plan, runner=runner, launcher_factory=launcher_factory).run()
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2


def checkpoint_wal(url: str) -> None:
    """Fold a SQLite study's write-ahead log into ``study.db`` (a folder copied without ``study.db-wal``
    would otherwise hold an empty study). Best effort: another process may hold the log open."""
    import contextlib
    import sqlite3

    from vramsweep.sweeper.storage import sqlite_path

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
    from vramsweep.sweeper.isolation import effective_preload

    modules, left_out = effective_preload(preload)
    text = f"fork server (preloads {', '.join(modules) or 'nothing'}"
    if left_out:
        text += f"; not {', '.join(left_out)}: they initialise CUDA on import"
    return text + ")"
