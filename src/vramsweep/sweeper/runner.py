"""Trial isolation: one fresh process per trial, forked from a warm fork server.

* ``fork`` (default): ``multiprocessing`` fork server whose zygote has imported torch, transformers,
  peft and the trial module once, so a trial starts in ~0.1-0.3 s instead of ~6-10 s of imports
  (``python -m vramsweep.sweeper.runner --overhead`` measures it). The sweeper process never imports
  torch, so CUDA is never initialised in the parent. On a CUDA host the server leaves out the modules
  that initialise CUDA on import (:data:`CUDA_INIT_MODULES`: peft imports bitsandbytes, which queries the
  device's compute capability); the zygote reports whether CUDA got initialised anyway, and the runner
  then refuses to fork from it and starts trials by spawn instead (:meth:`ProcessRunner.start`). A trial
  process that finds itself forked after CUDA was initialised fails with a clear reason (never a silent
  CPU run, never "Cannot re-initialize CUDA").
* ``spawn``: a cold interpreter per trial (for libraries that dislike fork).
* ``inprocess``: the trial runs in the sweeper process (debugging; no kill or timeout protection).

The child writes the result JSON itself (atomic), *then* the parent tells Optuna, so a sweeper killed
in between loses nothing: the next run tells the study from the JSON. A child that dies without a
JSON (kill -9, segfault, kernel OOM killer, timeout) gets an ``error`` result written by the parent,
with the signal as the reason. Trial processes die with their sweeper (``PR_SET_PDEATHSIG`` plus a
watchdog), so no orphan can write a result for a trial the next run has already retried.
"""

from __future__ import annotations

import abc
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

from vramsweep.sweeper.settings import Objective


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


@dataclass
class RunReport:
    """What the parent learned about one trial run."""

    result: dict[str, Any]
    outcome: Any  # outcome.Outcome
    wall_s: float
    exitcode: int | None


