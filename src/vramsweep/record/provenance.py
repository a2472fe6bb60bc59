"""Provenance: what ran a trial and under which conditions (``meta.device``, ``meta.versions``,
``meta.git_sha``, ``meta.timing_conditions``, ...; docs/CONTRACTS.md, "Result JSON").

No torch at import: the functions that read torch's version, threads or device import it when called."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: (module, distribution) whose versions a result records. Read from package metadata: importing unsloth
#: would patch transformers in every trial, and liger_kernel pulls in Triton; neither should happen just
#: to read a version number.
PACKAGES = (
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("bitsandbytes", "bitsandbytes"),
    ("optuna", "optuna"),
    ("hydra", "hydra-core"),
    ("omegaconf", "omegaconf"),
    ("wandb", "wandb"),
    ("liger_kernel", "liger-kernel"),
    ("unsloth", "unsloth"),
    ("flash_attn", "flash-attn"),
    ("triton", "triton"),
)


def source_revision() -> str | None:
    """The git commit of the vramsweep source that runs, when it runs from a git checkout of vramsweep
    (not of whatever repository an installed copy happens to sit in)."""
    pkg = Path(__file__).resolve().parents[1]  # src/vramsweep
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=pkg,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError, ValueError):  # no git, a timeout, output not text
        return None
    if len(top) != 2 or Path(top[0]).resolve() / "src" / "vramsweep" != pkg:
        return None
    return top[1]


def collect_meta(cfg: DictConfig, device_key: Callable[[str], str | None]) -> dict[str, Any]:
    """A trial's provenance: device, hardware profile (and whether a bigger GPU emulates it), timing
    conditions, package versions, git commit, seed, host, pid, allocator settings. ``device_key`` names a
    device's row in the FLOP-peak table (``vramsweep.measure.flops.device_peak``), or None."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod, dist in PACKAGES:
        try:
            versions[mod] = version(dist)
        except PackageNotFoundError:
            continue
    sha = source_revision()
    emulated = None
    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device())

        key = device_key(device)
        # The profile names a card; the device is what ran. They differ when a bigger GPU emulates the
        # profile's memory (meta.cuda.cap says whether the cap was applied).
        emulated = {
            "profile": str(cfg.hardware.name),
            "physical_device": device,
            "physical_key": key,
            "emulated": not (key is not None and str(cfg.hardware.name).startswith(key + "_")),
        }
    else:
        cpu = platform.processor() or platform.machine()
        device = f"cpu ({cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()})"
    return {
        "device": device,
        "hardware_profile": cfg.hardware.name,
        "hardware_emulation": emulated,
        "timing_conditions": timing_conditions(cfg),
        "versions": versions,
        "git_sha": sha,
        "seed": int(cfg.train.seed),
        "hostname": platform.node(),
        "pid": os.getpid(),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def timing_conditions(cfg: DictConfig) -> dict[str, Any]:
    """What can disturb a throughput figure, recorded beside it: load average (1/5/15 min), CPU count,
    torch threads, and on CUDA the other processes on the GPU (NVML; none when NVML is unavailable)."""
    import torch

    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with contextlib.suppress(OSError, AttributeError):
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if cfg.hardware.device == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                out["other_gpu_processes"] = sum(1 for p in procs if p.pid != os.getpid())
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # NVML missing or no permission: say so, do not guess
            out["other_gpu_processes"] = None
            out["nvml_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    return out
