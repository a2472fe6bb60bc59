"""Launcher mode (``hydra.sweeper.isolation=launcher``): each trial is a job of Hydra's configured launcher.

``hydra/launcher=submitit_slurm`` (or ``submitit_local``, ``joblib``, ``ray``...) on the command line picks
it unless ``hydra.sweeper.isolation`` is given there (:func:`choose_isolation`). The worker threads of
:mod:`.workers` dispatch trials as usual; :class:`LauncherRunner` stands in for the process runner. A job
gets ``VRAMSWEEP_TRIAL_SPEC`` (via ``hydra.job.env_set``) pointing at its spec JSON under
``<sweep dir>/jobs`` and runs it like a fork-server child (:func:`vramsweep.sweeper.multirun._task`):
result JSON written atomically next to the study, pruning reports through the shared storage. This
process tells the study and keeps the trials' heartbeat while it waits for the jobs.

submitit launchers get one ``launch()`` per trial, from every worker thread at once: a job that dies
(killed, node lost, ``timeout_min``) fails its own trial (``error``, with submitit's reason), never the
others, and no trial waits for a slow batch mate. Other launchers (``basic``, ``joblib``, ``ray``) are
not known to be safe to call from several threads: their trials are gathered into batches of up to
``n_jobs`` jobs per ``launch()`` call, as Hydra's own sweepers do.

With submitit the runner submits and watches each job itself (:class:`_SubmititJobs`, the same executor and
callable the plugin's ``launch()`` builds), so it can tell *how* a job ended. A job that left without a
result JSON - cancelled (``scancel``), preempted, its node lost, killed, or never submitted (``sbatch``
failed: controller down) - is **lost infrastructure**, not a trial outcome: the result carries
``meta.lost_job`` and the sweep retries the point (:meth:`.workers.WorkerPool._record_lost_job`). A trial that
failed by itself (OOM, NaN, an exception) wrote its result JSON: that is a result. ``TIMEOUT`` and
``OUT_OF_MEMORY`` (the job's own limits) are results too (``error``, with the state), since a retry would
hit them again. SLURM jobs are watched with ``squeue -t all`` (no accounting needed): a job that is no
longer pending/running, or no longer known to the controller, and left no result within
:data:`SETTLE_S` is lost - bounded, where submitit would poll ``sacct`` forever without accounting.
Ctrl-C (:meth:`LauncherRunner.kill_all`) cancels the sweep's own jobs (``scancel``) and returns at once.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.record.result import write_result
from vramsweep.sweeper.isolation import Runner
from vramsweep.sweeper.production_run import submitit_executor
from vramsweep.sweeper.storage import process_identity
from vramsweep.sweeper.trialproc import (
    SPEC_ENV,
    RunReport,
    TrialSpec,
    _load_child_result,
    parent_side_result,
    report_from_json,
    save_spec,
)

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
#: Launchers whose ``launch()`` may run in several threads at once (a new executor per call, no globals).
CONCURRENT_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.",)
#: SLURM job states after which a job without a result is a result of its own limits (a retry hits them
#: again).
RESULT_STATES = ("TIMEOUT", "OUT_OF_MEMORY", "DEADLINE")
#: SLURM states of a job still in the queue (anything else: it left).
QUEUED_STATES = (
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "SUSPENDED",
    "STOPPED",
    "SPECIAL_EXIT",
    "RESV_DEL_HOLD",
)
#: Seconds a job that left the queue gets for its result to show up (shared filesystems lag) before it is
#: lost.
SETTLE_S = float(os.environ.get("VRAMSWEEP_JOB_SETTLE_S", "10"))
#: Seconds between two ``squeue`` probes of a job.
PROBE_S = float(os.environ.get("VRAMSWEEP_JOB_PROBE_S", "2"))
#: Seconds a SLURM job may sit queued (pending, held, requeued) or the controller stay silent before the
#: sweep says so, and between two such lines.
WAIT_NOTE_S = float(os.environ.get("VRAMSWEEP_JOB_WAIT_NOTE_S", "60"))
#: States of a job doing its work: nothing to say while it is in one.
WORKING_STATES = ("RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT")
#: System attribute holding a trial's launcher job (:func:`job_record`; a re-run adopts it: :mod:`.orphans`).
JOB = "vramsweep:launcher_job"


def job_record(kind: str, job: Any) -> dict[str, Any]:
    """What the study keeps of a submitted job: enough for another process to find and stop it (a local
    job's id is its controller's pid: host and start time tell a recycled pid apart)."""
    if kind == "slurm":
        return {"kind": "slurm", "id": str(job.job_id)}
    return {"kind": kind, "id": str(job.job_id)} | process_identity(int(job.job_id))


def slurm_state(job_id: str) -> str | None:
    """A SLURM job's state from the controller (``squeue -t all``; no accounting needed).

    Returns the state (``RUNNING``, ``CANCELLED``...), ``None`` when the controller no longer knows the
    job (it left more than ``MinJobAge`` ago), or ``"?"`` when the controller could not be asked.
    """
    try:
        p = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    out = p.stdout.strip().split()
    if p.returncode == 0:
        return out[0].upper() if out else None
    return None if "invalid job id" in (p.stderr or "").lower() else "?"


def _sacct_state(job_id: str) -> str | None:
    """The final state from accounting when it is there (``None`` otherwise)."""
    # broad on purpose: sacct missing, slow or odd: no accounting state
    with contextlib.suppress(Exception):
        p = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.split()[0].upper()
    return None


def _tail(path: Any, n: int = 600) -> str:
    # broad on purpose: a log tail is a hint; a missing or odd file gives none
    with contextlib.suppress(Exception):
        text = Path(path).read_text(errors="replace")
        return " ".join(text[-n:].split())
    return ""


def choose_isolation(
    isolation: str, launcher_target: str | None, hydra_overrides: list[str]
) -> tuple[str, str | None]:
    """The isolation a sweep runs with, and a note for the user (``None``: nothing to say).

    A launcher other than Hydra's basic one, chosen without ``hydra.sweeper.isolation`` on the command line,
    means launcher mode: the user asked for the cluster. With an explicit isolation other than ``launcher``
    the launcher is not used, and the note says so.
    """
    if not launcher_target or launcher_target == BASIC_LAUNCHER or isolation == "launcher":
        return isolation, None
    explicit = any(o.lstrip("+").startswith("hydra.sweeper.isolation=") for o in hydra_overrides)
    short = launcher_target.rsplit(".", 1)[-1]
    if not explicit:
        return "launcher", None
    return isolation, (
        f"vramsweep: hydra.sweeper.isolation={isolation}: the configured Hydra launcher ({short}) "
        "is not used; each trial runs in a process of this sweeper "
        "(hydra.sweeper.isolation=launcher hands trials to it)"
    )


def _wall(result: dict[str, Any], fallback: float) -> float:
    w = (result.get("meta") or {}).get("wall_s")
    return float(w) if isinstance(w, int | float) else fallback


@dataclass
class _Request:
    spec: TrialSpec
    overrides: list[str]
    ret: Any = None
    error: str | None = None
    done: bool = False
    lost: dict[str, Any] | None = None  # lost infrastructure: {"kind", "state", "job_id"}
    job_id: str | None = None


class LauncherRunner(Runner):
    """The runner of launcher mode: ``run(spec)`` hands the trial to the Hydra launcher and waits for it."""

    name = "launcher"

    def __init__(self, launcher_factory: Any, sweep_dir: Path, *, batch_size: int = 1, gather_s: float = 0.3):
        self.factory = launcher_factory
        self.sweep_dir = Path(sweep_dir)
        self.batch_size = max(1, batch_size)
        self.gather_s = gather_s
        self.launcher: Any = None
        self.target = ""
        self.concurrent = False
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False
        self.jobs: _SubmititJobs | None = None
        #: ``on_submit(spec, record)``: the sweep keeps each job in the study (:data:`JOB`)
        self.on_submit: Any = None
        #: trial numbers whose job could not be cancelled (their trials stay RUNNING for a re-run to adopt)
        self.uncancelled: set[int] = set()
        #: set once :meth:`kill_all` has asked for every cancel: until then ``uncancelled`` is not final
        #: (``scancel`` against a stopped controller fails only after seconds, and the workers return at once)
        self.cancel_settled = threading.Event()

    def start(self) -> None:
        self.launcher = self.factory()
        self.target = f"{type(self.launcher).__module__}.{type(self.launcher).__qualname__}"
        self.concurrent = self.target.startswith(CONCURRENT_LAUNCHERS)
        cfg = getattr(self.launcher, "config", None)
        if cfg is not None:  # the launcher makes its sweep dir: ours (not the unnamed default's)
            from omegaconf import OmegaConf, open_dict

            default = None
            # broad on purpose: a launcher config without hydra.sweep.dir keeps its own
            with contextlib.suppress(Exception):
                default = str(OmegaConf.select(cfg, "hydra.sweep.dir"))
            # broad on purpose: a config that refuses the key keeps its own folder
            with contextlib.suppress(Exception), open_dict(cfg):
                cfg.hydra.sweep.dir = str(self.sweep_dir)
            # settings resolved from the default sweep dir when the launcher was made (submitit_folder:
            # ${hydra.sweep.dir}/.submitit/%j) move into ours
            params = getattr(self.launcher, "params", None)
            if default and isinstance(params, dict):
                for k, v in params.items():
                    if isinstance(v, str) and (v == default or v.startswith(default + "/")):
                        params[k] = str(self.sweep_dir) + v[len(default) :]
        if self.concurrent and hasattr(self.launcher, "_EXECUTOR") and hasattr(self.launcher, "params"):
            self.jobs = _SubmititJobs(self.launcher, on_submit=self.on_submit)

    def kill_all(self, why: str = "Ctrl-C") -> None:
        """Ctrl-C or SIGTERM: cancel this sweep's jobs (pending or running) and stop waiting for them."""
        try:
            if self.jobs is not None:
                self.uncancelled |= self.jobs.cancel_all(why)
        finally:
            self.cancel_settled.set()

    def left_running(self, number: int) -> bool:
        """Whether trial ``number``'s job could not be cancelled (it may still run): asked after Ctrl-C or
        SIGTERM, it waits until :meth:`kill_all` knows."""
        self.cancel_settled.wait()
        return number in self.uncancelled

    def run(
        self,
        spec: TrialSpec,
        *,
        tick: Any = None,
        tick_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> RunReport:
        """Run one trial as a launcher job. ``timeout_s`` is the launcher's business (e.g.
        ``hydra.launcher.timeout_min``): a job cannot be killed from here."""
        spec.env, spec.parent_pid, spec.parent_ctime, spec.log_path = {}, 0, None, None  # runs elsewhere
        path = self.sweep_dir / "jobs" / f"{spec.number:04d}.spec.json"
        save_spec(spec, str(path))
        with contextlib.suppress(FileNotFoundError):
            Path(spec.result_path).unlink()
        req = _Request(
            spec,
            [
                *spec.overrides,
                f"++hydra.job.env_set.{SPEC_ENV}='{path}'",
                f"++hydra.job.env_set.VRAMSWEEP_SWEEP_DIR='{self.sweep_dir}'",
                f"hydra.sweep.dir='{self.sweep_dir}'",
            ],
        )
        t0 = time.perf_counter()
        if self.jobs is not None:
            self.jobs.run(req)
        elif self.concurrent:
            self._launch([req])
        else:
            self._batched(req)
        wall = time.perf_counter() - t0
        data = _load_child_result(spec.result_path)
        if data is not None:
            return report_from_json(data, _wall(data, wall), None)
        if req.error is not None:
            reason = f"launcher job failed without a result: {req.error}"
        else:
            why = getattr(req.ret, "_return_value", None) if req.ret is not None else None
            status = getattr(getattr(req.ret, "status", None), "name", "no return")
            reason = f"launcher job ended without a result (job status {status}{f': {why}' if why else ''})"
        res = parent_side_result(spec, reason[:1000], wall)
        if req.lost is not None:  # not a trial outcome: the sweep retries the point
            res["meta"]["lost_job"] = req.lost
            write_result(spec.result_path, res)
        return report_from_json(res, wall, None)

    def _launch(self, batch: list[_Request]) -> None:
        """One ``launch()`` call; a failure is every unfinished job's (a launcher raises for the batch)."""
        try:
            returns = list(
                self.launcher.launch([r.overrides for r in batch], initial_job_idx=batch[0].spec.number)
            )
        # broad on purpose: a launcher plugin may raise anything; the batch's trials record it
        except Exception as exc:
            text = " ".join(str(exc).split())
            for r in batch:
                r.error = f"{type(exc).__name__}: {text[:600]}"
            return
        for r, ret in zip(batch, returns):
            r.ret = ret

    def _batched(self, req: _Request) -> None:
        """Launchers called from one thread at a time: the first waiting worker gathers up to ``batch_size``
        requests (for ``gather_s`` at most) and launches them as one batch; the others wait for theirs."""
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
        while True:
            with self._cond:
                while self._busy and not req.done:
                    self._cond.wait(0.5)
                if req.done:
                    return
                self._busy = True
                deadline = time.monotonic() + self.gather_s
                while len(self._pending) < self.batch_size and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
            try:
                self._launch(batch)
            finally:
                with self._cond:
                    for r in batch:
                        r.done = True
                    self._busy = False
                    self._cond.notify_all()


class _WaitNotes:
    """Lines for a SLURM job the sweep keeps waiting for without news: queued (pending, held, requeued) or
    the controller not answering for :data:`WAIT_NOTE_S`, then again every :data:`WAIT_NOTE_S` (a stopped
    ``slurmctld`` used to mean minutes of silence)."""

    def __init__(self, number: int, job_id: str, now: float):
        self.number, self.job_id = number, job_id
        self.state, self.since, self.said = "", now, now

    def after_probe(self, probed: str | None, now: float) -> str | None:
        state = "?" if probed == "?" else str(probed or "").split("+")[0]
        if state != self.state:
            self.state, self.since = state, now
        if (
            state in WORKING_STATES
            or not state
            or now - self.since < WAIT_NOTE_S
            or now - self.said < WAIT_NOTE_S
        ):
            return None
        self.said = now
        waited = f"{(now - self.since) / 60:.1f} min"
        if state == "?":
            return (
                f"vramsweep: trial {self.number:04d}: the SLURM controller has not answered for {waited} "
                f"(squeue fails); job {self.job_id} may still be queued or running: still waiting for it "
                "(Ctrl-C cancels this sweep's jobs)"
            )
        return (
            f"vramsweep: trial {self.number:04d}: job {self.job_id} {state} for {waited}; still "
            "waiting for it"
        )


class _SlurmWatch:
    """What the SLURM controller's probes (at most one per :data:`PROBE_S`) said about a job the sweep waits
    for: its last known ``state`` and since when it has been gone from the queue (``gone_since``)."""

    def __init__(self, notes: _WaitNotes):
        self.notes = notes
        self.gone_since: float | None = None
        self.state: str | None = None
        self.last_probe = 0.0

    def ended(self, job_id: str, result_json: Path) -> bool:
        """Probe the controller when :data:`PROBE_S` has passed since the last probe (printing any
        :class:`_WaitNotes` line); True once the job has been out of the queued states (or unknown to the
        controller) for :data:`SETTLE_S` (2 s when it was cancelled and wrote no result JSON). An unreachable
        controller (``?``) changes nothing: the job may still run."""
        now = time.monotonic()
        if now - self.last_probe >= PROBE_S:
            self.last_probe = now
            probed = slurm_state(job_id)
            if (line := self.notes.after_probe(probed, now)) is not None:
                print(line, file=sys.stderr, flush=True)
            if probed == "?":  # controller unreachable: the job may still run; keep waiting
                pass
            elif probed is None or probed.split("+")[0] not in QUEUED_STATES:
                if probed is not None or (self.state or "PENDING").split("+")[0] in QUEUED_STATES:
                    self.state = probed  # None: gone from the controller, final state unknown
                self.gone_since = self.gone_since or now
            else:
                self.gone_since, self.state = None, probed
            settle = (
                2.0
                if self.state and self.state.startswith("CANCELLED") and not result_json.exists()
                else SETTLE_S
            )
            if self.gone_since is not None and now - self.gone_since >= settle:
                return True
        return False


class _SubmititJobs:
    """Submit one trial as a submitit job (the executor and callable of the plugin's ``launch()``) and
    watch it to its end, telling lost infrastructure from a result (module doc)."""

    def __init__(self, launcher: Any, on_submit: Any = None):
        self.launcher = launcher
        self.kind = str(launcher._EXECUTOR)  # "slurm" | "local"
        self.executor = self._executor()
        self._lock = threading.Lock()
        self._live: dict[str, Any] = {}
        self._numbers: dict[str, int] = {}  # job id -> trial number
        self.cancelled = threading.Event()
        self.on_submit = on_submit

    def _executor(self) -> Any:
        """The executor exactly as ``BaseSubmititLauncher.launch()`` builds it."""
        return submitit_executor(self.kind, dict(self.launcher.params))

    def submit(self, req: _Request) -> Any:
        from hydra.core.singleton import Singleton

        idx = req.spec.number
        with self._lock:
            if self.cancelled.is_set():
                raise KeyboardInterrupt
            job = self.executor.submit(
                self.launcher,
                list(req.overrides),
                "hydra.sweep.dir",
                idx,
                f"job_id_for_{idx}",
                Singleton.get_state(),
            )
            self._live[str(job.job_id)] = job
            self._numbers[str(job.job_id)] = idx
        if self.on_submit is not None:  # kept in the study: a re-run finds the job if this sweeper dies
            # broad on purpose: recording the job is for a later re-run; the trial runs anyway
            with contextlib.suppress(Exception):
                self.on_submit(req.spec, job_record(self.kind, job))
        return job

    def cancel_all(self, why: str = "Ctrl-C") -> set[int]:
        """Cancel every live job; says what was cancelled and what could not be. Returns the trial numbers
        of the jobs that could not be cancelled (they may still run)."""
        self.cancelled.set()
        with self._lock:
            jobs = list(self._live.values())
        failed = {str(j.job_id): r for j in jobs if (r := self._cancel(j)) is not None}
        done = [str(j.job_id) for j in jobs if str(j.job_id) not in failed]
        if done:
            how = f"scancel {' '.join(done)}" if self.kind == "slurm" else f"local job(s) {' '.join(done)}"
            print(
                f"vramsweep: {why}: cancelled this sweep's {len(done)} launcher job(s) ({how})",
                file=sys.stderr,
            )
        if failed:
            print(
                f"vramsweep: {why}: could not cancel launcher job(s) "
                + "; ".join(f"{k} ({v})" for k, v in failed.items())
                + ": they may still run; their trials stay running in the study, and a re-run of the same "
                "command stops them before it retries their points",
                file=sys.stderr,
            )
        return {self._numbers[k] for k in failed if k in self._numbers}

    def _cancel(self, job: Any) -> str | None:
        """Cancel one job; ``None`` when it is gone, else why it may still run."""
        try:
            job.cancel(check=True)
        except Exception as exc:  # scancel failed (controller down...)
            if self.kind == "slurm":
                return f"scancel failed: {' '.join(str(exc).split())[:200]}"
        proc = getattr(job, "_process", None)  # a local job: SIGINT first, SIGKILL if it lingers
        if proc is not None:
            # broad on purpose: stopping a local job is best effort, step by step (wait, kill, wait)
            with contextlib.suppress(Exception):
                proc.wait(timeout=3)
            with contextlib.suppress(Exception):  # broad on purpose: it may have ended meanwhile
                proc.kill()
            with contextlib.suppress(Exception):  # broad on purpose: the poll below says what is left
                proc.wait(timeout=5)
            if proc.poll() is None:
                return "its process survived SIGKILL"
        return None

    def run(self, req: _Request) -> None:
        """Submit, then wait until the job is done, lost, or Ctrl-C cancels it. Sets ``req.lost`` /
        ``req.error``."""
        try:
            job = self.submit(req)
        except KeyboardInterrupt:
            req.error, req.lost = "interrupted before submission", {"kind": "interrupted", "state": None}
            return
        except Exception as exc:  # sbatch failed (controller down, bad partition...): nothing ran
            text = " ".join(str(exc).split())
            req.error = f"the job could not be submitted: {type(exc).__name__}: {text[:600]}"
            req.lost = {"kind": "submit", "state": None, "job_id": None}
            return
        req.job_id = str(job.job_id)
        try:
            self._wait(req, job)
        finally:
            with self._lock:
                self._live.pop(req.job_id, None)

    def _wait(self, req: _Request, job: Any) -> None:
        """Poll every 0.5 s until the job is done (SLURM: its result pickle is there, or the controller has
        lost it for long enough, :meth:`_SlurmWatch.ended`) or the sweep is cancelled (the job is cancelled,
        ``req.error``/``req.lost`` say so); then :meth:`_conclude`."""
        result_json = Path(req.spec.result_path)
        watch = _SlurmWatch(_WaitNotes(int(req.spec.number), str(req.job_id), time.monotonic()))
        while True:
            if self.cancelled.is_set():
                self._cancel(job)
                req.error = f"job {req.job_id} cancelled (interrupted)"
                req.lost = {"kind": "interrupted", "state": "CANCELLED", "job_id": req.job_id}
                return
            if self.kind != "slurm":
                if job.done():
                    break
            else:
                if job.paths.result_pickle.exists():
                    break
                if watch.ended(str(req.job_id), result_json):
                    break
            time.sleep(0.5)
        self._conclude(req, job, watch.state)

    def _conclude(self, req: _Request, job: Any, state: str | None) -> None:
        """The job ended: its return, a failure of its own, or lost infrastructure."""
        if job.paths.result_pickle.exists() or (self.kind != "slurm" and job.state != "INTERRUPTED"):
            try:
                req.ret = job.results()[0]
                return
            except Exception as exc:  # FailedJobError: the job raised (its traceback): a result
                name = type(exc).__name__
                if name != "UncompletedJobError":
                    req.error = f"{name}: {' '.join(str(exc).split())[-600:]}"
                    return
        if self.kind == "slurm":
            state = _sacct_state(req.job_id) or state
        else:
            rc = getattr(getattr(job, "_process", None), "returncode", None)
            state = f"KILLED (signal {-rc})" if isinstance(rc, int) and rc < 0 else f"{job.state} (exit {rc})"
        short = (state or "UNKNOWN").split()[0].split("+")[0]
        err = _tail(job.paths.stderr, 400)
        where = f"job {req.job_id} ({self.kind}) ended {state or 'UNKNOWN'} without a result"
        req.error = where + (f"; its stderr ends: {err}" if err else "")
        if short in RESULT_STATES:
            return  # the job's own limits: a result (error), not retried
        req.lost = {"kind": "gone", "state": short, "job_id": req.job_id}