def resolve_fn(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def takes_cfg(fn: Callable[..., Any]) -> bool:
    """Whether a trial function accepts an already composed config (``cfg=``) next to its overrides."""
    import inspect

    try:
        return "cfg" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


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

        from vramsweep.sweeper.samplers import make_pruner
        from vramsweep.sweeper.storage import make_storage

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
    from vramsweep.sweeper.outcome import classify

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
    outcome = classify(result, spec.objectives, budget_gib=spec.budget_gib)
    meta["optuna"] = outcome.to_dict() | {"trial_number": spec.number, "study": spec.study_name}
    return result, outcome


def preflight_result(spec: TrialSpec, cfg: Any) -> dict[str, Any] | None:
    """``sweep.preflight``: a result with status ``infeasible_estimate`` when the memory estimate of the
    point (``cfg``, composed from ``spec.overrides``) exceeds ``hardware.budget_gib`` (+10 % margin), else
    ``None`` (run the trial)."""
    from omegaconf import OmegaConf

    from vramsweep.record.result import new_result
    from vramsweep.record.units import GIB

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
        status="infeasible_estimate",
        sweep=spec.sweep_name,
        trial=spec.number,
        overrides=list(spec.overrides),
        reason=(
            f"estimated peak {est['peak_memory_bytes'] / GIB:.2f} GiB > hardware.budget_gib="
            f"{float(cfg.hardware.budget_gib):g} (+10% margin): not run (sweep.preflight=true)"
        ),
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    res["estimate"] = est
    return res


def execute(spec: TrialSpec) -> dict[str, Any]:
    """Run the trial function and write the result JSON. Never raises (failures become statuses)."""
    from vramsweep.record.result import write_result
    from vramsweep.sweeper.outcome import normalise_result, result_from_exception

    t0 = time.perf_counter()
    reporter = StorageReporter(spec)
    try:
        cfg = raw = None
        if spec.preflight:
            from vramsweep.config.compose import compose

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
    write_result(spec.result_path, result)
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

#: Modules that initialise CUDA when imported on a GPU host (bitsandbytes 0.50 calls
#: ``torch.cuda.get_device_capability()`` at import; peft imports bitsandbytes when it is installed; Unsloth
#: and Liger probe the device). A fork server on a CUDA host never preloads them.
CUDA_INIT_MODULES = ("bitsandbytes", "peft", "unsloth", "unsloth_zoo", "liger_kernel", "trl")
#: What a CUDA host's fork server preloads instead: the heavy, CUDA-free parts peft would have pulled in
#: (most of peft's import time), so a trial only pays for peft's own modules and bitsandbytes.
CUDA_SAFE_EXTRAS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto", "accelerate")


def cuda_host() -> bool:
    """Whether this machine has an NVIDIA GPU visible to this process, decided without touching CUDA.

    ``VRAMSWEEP_CUDA_HOST=0|1`` overrides (tests); otherwise an NVIDIA driver with at least one GPU
    (``/proc/driver/nvidia/gpus`` or ``/dev/nvidia0``) and ``CUDA_VISIBLE_DEVICES`` not empty/-1.
    """
    forced = os.environ.get("VRAMSWEEP_CUDA_HOST")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    with contextlib.suppress(OSError):
        if gpus.is_dir() and any(gpus.iterdir()):
            return True
    return Path("/dev/nvidia0").exists()


def effective_preload(preload: list[str], *, cuda: bool | None = None) -> tuple[list[str], list[str]]:
    """The fork server's preload for this host: ``(modules, left_out)``.

    On a CUDA host the modules of :data:`CUDA_INIT_MODULES` (and their submodules) are left out and the
    CUDA-free :data:`CUDA_SAFE_EXTRAS` added in their place (when the list asked for one of them).
    """
    if not (cuda_host() if cuda is None else cuda):
        return list(preload), []

    def unsafe(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in CUDA_INIT_MODULES)

    keep = [m for m in preload if not unsafe(m)]
    left_out = [m for m in preload if unsafe(m)]
    if left_out:
        keep += [m for m in CUDA_SAFE_EXTRAS if m not in keep]
    return keep, left_out


def forked_after_cuda_init() -> bool:
    """True in a process forked from a parent that had initialised CUDA (torch marks it a "bad fork")."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda._is_in_bad_fork())
    except Exception:
        return False


def save_spec(spec: TrialSpec, path: str) -> None:
    """Write a spec as JSON (launcher isolation: the job finds it through ``VRAMSWEEP_TRIAL_SPEC``)."""
    import dataclasses

    from vramsweep.record.result import atomic_write_json

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
    with contextlib.suppress(OSError):
        os.chdir(spec.cwd)
    if spec.log_path:
        _redirect_output(spec.log_path)
    if forked_after_cuda_init():
        _write_bad_fork_result(spec)
        return
    execute(spec)


def _write_bad_fork_result(spec: TrialSpec) -> None:
    from vramsweep.record.result import new_result, write_result
    from vramsweep.sweeper.outcome import normalise_result

    res = normalise_result(
        new_result(
            status="error",
            reason=(
                "this trial process was forked from a process that had initialised CUDA, so it cannot use "
                "the GPU: set hydra.sweeper.isolation=spawn, or remove the module that initialises CUDA "
                "from hydra.sweeper.preload"
            ),
            sweep=spec.sweep_name,
            trial=spec.number,
            overrides=spec.overrides,
        ),
        sweep=spec.sweep_name,
        trial=spec.number,
        overrides=spec.overrides,
    )
    res, _ = finalize(res, spec, wall_s=0.0)
    write_result(spec.result_path, res)


def _load_child_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance((data.get("meta") or {}).get("optuna"), dict):
        return data
    return None


def parent_side_result(spec: TrialSpec, reason: str, wall_s: float) -> dict[str, Any]:
    """The result the sweeper writes for a trial process that died without one."""
    from vramsweep.record.result import new_result, write_result
    from vramsweep.sweeper.outcome import normalise_result

    res = normalise_result(
        new_result(
            status="error", reason=reason, sweep=spec.sweep_name, trial=spec.number, overrides=spec.overrides
        ),
        sweep=spec.sweep_name,
        trial=spec.number,
        overrides=spec.overrides,
    )
    res, _ = finalize(res, spec, wall_s=wall_s)
    if spec.log_path and os.path.exists(spec.log_path):
        with open(spec.log_path, errors="replace") as fh:
            fh.seek(max(0, os.path.getsize(spec.log_path) - 4000))
            res["meta"]["log_tail"] = fh.read()[-2000:]
    write_result(spec.result_path, res)
    return res


def report_from_json(result: dict[str, Any], wall_s: float, exitcode: int | None) -> RunReport:
    from vramsweep.sweeper.outcome import Outcome

    return RunReport(result, Outcome.from_dict(result["meta"]["optuna"]), wall_s, exitcode)


class Runner(abc.ABC):
    """Base: ``start()`` once, ``run(spec)`` per trial (from any thread), ``stop()`` at the end."""

    name = "base"

    def start(self) -> None:  # noqa: B027 - optional hook
        pass

    def stop(self) -> None:  # noqa: B027 - optional hook
        pass

    @abc.abstractmethod
    def run(
        self,
        spec: TrialSpec,
        *,
        tick: Callable[[], None] | None = None,
        tick_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> RunReport:
        """Run one trial to its end and report its outcome."""

    def kill_all(self) -> None:  # noqa: B027 - optional hook
        """Stop every running trial now (Ctrl-C)."""


class ProcessRunner(Runner):
    """A fresh process per trial, from a warm fork server (``fork``) or a cold interpreter (``spawn``)."""

    def __init__(self, method: str = "forkserver", preload: list[str] | None = None):
        import multiprocessing

        self.method = method
        self.name = "fork" if method == "forkserver" else method
        self.preload = list(preload or [])
        self.ctx = multiprocessing.get_context(method)
        self.warmup_s: float | None = None
        #: what the fork server actually preloaded / left out / its zygote's state, and why a fork server
        #: was refused (``None`` when it serves trials)
        self.server_preload: list[str] = []
        self.left_out: list[str] = []
        self.zygote: dict[str, Any] = {}
        self.fallback_reason: str | None = None
        self._live: set[Any] = set()

    def start(self) -> None:
        if self.method != "forkserver":
            return
        import tempfile
        from multiprocessing import forkserver

        global _SERVER_PRELOAD, _SERVER_STATE
        t0 = time.perf_counter()
        preload, self.left_out = effective_preload(self.preload)
        if _SERVER_PRELOAD == preload and _forkserver_alive() and _SERVER_STATE is not None:
            self.warmup_s = 0.0  # a server with the same preload is already warm (several sweeps per process)
            self.server_preload, self.zygote = list(preload), dict(_SERVER_STATE)
            return
        _stop_forkserver()
        _SERVER_PRELOAD = list(preload)
        self.server_preload = list(preload)
        os.environ["VRAMSWEEP_PRELOAD"] = ",".join(preload)
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        fd, status_path = tempfile.mkstemp(prefix="vramsweep-zygote-", suffix=".json")
        os.close(fd)
        os.unlink(status_path)
        os.environ["VRAMSWEEP_ZYGOTE_STATUS"] = status_path
        try:
            self.ctx.set_forkserver_preload(["vramsweep.sweeper.zygote"])
            forkserver.ensure_running()
            # The server imports the preload list before it accepts its first client: wait for it here, so
            # trial 0 is not charged for the warm-up.
            probe = self.ctx.Process(target=_noop, name="vramsweep-warmup")
            probe.start()
            probe.join()
            try:
                with open(status_path) as fh:
                    self.zygote = json.load(fh)
            except (OSError, ValueError):
                self.zygote = {}
        finally:
            os.environ.pop("VRAMSWEEP_ZYGOTE_STATUS", None)
            with contextlib.suppress(OSError):
                os.unlink(status_path)
        _SERVER_STATE = dict(self.zygote)
        if self.zygote.get("cuda_initialised"):
            culprit = self.zygote.get("cuda_initialised_by") or "the preload"
            self.fallback_reason = (
                f"importing {culprit} in the fork server initialised CUDA; a trial forked from it could not "
                "use the GPU, so every trial starts in a fresh interpreter (spawn) instead. Remove it from "
                "hydra.sweeper.preload to get warm starts back"
            )
            print(f"vramsweep: warning: {self.fallback_reason}", file=sys.stderr)
            _stop_forkserver()
            import multiprocessing

            self.method, self.name = "spawn", "spawn"
            self.ctx = multiprocessing.get_context("spawn")
        self.warmup_s = time.perf_counter() - t0

    def stop(self) -> None:
        """Nothing to do: the fork server stays warm for the next sweep in this process and exits with it."""

    def kill_all(self) -> None:  # noqa: B027 - optional hook
        for proc in list(self._live):
            with contextlib.suppress(Exception):
                proc.kill()

    def run(
        self,
        spec: TrialSpec,
        *,
        tick: Callable[[], None] | None = None,
        tick_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> RunReport:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spec.result_path)
        Path(spec.result_path).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        proc = self.ctx.Process(target=child_main, args=(spec,), name=f"vramsweep-trial-{spec.number}")
        proc.start()
        self._live.add(proc)
        timed_out = False
        while True:
            proc.join(tick_s)
            if proc.exitcode is not None:
                break
            if tick is not None:
                tick()
            if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                timed_out = True
                proc.kill()
                proc.join()
                break
        wall = time.perf_counter() - t0
        exitcode = proc.exitcode
        self._live.discard(proc)
        with contextlib.suppress(Exception):
            proc.close()
        data = _load_child_result(spec.result_path)
        if data is not None and not timed_out:
            return report_from_json(data, wall, exitcode)
        if timed_out:
            reason = f"timeout: trial ran longer than hydra.sweeper.timeout_s={timeout_s:g} s and was killed"
        else:
            from vramsweep.sweeper.outcome import signal_reason

            reason = signal_reason(exitcode)
        return report_from_json(parent_side_result(spec, reason, wall), wall, exitcode)


class InProcessRunner(Runner):
    """Run trials in the sweeper process (``hydra.sweeper.isolation=inprocess``; debugging only)."""

    name = "inprocess"

    def run(
        self,
        spec: TrialSpec,
        *,
        tick: Callable[[], None] | None = None,
        tick_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> RunReport:
        Path(spec.result_path).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        from vramsweep.config.compose import hydra_state

        with hydra_state():  # the sweeper's Hydra app state survives the trial's own composes
            result = execute(spec)
        return report_from_json(result, time.perf_counter() - t0, 0)


def _noop() -> None:
    """Target of the fork server's warm-up process."""


_SERVER_PRELOAD: list[str] | None = None
_SERVER_STATE: dict[str, Any] | None = None


def _forkserver_alive() -> bool:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return False
    import psutil

    try:  # never waitpid() here: multiprocessing reaps its own server
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_forkserver() -> None:
    global _SERVER_PRELOAD, _SERVER_STATE
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()
    _SERVER_PRELOAD = None
    _SERVER_STATE = None


def make_runner(isolation: str, preload: list[str]) -> Runner:
    if isolation == "inprocess":
        return InProcessRunner()
    if isolation == "spawn":
        return ProcessRunner("spawn")
    return ProcessRunner("forkserver", preload)


def noop_trial(overrides: list[str], **_: Any) -> dict[str, Any]:
    """Imports what a real trial imports (``VRAMSWEEP_PRELOAD``) and returns ``ok`` at once (overhead probe)."""
    from vramsweep.record.result import new_result

    for name in [m for m in os.environ.get("VRAMSWEEP_PRELOAD", "").split(",") if m]:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    res = new_result(status="ok", overrides=list(overrides))
    res["metrics"]["eval_loss"] = 1.0
    return res


def measure_overhead(
    isolation: str = "fork", n: int = 5, preload: list[str] | None = None, workdir: str | None = None
) -> dict[str, Any]:
    """Per-trial fixed cost: wall time of a no-op trial, as the sweeper sees it (start to result told).

    Returns:
        ``{"isolation", "n", "warmup_s", "per_trial_s": [...], "median_s"}``.
    """
    import statistics
    import tempfile

    from vramsweep.sweeper.settings import DEFAULT_PRELOAD

    modules = list(DEFAULT_PRELOAD if preload is None else preload)
    os.environ["VRAMSWEEP_PRELOAD"] = ",".join(modules)  # what the no-op trial imports (free when preloaded)
    runner = make_runner(isolation, modules)
    runner.start()
    times: list[float] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            for i in range(n):
                spec = TrialSpec(
                    number=i,
                    trial_id=-1,
                    slot=i,
                    overrides=[],
                    result_path=f"{tmp}/{i:04d}.json",
                    sweep_name="overhead",
                    study_name="overhead",
                    storage="",
                    objectives=[],
                    trial_fn="vramsweep.sweeper.runner:noop_trial",
                    parent_pid=os.getpid(),
                    env=dict(os.environ),
                    cwd=os.getcwd(),
                )
                t0 = time.perf_counter()
                runner.run(spec, tick_s=0.05)
                times.append(time.perf_counter() - t0)
        finally:
            runner.stop()
    return {
        "isolation": getattr(runner, "name", isolation),
        "n": n,
        "cuda_host": cuda_host(),
        "preload": getattr(runner, "server_preload", None) or None,
        "left_out": getattr(runner, "left_out", None) or None,
        "fallback_reason": getattr(runner, "fallback_reason", None),
        "warmup_s": getattr(runner, "warmup_s", None),
        "per_trial_s": [round(t, 4) for t in times],
        "median_s": round(statistics.median(times), 4),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m vramsweep.sweeper.runner --overhead [--n 5] [--isolation fork spawn]``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overhead", action="store_true", help="measure the per-trial fixed cost")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--isolation", nargs="+", default=["fork", "spawn"])
    args = ap.parse_args(argv)
    if not args.overhead:
        ap.print_help()
        return 0
    for iso in args.isolation:
        print(json.dumps(measure_overhead(iso, args.n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
