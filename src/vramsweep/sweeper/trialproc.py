"""What runs inside a trial process, and the spec and report it exchanges with the sweeper.

The sweeper (:mod:`.engine`) writes a :class:`TrialSpec`; an isolation (:mod:`.isolation`: a forked or
spawned process, the sweeper itself, or a Hydra launcher job) runs :func:`child_main` / :func:`execute`
on it. The child writes the result JSON itself (atomic), *then* the parent tells Optuna, so a sweeper
killed in between loses nothing: the next run tells the study from the JSON. A child that dies without a
JSON gets an ``error`` result written by the parent (:func:`parent_side_result`; ``host_oom`` when it was
SIGKILLed while the host-pool marker it writes said its pinned pool was growing). Intermediate evals go
to the study through :class:`StorageReporter` (pruning). Trial processes die with their sweeper
(``PR_SET_PDEATHSIG`` plus a watchdog), so no orphan can write a result for a trial the next run has
already retried.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramsweep.config.compose import compose
from vramsweep.config.rules import refused_point
from vramsweep.record.diskfull import disk_full_reason
from vramsweep.record.hostmem import MARKER_ENV, marker_path
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import atomic_write_json, new_result, read_json_file, write_result
from vramsweep.record.status import Status
from vramsweep.record.threads_env import CONCURRENT_ENV
from vramsweep.record.units import GIB
from vramsweep.sweeper.outcome import Outcome, classify, normalise_result, result_from_exception
from vramsweep.sweeper.samplers import make_pruner
from vramsweep.sweeper.settings import Objective
from vramsweep.sweeper.storage import make_storage


@dataclass
class TrialSpec:
    """Everything a trial process needs (pickled to the child)."""

    number: int
    trial_id: int
    slot: int
    overrides: list[str]
    result_path: str
    sweep_name: str
    study_name: str
    storage: str
    objectives: list[Objective]
    trial_fn: str
    design: dict[str, Any] = field(default_factory=dict)
    pruner: Any = "none"
    pruning: bool = False
    budget_gib: float = 0.0
    preflight: bool = False
    retry_of: int | None = None
    log_path: str | None = None
    parent_pid: int = 0
    parent_ctime: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."
    #: the GPU seat (:class:`.gpus.GpuSeats`): ``{"device", "per_gpu", "alone"}``; empty without one
    gpu: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_job(
        cls,
        job: Any,
        plan: Any,
        *,
        worker: int = 0,
        parent_ctime: float | None = None,
        gpu: dict[str, Any] | None = None,
    ) -> TrialSpec:
        """The spec of a sweep's trial ``job`` (:class:`.study.Job`) in ``plan`` (:class:`.plan.Plan`):
        result JSON and log under ``<sweep dir>/trials`` (no log file in process), the sweep's
        objectives, pruner and checks, this process as the parent (``parent_ctime``: its start time),
        and this environment plus ``VRAMSWEEP_SWEEP_DIR`` (trial W&B runs go to ``<sweep dir>/wandb``),
        ``VRAMSWEEP_CONCURRENT_TRIALS`` (``plan.n_workers``: ``train.threads=auto`` takes a share) and
        ``CUDA_VISIBLE_DEVICES``: the GPU of its seat (``gpu``), else (launcher jobs) worker ``worker``'s
        entry of ``cuda_devices``."""
        trials = plan.folder / "trials"
        env = dict(os.environ)
        env["VRAMSWEEP_SWEEP_DIR"] = str(plan.folder)
        # train.threads=auto takes its share of the cores
        env[CONCURRENT_ENV] = str(max(1, int(plan.n_workers)))
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu["device"])
            if plan.layout is not None and plan.layout.source in ("NVML", "torch (asked in a child process)"):
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices are NVML's (PCI bus order)
        elif plan.cuda_devices:
            env["CUDA_VISIBLE_DEVICES"] = plan.cuda_devices[worker % len(plan.cuda_devices)]
        return cls(
            number=job.number,
            trial_id=job.trial._trial_id,
            slot=job.slot,
            overrides=job.overrides,
            result_path=str(trials / f"{job.number:04d}.json"),
            sweep_name=plan.name,
            study_name=plan.study_key,
            storage=plan.storage_url,
            objectives=list(plan.goals),
            trial_fn=plan.trial_fn,
            design=job.design,
            pruner=plan.pruner_spec,
            pruning=plan.pruning_active,
            budget_gib=plan.budget_gib,
            preflight=plan.preflight,
            retry_of=job.retry_of,
            log_path=None if plan.isolation == "inprocess" else str(trials / f"{job.number:04d}.log"),
            parent_pid=os.getpid(),
            parent_ctime=parent_ctime,
            env=env,
            cwd=os.getcwd(),
            gpu=dict(gpu or {}),
        )


@dataclass
class RunReport:
    """What the parent learned about one trial run."""

    result: dict[str, Any]
    outcome: Any  # outcome.Outcome
    wall_s: float
    exitcode: int | None


def takes_cfg(fn: Callable[..., Any]) -> bool:
    """Whether a trial function accepts an already composed config (``cfg=``) next to its overrides."""
    import inspect

    try:
        return "cfg" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def resolve_fn(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class StorageReporter:
    """The trial's ``reporter(step, eval_loss) -> bool``: reports to the study through its storage.

    The storage is opened lazily on the first report (a trial without intermediate evals never
    connects). Storage trouble never fails a trial: the report is skipped and logged.
    """

    def __init__(self, spec: TrialSpec):
        self.spec = spec
        self.curve: list[list[float]] = []
        self.pruned_at: int | None = None
        self._trial: Any = None
        self._error: str | None = None

    def _open(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        storage = make_storage(self.spec.storage, child=True)
        study = optuna.load_study(
            study_name=self.spec.study_name,
            storage=storage,
            sampler=optuna.samplers.RandomSampler(),
            pruner=make_pruner(self.spec.pruner, active=True),
        )
        return optuna.Trial(study, self.spec.trial_id)

    def __call__(self, step: int, eval_loss: float) -> bool:
        value = float(eval_loss)
        self.curve.append([int(step), value])
        if not self.spec.pruning or not math.isfinite(value) or self._error:
            return False
        try:
            if self._trial is None:
                self._trial = self._open()
            self._trial.report(value, int(step))
            if self._trial.should_prune():
                self.pruned_at = int(step)
                return True
        # broad on purpose: a storage error while reporting must not kill the trial; said and kept
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            print(
                f"vramsweep: trial {self.spec.number}: pruning report failed ({self._error}); "
                "continuing without pruning",
                file=sys.stderr,
            )
        return False


def finalize(
    result: dict[str, Any],
    spec: TrialSpec,
    *,
    wall_s: float,
    curve: list | None = None,
    pruned_at: int | None = None,
) -> tuple[dict[str, Any], Any]:
    """Add the sweep's meta (design, retry, curve) and the Optuna outcome to a normalised result."""

    meta = result["meta"]
    meta["design"] = spec.design
    if spec.retry_of is not None:
        meta["retry_of"] = spec.retry_of
    if not isinstance(meta.get("wall_s"), int | float):
        meta["wall_s"] = round(wall_s, 3)
    if curve:
        meta.setdefault("eval_curve", curve)
    if pruned_at is not None:
        meta.setdefault("pruned_at_step", pruned_at)
    if spec.log_path and os.path.exists(spec.log_path):
        meta["log_path"] = os.path.basename(spec.log_path)
    if spec.gpu and not isinstance(meta.get("gpu_share"), dict):
        meta["gpu_share"] = provisional_share(spec.gpu)
    outcome = classify(result, spec.objectives, budget_gib=spec.budget_gib)
    meta["optuna"] = outcome.to_dict() | {"trial_number": spec.number, "study": spec.study_name}
    return result, outcome


