"""Trial isolation: one fresh process per trial, forked from a warm fork server.

* ``fork`` (default): ``multiprocessing`` fork server whose zygote has imported torch, transformers,
  peft and the trial module once, so a trial starts in ~0.1-0.3 s instead of ~6-10 s of imports
  (``python bench/trial_overhead.py`` measures it). The sweeper process never imports
  torch, so CUDA is never initialised in the parent. On a CUDA host the server leaves out the modules
  that initialise CUDA on import (:data:`CUDA_INIT_MODULES`: peft imports bitsandbytes, which queries the
  device's compute capability); the zygote reports whether CUDA got initialised anyway, and the runner
  then refuses to fork from it and starts trials by spawn instead (:meth:`ProcessRunner.start`). A trial
  process that finds itself forked after CUDA was initialised fails with a clear reason (never a silent
  CPU run, never "Cannot re-initialize CUDA").
* ``spawn``: a cold interpreter per trial (for libraries that dislike fork).
* ``inprocess``: the trial runs in the sweeper process (debugging; no kill or timeout protection).

What runs inside the trial process (the spec, the result JSON, pruning reports) is :mod:`.trialproc`. A
child that dies without a result JSON (kill -9, segfault, kernel OOM killer, timeout) gets an ``error``
result written by the parent, with the signal as the reason; a SIGKILL while the child's host-pool marker
says its pinned pool was growing is ``host_oom`` (:func:`.outcome.died_status`).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramsweep.config.compose import hydra_state
from vramsweep.record.hostmem import marker_path, read_marker, remove_marker
from vramsweep.record.status import Status
from vramsweep.sweeper.outcome import died_status, signal_reason
from vramsweep.sweeper.trialproc import (
    RunReport,
    TrialSpec,
    _load_child_result,
    child_main,
    execute,
    parent_side_result,
    probe_fork_to,
    report_from_json,
)

#: Modules that initialise CUDA when imported on a GPU host (bitsandbytes 0.50 calls
#: ``torch.cuda.get_device_capability()`` at import; peft imports bitsandbytes when it is installed; Unsloth
#: and Liger probe the device). A fork server on a CUDA host never preloads them.
CUDA_INIT_MODULES = (
    "bitsandbytes",
    "peft",
    "unsloth",
    "unsloth_zoo",
    "liger_kernel",
    "trl",
    "torchao",  # in the GPU bundle: transformers' torchao quantizer imports it when it is importable
    "cut_cross_entropy",
    "xformers",
    "flash_attn",
    "deepspeed",
)
#: What a CUDA host's fork server preloads instead: the heavy, CUDA-free parts peft would have pulled in
#: (most of peft's import time), so a trial only pays for peft's own modules and bitsandbytes.
CUDA_SAFE_EXTRAS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto", "accelerate")
#: CUDA-free modules that import a :data:`CUDA_INIT_MODULES` member whenever it is importable: transformers'
#: quantizer registry (``quantizers/auto.py`` -> ``quantizer_torchao.py``) imports torchao when it is
#: installed, and torchao 0.18's ``prototype.mx_formats.kernels`` calls ``torch.cuda.get_device_capability()``
#: at import (the GPU bundle ships torchao). On a CUDA host where one of the right-hand modules is
#: importable, the left-hand one is left out of the preload too (the trial imports it after the fork).
PULLS_IN = {
    "transformers.modeling_utils": ("torchao",),
    "transformers.models.auto.modeling_auto": ("torchao",),
}


def importable(name: str) -> bool:
    """Whether top-level module ``name`` could be imported here, found without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


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
    CUDA-free :data:`CUDA_SAFE_EXTRAS` added in their place (when the list asked for one of them); a module
    of :data:`PULLS_IN` whose CUDA-initialising import is importable on this host is left out as well.
    """
    if not (cuda_host() if cuda is None else cuda):
        return list(preload), []
    pulls = {m for m, deps in PULLS_IN.items() if any(importable(d) for d in deps)}

    def unsafe(name: str) -> bool:
        return name in pulls or any(name == m or name.startswith(m + ".") for m in CUDA_INIT_MODULES)

    candidates = list(preload)
    if any(unsafe(m) for m in preload):
        candidates += [m for m in CUDA_SAFE_EXTRAS if m not in candidates]
    return [m for m in candidates if not unsafe(m)], [m for m in candidates if unsafe(m)]


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
        #: the warm-up child's report (:func:`.trialproc.probe_fork`) and the CUDA-initialising modules the
        #: preload pulled in anyway (e.g. torchao through transformers.modeling_utils)
        self.fork_probe: dict[str, Any] = {}
        self.pulled_in: list[str] = []
        self._live: set[Any] = set()
        #: set by :meth:`kill_all` (Ctrl-C): a trial started after it is killed at once, so a trial whose
        #: process was being started while Ctrl-C arrived cannot outlive the sweep
        self._killing = False
        self._live_lock = threading.Lock()

    def start(self) -> None:
        self._killing = False
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
        probe_path = status_path + ".probe"
        cuda = cuda_host()
        try:
            self.ctx.set_forkserver_preload(["vramsweep.sweeper.zygote"])
            forkserver.ensure_running()
            # The server imports the preload list before it accepts its first client: wait for it here, so
            # trial 0 is not charged for the warm-up. The warm-up child probes whether a fork can use CUDA.
            probe = self.ctx.Process(target=probe_fork_to, args=(probe_path, cuda), name="vramsweep-warmup")
            probe.start()
            probe.join()
            self.zygote = _read_json(status_path)
            self.fork_probe = _read_json(probe_path) or {"usable": False, "exitcode": probe.exitcode}
        finally:
            os.environ.pop("VRAMSWEEP_ZYGOTE_STATUS", None)
            for path in (status_path, probe_path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.pulled_in = sorted(
            set(self.zygote.get("top_level_modules") or []) & set(CUDA_INIT_MODULES) - set(preload)
        )
        _SERVER_STATE = dict(self.zygote)
        reason = fork_unusable_reason(self.zygote, self.fork_probe, self.pulled_in)
        if reason is not None:
            self.fallback_reason = (
                f"{reason}; a trial forked from the fork server could not use the GPU, so every trial starts "
                "in a fresh interpreter (spawn) instead"
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
        with self._live_lock:
            self._killing = True
            live = list(self._live)
        for proc in live:
            # broad on purpose: a process that ended meanwhile cannot be killed; the others are
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
        marker = marker_path(spec.result_path)
        remove_marker(marker)
        Path(spec.result_path).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        proc = self.ctx.Process(target=child_main, args=(spec,), name=f"vramsweep-trial-{spec.number}")
        with self._live_lock:  # kill_all() either sees this process or has set _killing before it started
            proc.start()
            self._live.add(proc)
            if self._killing:
                proc.kill()
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
        # broad on purpose: closing a finished process handle frees resources; best effort
        with contextlib.suppress(Exception):
            proc.close()
        data = _load_child_result(spec.result_path)
        pool = read_marker(marker)
        remove_marker(marker)
        if data is not None and not timed_out:
            return report_from_json(data, wall, exitcode)
        status, killed_by_us = Status.ERROR, timed_out or self._killing
        if timed_out:
            reason = f"timeout: trial ran longer than hydra.sweeper.timeout_s={timeout_s:g} s and was killed"
        elif killed_by_us:
            reason = signal_reason(exitcode) + " (the sweep was interrupted)"
        else:
            status, reason = died_status(exitcode, pool)
        res = parent_side_result(spec, reason, wall, status=status, host_pool=pool)
        return report_from_json(res, wall, exitcode)


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

        with hydra_state():  # the sweeper's Hydra app state survives the trial's own composes
            result = execute(spec)
        return report_from_json(result, time.perf_counter() - t0, 0)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def fork_unusable_reason(zygote: dict, probe: dict, pulled_in: list[str]) -> str | None:
    """Why a process forked from this server cannot use CUDA, or None when it can."""
    hint = f" (the preload pulled in {', '.join(pulled_in)})" if pulled_in else ""
    if zygote.get("cuda_initialised"):
        culprit = zygote.get("cuda_initialised_by") or "the preload"
        return f"importing {culprit} in the fork server initialised CUDA{hint}"
    if probe.get("bad_fork"):
        return (
            "a process forked from the fork server is a bad fork for torch: the preload touched CUDA without "
            f"initialising it (e.g. a device count without NVML){hint}"
        )
    if probe.get("cuda_init") not in (None, "ok"):
        return (
            f"torch.cuda.init() failed in a process forked from the fork server: {probe['cuda_init']}{hint}"
        )
    if not probe.get("usable", False):
        return f"the fork server's warm-up child died before reporting (exit code {probe.get('exitcode')})"
    return None


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
