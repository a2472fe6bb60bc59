"""CUDA measurement: allocator peaks after a reset at trial start, NVML process peak sampled in a thread,
fragmentation (reserved - allocated), per-phase peaks, and the per-process memory cap that emulates a
smaller card (``hardware=rtx4080_16gb`` on an 80/141 GB GPU).

Definitions (docs/CONTRACTS.md, metrics):

* ``cuda_max_allocated_bytes`` / ``cuda_max_reserved_bytes``: ``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved`` of the measured phase (``train`` when the trial marks phases, else the whole
  trial since :meth:`CudaMemoryMonitor.start`). ``peak_memory_bytes`` is the reserved figure
  (``memory_kind: cuda_reserved``): what the card has to hold, what the cap compares against.
* ``cuda_fragmentation_bytes`` = reserved - allocated at the peaks: memory the caching allocator holds
  but no tensor uses (fragmentation and cache). ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF``) is
  recorded in ``meta`` because ``expandable_segments:True`` changes it.
* ``nvml_process_peak_bytes``: the largest ``usedGpuMemory`` NVML reported for this process while the
  trial ran (includes the CUDA context, cuBLAS workspaces and memory outside PyTorch's allocator, e.g.
  bitsandbytes paged optimizers' unified memory). In containers whose PID namespace hides the process
  from NVML, only ``nvml_device_used_peak_bytes`` (whole device, all processes) is available.
* ``memory_breakdown_bytes``: ``params``/``grads``/``optimizer`` from the trial's state tensors,
  ``activations`` = peak allocated - those (everything else alive at the peak), ``other`` = reserved -
  allocated. The five add up to the reserved peak whenever the peak allocated >= the state bytes.

Only imported when ``hardware.device=cuda`` (never in a sweeper parent: no CUDA initialisation there).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from omegaconf import DictConfig

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.units import GIB

#: NVML's "not available" sentinel for per-process memory (NVML_VALUE_NOT_AVAILABLE as unsigned long long).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
#: A device counts as "bigger than the profile's card" above this multiple of its nominal memory (a 16 GB
#: card reports ~15.6-16 GiB, an 80 GB one ~79 GiB: those are the card itself, not a bigger one).
BIGGER_THAN = 1.05
CAP_SCOPE = (
    "PyTorch's caching allocator (torch.cuda.set_per_process_memory_fraction); the CUDA context and "
    "memory allocated outside PyTorch (e.g. paged optimizers' unified memory) are not capped"
)


def alloc_conf() -> dict[str, str | None]:
    """The allocator settings in force: ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``."""
    return {name: os.environ.get(name) for name in ALLOC_CONF_VARS}


def device_index(device: Any = None) -> int:
    """The CUDA device index this process uses (``torch.cuda.current_device()`` by default)."""
    import torch

    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    return int(dev.index) if dev.index is not None else int(torch.cuda.current_device())


def apply_memory_cap(cfg: DictConfig, device: Any = None) -> dict[str, Any]:
    """Cap this process at ``hardware.budget_gib`` when the GPU is larger (``hardware.emulate_cap``).

    ``torch.cuda.set_per_process_memory_fraction(budget / total)`` makes the caching allocator raise
    ``torch.OutOfMemoryError`` where the profile's card would run out, so an ``rtx4080_16gb`` sweep on an
    H200 records the same ``oom`` trials as on the real card (the budget already leaves room for the
    CUDA context, which the cap does not cover). On the profile's own card (device memory within 5 % of
    ``hardware.memory_gib``) or a smaller one nothing is capped: the card's own limit is the real one.

    Returns:
        what was decided, for ``meta.cuda.cap``: ``applied``, ``cap_bytes``, ``cap_fraction``,
        ``device_total_bytes``, ``budget_bytes``, ``profile``, ``device_name`` and ``reason``.
    """
    import torch

    idx = device_index(device)
    props = torch.cuda.get_device_properties(idx)
    total = int(props.total_memory)
    hw = cfg.hardware
    budget = int(float(hw.budget_gib) * GIB)
    info: dict[str, Any] = {
        "profile": str(hw.name),
        "device_index": idx,
        "device_name": str(getattr(props, "name", "?")),
        "device_total_bytes": total,
        "budget_bytes": budget,
        "applied": False,
        "cap_bytes": None,
        "cap_fraction": None,
        "scope": CAP_SCOPE,
        "reason": None,
    }
    nominal = int(float(hw.memory_gib) * GIB) or budget
    if not bool(hw.emulate_cap):
        info["reason"] = "hardware.emulate_cap=false: the whole device is usable"
    elif budget <= 0:
        info["reason"] = f"hardware={hw.name} has no budget (hardware.budget_gib=0)"
    elif total <= nominal * BIGGER_THAN:
        info["reason"] = (
            f"the device ({total / GIB:.2f} GiB) is not larger than {hw.name} "
            f"({float(hw.memory_gib):g} GiB nominal): its own limit applies"
            + (" (it is smaller: OOMs come earlier than on the real card)" if total < budget else "")
        )
    else:
        fraction = budget / total
        torch.cuda.set_per_process_memory_fraction(fraction, idx)
        info.update(applied=True, cap_bytes=budget, cap_fraction=fraction)
        info["reason"] = (
            f"emulating {hw.name}: capped at {budget / GIB:.2f} GiB of {total / GIB:.2f} GiB "
            f"(fraction {fraction:.4f})"
        )
    return info


def _nvml_value(v: Any) -> int | None:
    if v is None:
        return None
    v = int(v)
    return None if v in (NVML_VALUE_NOT_AVAILABLE, -1) else v


class NvmlSampler(threading.Thread):
    """Samples this process's GPU memory (and the device's used memory) through NVML in a thread.

    Args:
        uuid: the device UUID as torch reports it (``get_device_properties(i).uuid``); NVML is asked by
            UUID first (``GPU-<uuid>``, then ``MIG-<uuid>``), because NVML indices ignore
            ``CUDA_VISIBLE_DEVICES``.
        index: fallback NVML index (physical) when the UUID lookup fails.
        interval_s: sampling period.
        pid: the process to look for (default: this one).
    """

    def __init__(
        self, *, uuid: str | None = None, index: int = 0, interval_s: float = 0.05, pid: int | None = None
    ):
        super().__init__(daemon=True, name="vramsweep-nvml")
        self.uuid = uuid
        self.index = index
        self.interval_s = float(interval_s)
        self.pid = os.getpid() if pid is None else int(pid)
        self.process_peak: int | None = None
        self.device_used_peak: int | None = None
        self.device_used_start: int | None = None
        self.samples = 0
        self.error: str | None = None
        self.handle_by: str | None = None
        self._halt = threading.Event()  # not `_stop`: threading.Thread has a private _stop() method
        self._ready = threading.Event()

    def _handle(self, pynvml: Any) -> Any:
        if self.uuid:
            for prefix in ("GPU-", "MIG-", ""):
                try:
                    h = pynvml.nvmlDeviceGetHandleByUUID(f"{prefix}{self.uuid}")
                    self.handle_by = f"uuid {prefix}{self.uuid}"
                    return h
                # broad on purpose: NVML raises its own error class per lookup; the next prefix is tried
                except Exception:
                    continue
        self.handle_by = f"index {self.index}"
        return pynvml.nvmlDeviceGetHandleByIndex(self.index)

    def sample(self, pynvml: Any, handle: Any) -> None:
        """One sample: this process's usedGpuMemory and the device's used memory."""
        used = _nvml_value(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        if used is not None:
            if self.device_used_start is None:
                self.device_used_start = used
            self.device_used_peak = max(self.device_used_peak or 0, used)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        for p in procs:
            if int(p.pid) == self.pid:
                mem = _nvml_value(getattr(p, "usedGpuMemory", None))
                if mem is not None:
                    self.process_peak = max(self.process_peak or 0, mem)
        self.samples += 1

    def run(self) -> None:
        try:
            import pynvml  # nvidia-ml-py (the `gpu` extra)

            pynvml.nvmlInit()
        except Exception as exc:  # NVML missing or not permitted in this container
            self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()
            return
        try:
            handle = self._handle(pynvml)
            self.sample(pynvml, handle)
            self._ready.set()
            while not self._halt.wait(self.interval_s):
                self.sample(pynvml, handle)
            self.sample(pynvml, handle)  # one last look after the work stopped
        # broad on purpose: the sampler thread must not die silently; the error is kept and reported
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()
            try:
                pynvml.nvmlShutdown()
            # broad on purpose: shutdown after sampling; NVML may already be gone
            except Exception:
                pass

    def wait_ready(self, timeout: float = 2.0) -> None:
        """Wait until the first sample (the baseline) was taken or the sampler failed."""
        self._ready.wait(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout)

    def info(self) -> dict[str, Any]:
        return {
            "available": self.error is None and self.samples > 0,
            "error": self.error,
            "samples": self.samples,
            "interval_s": self.interval_s,
            "handle": self.handle_by,
            "pid": self.pid,
            "process_visible": self.process_peak is not None,
            "device_used_start_bytes": self.device_used_start,
        }


class CudaMemoryMonitor:
    """Memory of one CUDA trial: cap, reset, phases, NVML sampling, metrics.

    Usage (``trial.py``)::

        mon = CudaMemoryMonitor(cfg); mon.start()        # cap + empty cache + reset peaks + NVML thread
        ... build the model ...; mon.phase("initial_eval"); ... evaluate ...
        mon.phase("train"); ... training steps ...; mon.stop()
        result["metrics"].update(mon.metrics(state_bytes)); result["meta"]["cuda"] = mon.meta()

    :meth:`phase` is optional: without it the whole trial since :meth:`start` is one phase ("trial").
    Each phase boundary empties the allocator cache and resets the peak counters, so the ``train``
    phase's reserved peak is not inflated by blocks cached during the build or the first eval; the
    trial-wide peak is the max over phases (``cuda_trial_peak_reserved_bytes``).
    """

    MEASURED_PHASE = "train"

    def __init__(self, cfg: DictConfig, *, device: Any = None, nvml_interval_s: float = 0.05):
        self.cfg = cfg
        self.device = device
        self.index: int | None = None
        self.cap: dict[str, Any] | None = None
        self.nvml: NvmlSampler | None = None
        self.nvml_interval_s = nvml_interval_s
        self.phases: dict[str, dict[str, int]] = {}
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self.started = False
        self.stopped = False
        self.device_name: str | None = None
        self.allocator_backend: str | None = None

    # -------------------------------------------------------------------------------------- control
    def start(self) -> None:
        """Apply the cap, empty the cache, reset the peak counters and start NVML sampling."""
        import torch

        self.index = device_index(self.device)
        torch.cuda.set_device(self.index)
        self.cap = apply_memory_cap(self.cfg, self.index)
        props = torch.cuda.get_device_properties(self.index)
        self.device_name = str(getattr(props, "name", "?"))
        try:
            self.allocator_backend = str(torch.cuda.get_allocator_backend())
        # broad on purpose: an optional diagnostic; older torch builds raise different errors
        except Exception:
            self.allocator_backend = None
        uuid = getattr(props, "uuid", None)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.index)
        self.nvml = NvmlSampler(
            uuid=str(uuid) if uuid is not None else None,
            index=self._nvml_index(),
            interval_s=self.nvml_interval_s,
        )
        self.nvml.start()
        self.nvml.wait_ready()
        self.started = True
        self._phase, self._phase_t0 = "setup", time.perf_counter()

    def _nvml_index(self) -> int:
        """Physical index for NVML when the UUID lookup fails (CUDA_VISIBLE_DEVICES of plain integers)."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        idx = self.index or 0
        if parts and idx < len(parts) and parts[idx].isdigit():
            return int(parts[idx])
        return idx

    def _close_phase(self) -> None:
        import torch

        if self._phase is None:
            return
        torch.cuda.synchronize(self.index)
        self.phases[self._phase] = {
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated(self.index)),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved(self.index)),
            "seconds": round(time.perf_counter() - self._phase_t0, 3),
        }
        self._phase = None

    def phase(self, name: str) -> None:
        """End the current phase (record its peaks) and start ``name`` with an empty cache and fresh peaks."""
        import torch

        if not self.started:
            raise RuntimeError("CudaMemoryMonitor.phase() before start()")
        self._close_phase()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.index)
        self._phase, self._phase_t0 = str(name), time.perf_counter()

    def stop(self) -> None:
        """End the current phase and stop NVML sampling (idempotent)."""
        if self.stopped or not self.started:
            return
        self._close_phase()
        if self.nvml is not None:
            self.nvml.stop()
        self.stopped = True

    # -------------------------------------------------------------------------------------- results
    def measured(self) -> tuple[str, dict[str, int]]:
        """(phase name, its peaks) that the headline metrics use: ``train`` if marked, else the max."""
        if self.MEASURED_PHASE in self.phases:
            return self.MEASURED_PHASE, self.phases[self.MEASURED_PHASE]
        if not self.phases:
            import torch

            return "trial", {
                "max_allocated_bytes": int(torch.cuda.max_memory_allocated(self.index)),
                "max_reserved_bytes": int(torch.cuda.max_memory_reserved(self.index)),
            }
        name = max(self.phases, key=lambda k: self.phases[k]["max_reserved_bytes"])
        return ("trial" if len(self.phases) == 1 else name), self.phases[name]

    def meta(self) -> dict[str, Any]:
        """For ``result.meta.cuda``: device, cap, allocator settings, NVML status, phase peaks."""
        return {
            "device_index": self.index,
            "device_name": self.device_name,
            "cap": self.cap,
            "alloc_conf": alloc_conf(),
            "allocator_backend": self.allocator_backend,
            "nvml": self.nvml.info() if self.nvml is not None else None,
            "phases": dict(self.phases),
        }

    def metrics(self, state_bytes: dict[str, Any]) -> dict[str, Any]:
        """Measured CUDA metrics (call after :meth:`stop`); ``state_bytes``: params/grads/optimizer bytes."""
        name, peaks = self.measured()
        return cuda_metrics(
            max_allocated=peaks["max_allocated_bytes"],
            max_reserved=peaks["max_reserved_bytes"],
            state_bytes=state_bytes,
            phase=name,
            trial_peak_reserved=max(
                [p["max_reserved_bytes"] for p in self.phases.values()] or [peaks["max_reserved_bytes"]]
            ),
            nvml_process_peak=self.nvml.process_peak if self.nvml is not None else None,
            nvml_device_used_peak=self.nvml.device_used_peak if self.nvml is not None else None,
        )