def provisional_share(gpu: dict[str, Any]) -> dict[str, Any]:
    """``meta.gpu_share`` as the trial process writes it: ``shared`` is true wherever another trial *could*
    have run beside it (its GPU holds more than one, and it did not hold it alone), ``exact`` false. The
    sweeper rewrites it with who actually shared (:func:`.workers.mark_share`); a result whose sweeper died
    first keeps this conservative mark."""
    per_gpu, alone = int(gpu.get("per_gpu") or 1), gpu.get("alone")
    return {
        "device": str(gpu.get("device")),
        "trials_per_gpu": per_gpu,
        "alone": alone,
        "shared": per_gpu > 1 and not alone,
        "with": None,
        "exact": False,
    }


def preflight_result(spec: TrialSpec, cfg: Any) -> dict[str, Any] | None:
    """``sweep.preflight``: a result with status ``infeasible_estimate`` when the memory estimate of the
    point (``cfg``, composed from ``spec.overrides``) exceeds ``hardware.budget_gib`` (+10 % margin), else
    ``None`` (run the trial)."""
    from omegaconf import OmegaConf

    try:
        from vramsweep.estimate import preflight
    except ImportError:
        return None
    if float(cfg.hardware.budget_gib or 0.0) <= 0:
        return None
    fits, est = preflight(cfg)
    if fits:
        return None
    res = new_result(
        status=Status.INFEASIBLE_ESTIMATE.value,
        sweep=spec.sweep_name,
        trial=spec.number,
        overrides=list(spec.overrides),
        reason=(
            f"estimated peak {est[M.PEAK_MEMORY_BYTES] / GIB:.2f} GiB > hardware.budget_gib="
            f"{float(cfg.hardware.budget_gib):g} (+10% margin): not run (sweep.preflight=true)"
        ),
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    res["estimate"] = est
    return res


def execute(spec: TrialSpec) -> dict[str, Any]:
    """Run the trial function and write the result JSON. Never raises (failures become statuses)."""

    t0 = time.perf_counter()
    reporter = StorageReporter(spec)
    try:
        cfg = raw = None
        if spec.preflight:
            with refused_point():
                cfg = compose(spec.overrides, rules="none")  # the trial gets this config: composed once
                raw = preflight_result(spec, cfg)
        if raw is None:
            fn = resolve_fn(spec.trial_fn)
            raw = fn(
                list(spec.overrides),
                sweep=spec.sweep_name,
                trial=spec.number,
                reporter=reporter,
                design=spec.design,
                **({"cfg": cfg} if cfg is not None and takes_cfg(fn) else {}),
            )
        result = normalise_result(raw, sweep=spec.sweep_name, trial=spec.number, overrides=spec.overrides)
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        result = result_from_exception(
            RuntimeError(f"trial called sys.exit({exc.code})"),
            sweep=spec.sweep_name,
            trial=spec.number,
            overrides=spec.overrides,
        )
    except BaseException as exc:  # failures are data
        result = result_from_exception(
            exc, sweep=spec.sweep_name, trial=spec.number, overrides=spec.overrides
        )
        del exc  # free the traceback's frames (and whatever tensors they hold) before writing
    result, _ = finalize(
        result, spec, wall_s=time.perf_counter() - t0, curve=reporter.curve, pruned_at=reporter.pruned_at
    )
    return _write_or_disk_full(result, spec)


def _write_or_disk_full(result: dict[str, Any], spec: TrialSpec) -> dict[str, Any]:
    """Write the result JSON; on a full disk the trial ends ``error`` with the one-line reason
    ``no space left on device: <path>`` (told to Optuna by the sweeper; the JSON cannot be written)."""

    try:
        write_result(spec.result_path, result)
    except OSError as exc:
        full = disk_full_reason(exc, spec.result_path)
        if full is None:
            raise
        result["status"], result["reason"] = Status.ERROR.value, full
        result, _ = finalize(result, spec, wall_s=float(result["meta"].get("wall_s") or 0.0))
    return result


def _die_with_parent(parent_pid: int, parent_ctime: float | None) -> None:
    """SIGKILL this process when its parent dies (Linux), plus a watchdog on the sweeper's pid."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        import psutil

        while True:
            time.sleep(1.0)
            try:
                proc = psutil.Process(parent_pid)
                if parent_ctime is not None and abs(proc.create_time() - parent_ctime) > 1e-3:
                    raise psutil.NoSuchProcess(parent_pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise psutil.NoSuchProcess(parent_pid)
            except psutil.Error:
                os.kill(os.getpid(), signal.SIGKILL)

    if parent_pid:
        threading.Thread(target=watch, name="vramsweep-watchdog", daemon=True).start()


SPEC_ENV = "VRAMSWEEP_TRIAL_SPEC"


def forked_after_cuda_init() -> bool:
    """True in a process forked from a parent that had initialised CUDA (torch marks it a "bad fork")."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda._is_in_bad_fork())
    # broad on purpose: a torch without a working CUDA runtime is not in a bad fork
    except Exception:
        return False


def probe_fork(cuda: bool) -> dict[str, Any]:
    """Whether this (forked) process can use CUDA, tested for real rather than inferred from the parent.

    A parent can poison its forks without ``torch.cuda.is_initialized()`` ever saying so: a device-count
    query without NVML (``cudaGetDeviceCount`` marks the fork bad), or Triton / another library touching
    the driver. So the child asks torch whether it is a bad fork and, on a CUDA host, initialises CUDA
    itself (``torch.cuda.init()``), which fails in a fork of a process that held the driver.
    """
    out: dict[str, Any] = {"pid": os.getpid(), "bad_fork": forked_after_cuda_init(), "cuda_init": None}
    if cuda:
        try:
            import torch

            torch.cuda.init()
            out["cuda_init"] = "ok"
        # broad on purpose: the probe reports whatever CUDA init raised, by type and first line
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else ""
            if (
                "not compiled with CUDA" in text
            ):  # a CPU-only torch on a host flagged as CUDA: nothing to test
                out["cuda_init"], out["note"] = None, text
            else:
                out["cuda_init"] = f"{type(exc).__name__}: {text}"
    out["usable"] = not out["bad_fork"] and out["cuda_init"] in (None, "ok")
    return out


def probe_fork_to(path: str, cuda: bool) -> None:
    """Target of the fork server's warm-up process: :func:`probe_fork`, written as JSON to ``path``."""
    atomic_write_json(path, probe_fork(cuda))


def save_spec(spec: TrialSpec, path: str) -> None:
    """Write a spec as JSON (launcher isolation: the job finds it through ``VRAMSWEEP_TRIAL_SPEC``)."""
    import dataclasses

    data = dataclasses.asdict(spec)
    if not isinstance(spec.pruner, str | dict):  # an instantiated pruner: rebuilt from its class (defaults)
        data["pruner"] = {"_target_": f"{type(spec.pruner).__module__}.{type(spec.pruner).__qualname__}"}
    atomic_write_json(path, data)


def load_spec(path: str) -> TrialSpec:
    with open(path) as fh:
        data = json.load(fh)
    data["objectives"] = [Objective(**o) for o in data.get("objectives") or []]
    return TrialSpec(**data)


def _redirect_output(path: str) -> None:
    """Send this process's stdout/stderr (fds 1 and 2: Python, C++ and tqdm alike) to the trial's log."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child_main(spec: TrialSpec) -> None:
    """Entry point of a trial process."""
    _die_with_parent(spec.parent_pid, spec.parent_ctime)
    if spec.env:
        os.environ.clear()
        os.environ.update(spec.env)
    os.environ[MARKER_ENV] = marker_path(spec.result_path)  # the host pool's progress (record/hostmem.py)
    with contextlib.suppress(OSError):
        os.chdir(spec.cwd)
    if spec.log_path:
        _redirect_output(spec.log_path)
    if forked_after_cuda_init():
        _write_bad_fork_result(spec)
        return
    execute(spec)


def _failed_result(spec: TrialSpec, status: Status, reason: str) -> dict[str, Any]:
    """A normalised result for ``spec``'s trial that ends with ``status`` and ``reason`` (not yet
    finalised)."""
    ids = {"sweep": spec.sweep_name, "trial": spec.number, "overrides": spec.overrides}
    return normalise_result(new_result(status=status.value, reason=reason, **ids), **ids)


def _write_bad_fork_result(spec: TrialSpec) -> None:
    reason = (
        "this trial process was forked from a process that had initialised CUDA, so it cannot use "
        "the GPU: set hydra.sweeper.isolation=spawn, or remove the module that initialises CUDA "
        "from hydra.sweeper.preload"
    )
    res, _ = finalize(_failed_result(spec, Status.ERROR, reason), spec, wall_s=0.0)
    write_result(spec.result_path, res)


def _load_child_result(path: str) -> dict[str, Any] | None:
    try:
        data = read_json_file(path)  # a FIFO is refused, not read (it would block the sweeper)
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance((data.get("meta") or {}).get("optuna"), dict):
        return data
    return None


def parent_side_result(
    spec: TrialSpec,
    reason: str,
    wall_s: float,
    *,
    status: Status = Status.ERROR,
    host_pool: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result the sweeper writes for a trial process that died without one (``status`` ``error``, or
    ``host_oom`` for an OOM kill while its host pool grew; ``host_pool``: the marker it left behind, kept
    as ``meta.host_memory.at_death``)."""

    res = _failed_result(spec, status, reason)
    if host_pool is not None:
        res["meta"]["host_memory"] = {"at_death": host_pool}
    res, _ = finalize(res, spec, wall_s=wall_s)
    if spec.log_path and os.path.exists(spec.log_path):
        with open(spec.log_path, errors="replace") as fh:
            fh.seek(max(0, os.path.getsize(spec.log_path) - 4000))
            res["meta"]["log_tail"] = fh.read()[-2000:]
    return _write_or_disk_full(res, spec)  # a child that died on a full disk: this write says so


def report_from_json(result: dict[str, Any], wall_s: float, exitcode: int | None) -> RunReport:
    return RunReport(result, Outcome.from_dict(result["meta"]["optuna"]), wall_s, exitcode)
