"""``vramsweep env``: the environment a bug report needs, and which knob options run here and why not.

1. Python, platform, vramsweep; torch's version and the CUDA it was built for — read from the installed
   distribution and ``torch/version.py``, **without importing torch** (a second of work, not ten, and no
   CUDA initialised: the fork-server rule of :mod:`vramsweep.sweeper.isolation` holds whatever runs next).
2. The GPU: NVML (``nvidia-ml-py``, the ``gpu`` extra) or ``nvidia-smi`` for driver, names and memory.
   Neither creates a CUDA context.
3. The optional packages (bitsandbytes, Liger, Unsloth, flash-attn, W&B, ...): version, or absent and
   how to get it (:data:`vramsweep.config.rules.INSTALL_HINTS`), found with ``importlib`` metadata only.
4. Each option of the machine-dependent groups (hardware, attention, kernels, quant, optimizer) put
   through the rules' own machine check (:func:`vramsweep.config.rules.check_machine`) on the default
   config: ``runs`` or the rule's message. Options are merged from their YAML over the group's schema
   rather than composed one by one (a Hydra compose costs ~0.5 s).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vramsweep import __version__
from vramsweep.config.compose import compose
from vramsweep.config.errors import ConfigError
from vramsweep.config.paths import find_option, list_options
from vramsweep.config.rules import ENV_HINT, INSTALL_HINTS, check_machine
from vramsweep.config.schema import _SCHEMAS

#: (distribution, import name, how to get it when absent), in the order a bug report reads them
PACKAGES = (
    ("transformers", "transformers", "pip install 'vramsweep'"),
    ("peft", "peft", "pip install 'vramsweep'"),
    ("accelerate", "accelerate", "pip install 'vramsweep'"),
    ("bitsandbytes", "bitsandbytes", INSTALL_HINTS["bitsandbytes"]),
    ("liger-kernel", "liger_kernel", INSTALL_HINTS["liger_kernel"]),
    ("unsloth", "unsloth", INSTALL_HINTS["unsloth"]),
    ("flash-attn", "flash_attn", INSTALL_HINTS["flash_attn"]),
    ("triton", "triton", "comes with a CUDA build of torch (Linux)"),
    ("wandb", "wandb", "pip install wandb"),
    ("optuna", "optuna", "pip install 'vramsweep'"),
    ("hydra-core", "hydra", "pip install 'vramsweep'"),
    ("optuna-dashboard", "optuna_dashboard", "pip install 'vramsweep[dashboard]'"),
    ("nvidia-ml-py", "pynvml", "pip install 'vramsweep[gpu]' (GPU memory read through NVML)"),
)
#: the groups whose options depend on the machine (the rest run anywhere the config is valid)
MACHINE_GROUPS = ("hardware", "attention", "kernels", "quant", "optimizer")


@dataclass
class Gpu:
    index: int
    name: str
    memory_bytes: int


@dataclass
class EnvReport:
    python: str
    platform: str
    vramsweep: str
    torch: str | None
    torch_cuda: str | None
    driver: str | None
    driver_cuda: str | None
    gpu_source: str
    gpus: list[Gpu] = field(default_factory=list)
    packages: dict[str, str] = field(default_factory=dict)  # name -> version, or "absent: <why / how>"
    options: dict[str, dict[str, str]] = field(default_factory=dict)  # group -> option -> "runs" | why not

    @property
    def has_cuda(self) -> bool:
        return bool(self.torch_cuda) and bool(self.gpus) and os.environ.get("VRAMSWEEP_FORCE_NO_CUDA") != "1"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build() -> tuple[str | None, str | None]:
    """(torch version, CUDA version it was built for or None) from ``torch/version.py``, torch not
    imported."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]+)?=\s*['\"]([^'\"]+)", text, re.M)
    return (version.group(1) if version else _version("torch")), (cuda.group(1) if cuda else None)


def _gpus_nvml() -> tuple[str | None, str | None, list[Gpu]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    # broad on purpose: NVML missing or broken (NVMLError_*, OSError) = no NVML view in the report
    except Exception:
        return None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append(
                Gpu(
                    i,
                    name.decode() if isinstance(name, bytes) else name,
                    pynvml.nvmlDeviceGetMemoryInfo(h).total,
                )
            )
        return (
            driver.decode() if isinstance(driver, bytes) else driver,
            f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpus,
        )
    finally:
        pynvml.nvmlShutdown()


def _gpus_smi() -> tuple[str | None, str | None, list[Gpu]] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus, driver = [], None
    for line in out.strip().splitlines():
        idx, name, mib, driver = (x.strip() for x in line.split(","))
        gpus.append(Gpu(int(idx), name, int(float(mib)) * 2**20))
    return driver, None, gpus


def _option_cfg(base: DictConfig, group: str, option: str) -> DictConfig:
    """``base`` with ``group=option``: the option's YAML merged over the group's schema (what its
    ``defaults: [base_<group>, _self_]`` composes to)."""
    path = find_option(group, option)
    node = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    node.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(_SCHEMAS[group]), node)
    cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    cfg[group] = merged
    return cfg