def cuda_metrics(
    *,
    max_allocated: int,
    max_reserved: int,
    state_bytes: dict[str, Any],
    phase: str = "trial",
    trial_peak_reserved: int | None = None,
    nvml_process_peak: int | None = None,
    nvml_device_used_peak: int | None = None,
) -> dict[str, Any]:
    """The metrics dict from raw peaks (pure arithmetic; see the module docstring for definitions)."""
    alloc, reserved = int(max_allocated), int(max_reserved)
    params = int(state_bytes.get("params") or 0)
    grads = int(state_bytes.get("grads") or 0)
    optimizer = int(state_bytes.get("optimizer") or 0)
    metrics = {
        M.PEAK_MEMORY_BYTES: reserved,
        M.MEMORY_KIND: "cuda_reserved",
        M.MEMORY_PHASE: phase,
        M.CUDA_MAX_ALLOCATED_BYTES: alloc,
        M.CUDA_MAX_RESERVED_BYTES: reserved,
        M.CUDA_FRAGMENTATION_BYTES: reserved - alloc,
        M.CUDA_TRIAL_PEAK_RESERVED_BYTES: int(
            trial_peak_reserved if trial_peak_reserved is not None else reserved
        ),
        M.NVML_PROCESS_PEAK_BYTES: nvml_process_peak,
        M.NVML_DEVICE_USED_PEAK_BYTES: nvml_device_used_peak,
        M.MEMORY_BREAKDOWN_BYTES: {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "activations": max(0, alloc - params - grads - optimizer),
            "other": reserved - alloc,
        },
    }
    return {str(k): v for k, v in metrics.items()}  # plain str keys, as the result JSON has them
