"""CUDA measurement: allocator peaks after a reset at trial start, NVML process peak sampled in a thread,
fragmentation (reserved - allocated), and the per-process memory cap that emulates a smaller card.

Only imported when ``hardware.device=cuda`` (never in a sweeper parent: no CUDA initialisation there).
"""

from __future__ import annotations

import os
import threading
import time

from omegaconf import DictConfig

GIB = 1024**3


def apply_memory_cap(cfg: DictConfig) -> dict:
    """Cap this process at ``hardware.budget_gib`` when the GPU is larger (``hardware.emulate_cap``)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    budget = float(cfg.hardware.budget_gib) * GIB
    info = {"device_total_bytes": int(total), "cap_bytes": None, "cap_fraction": None}
    if cfg.hardware.emulate_cap and budget > 0 and budget < total:
        frac = budget / total
        torch.cuda.set_per_process_memory_fraction(frac, 0)
        info.update(cap_bytes=int(budget), cap_fraction=frac)
    return info


class _NvmlSampler(threading.Thread):
    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = None
        self.error = None
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(
                int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            )
            pid = os.getpid()
            while not self._stop.is_set():
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        self.peak = max(self.peak or 0, int(p.usedGpuMemory))
                time.sleep(self.interval)
        except Exception as exc:  # NVML missing or not permitted in containers
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._stop.set()


class CudaMemoryMonitor:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.cap = None
        self.nvml = _NvmlSampler()

    def start(self) -> None:
        import torch

        self.cap = apply_memory_cap(self.cfg)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.nvml.start()

    def stop(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.nvml.stop()

    def meta(self) -> dict:
        return {
            "cap": self.cap,
            "nvml_error": self.nvml.error,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }

    def metrics(self, state_bytes: dict) -> dict:
        import torch

        alloc = int(torch.cuda.max_memory_allocated())
        reserved = int(torch.cuda.max_memory_reserved())
        static = sum(int(v or 0) for v in state_bytes.values())
        return {
            "peak_memory_bytes": reserved,
            "memory_kind": "cuda_reserved",
            "cuda_max_allocated_bytes": alloc,
            "cuda_max_reserved_bytes": reserved,
            "cuda_fragmentation_bytes": reserved - alloc,
            "nvml_process_peak_bytes": self.nvml.peak,
            "memory_breakdown_bytes": {
                "params": int(state_bytes.get("params") or 0),
                "grads": int(state_bytes.get("grads") or 0),
                "optimizer": int(state_bytes.get("optimizer") or 0),
                "activations": max(0, alloc - static),
                "other": reserved - alloc,
            },
        }