def option_support(has_cuda: bool, base: DictConfig | None = None) -> dict[str, dict[str, str]]:
    """``{group: {option: "runs" | the machine rule's message}}`` for :data:`MACHINE_GROUPS`. On a CUDA
    machine the non-hardware groups are checked with a CUDA profile (``h100_80gb``'s device), on a CPU
    one with ``hardware=cpu``, the default."""
    base = compose([], rules="none") if base is None else base
    if has_cuda:
        base = _option_cfg(base, "hardware", "h100_80gb")
    out: dict[str, dict[str, str]] = {}
    for group in MACHINE_GROUPS:
        out[group] = {}
        for option in list_options(group):
            if option.startswith("base_"):
                continue
            try:
                check_machine(_option_cfg(base, group, option), has_cuda=has_cuda)
                out[group][option] = "runs"
            except ConfigError as exc:  # the rule's message without what this report already says
                why = str(exc).replace(f"; {ENV_HINT}", "")
                out[group][option] = re.sub(rf"^{re.escape(group)}={re.escape(option)} ", "", why)
    return out


def collect() -> EnvReport:
    """Everything ``vramsweep env`` prints (no torch import, no CUDA context)."""
    torch_version, torch_cuda = torch_build()
    found = _gpus_nvml()
    source = "NVML"
    if found is None:
        found, source = _gpus_smi(), "nvidia-smi"
    if found is None:
        found, source = (None, None, []), "none (no NVML, no nvidia-smi: no NVIDIA driver here)"
    driver, driver_cuda, gpus = found
    packages = {}
    for dist, module, how in PACKAGES:
        v = _version(dist)
        if v is not None and importlib.util.find_spec(module) is not None:
            packages[dist] = v
        else:
            packages[dist] = f"absent: not installed; to get it: {how}"
    rep = EnvReport(
        python=f"{platform.python_version()} ({sys.executable})",
        platform=platform.platform(),
        vramsweep=__version__,
        torch=torch_version,
        torch_cuda=torch_cuda,
        driver=driver,
        driver_cuda=driver_cuda,
        gpu_source=source,
        gpus=gpus,
        packages=packages,
    )
    rep.options = option_support(rep.has_cuda)
    return rep


def format_report(rep: EnvReport) -> str:
    """The text ``vramsweep env`` prints (paste it into a bug report)."""
    lines = [
        f"vramsweep {rep.vramsweep}",
        f"python     {rep.python}",
        f"platform   {rep.platform}",
        f"torch      {rep.torch or 'absent: not installed (pip install torch)'}"
        + (f", built for CUDA {rep.torch_cuda}" if rep.torch_cuda else ", CPU build (no CUDA)"),
        f"driver     {rep.driver or 'none'}"
        + (f" (CUDA {rep.driver_cuda})" if rep.driver_cuda else "")
        + f"; GPUs read from {rep.gpu_source}",
    ]
    for g in rep.gpus:
        lines.append(f"gpu {g.index}      {g.name}, {g.memory_bytes / 2**30:.1f} GiB")
    if not rep.gpus:
        lines.append("gpu        none")
    lines.append(
        "cuda       "
        + (
            "usable (CUDA build of torch + a GPU)"
            if rep.has_cuda
            else "not usable here: "
            + (
                "VRAMSWEEP_FORCE_NO_CUDA=1"
                if os.environ.get("VRAMSWEEP_FORCE_NO_CUDA") == "1"
                else "torch is a CPU build"
                if not rep.torch_cuda
                else "no GPU found"
            )
        )
    )
    lines.append("packages:")
    width = max(len(k) for k in rep.packages)
    lines += [f"  {k:<{width}}  {v}" for k, v in rep.packages.items()]
    lines.append(f"knob options on this machine ({'a CUDA profile' if rep.has_cuda else 'hardware=cpu'}):")
    for group, opts in rep.options.items():
        runs = [o for o, why in opts.items() if why == "runs"]
        lines.append(f"  {group}: runs: {', '.join(runs) or 'none'}")
        lines += [f"    {group}={o} does not: {why}" for o, why in opts.items() if why != "runs"]
    return "\n".join(lines)


def run_env(*, as_json: bool = False) -> int:
    """``vramsweep env [--json]``: print the report; exit 0."""
    rep = collect()
    if as_json:
        data = asdict(rep)
        data["has_cuda"] = rep.has_cuda
        print(json.dumps(data, indent=2))
    else:
        print(format_report(rep))
    return 0
