"""``vramsweep env``: versions, CUDA/driver, GPUs, optional packages, and which knob options
run here — through the rules' own machine check — without importing torch."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from vramsweep import envreport
from vramsweep.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_env_names_versions_packages_and_options(capsys) -> None:
    code, out = _run(["env"], capsys)
    assert code == 0
    assert f"torch      {importlib.metadata.version('torch')}" in out
    assert f"bitsandbytes      {importlib.metadata.version('bitsandbytes')}" in out
    assert f"python     {sys.version.split()[0]}" in out
    if importlib.util.find_spec("unsloth") is None:
        assert "unsloth           absent: not installed; to get it: make unsloth" in out
        assert "kernels=unsloth does not: needs unsloth" in out
    for group in envreport.MACHINE_GROUPS:
        assert f"  {group}: runs: " in out
    assert "attention: runs: eager, sdpa" in out


def test_env_json(capsys) -> None:
    code, out = _run(["env", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["torch"] == importlib.metadata.version("torch")
    assert data["options"]["quant"]["none"] == "runs"
    assert set(data["options"]) == set(envreport.MACHINE_GROUPS)


@pytest.mark.torchfree
def test_env_imports_no_torch_and_is_quick() -> None:
    """No torch import (hence no CUDA context: the fork-server rule holds) and a couple of seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys, contextlib, io\n"
        "from vramsweep.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): rc = main(['env'])\n"
        "heavy = sorted(m for m in ('torch', 'bitsandbytes', 'transformers', 'peft') if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert out.stdout.strip() == "0 []", out.stderr
    assert wall < 30, wall  # ~1-3 s on 2 busy cores; importing torch alone costs 5-10 s there


def _fake_gpu_machine(monkeypatch, present: set[str]) -> None:
    """A CUDA build of torch on a host whose NVML reports one H200; ``present`` optional packages only."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: "580.95.05"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 13000
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=150_754_820_096)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(envreport, "torch_build", lambda: ("2.11.0+cu130", "13.0"))
    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name in {"flash_attn", "liger_kernel", "unsloth"}:
            return SimpleNamespace(name=name) if name in present else None
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delenv("VRAMSWEEP_FORCE_NO_CUDA", raising=False)


def test_env_on_a_gpu_host_reads_nvml_and_checks_options_with_a_cuda_profile(monkeypatch) -> None:
    _fake_gpu_machine(monkeypatch, present={"liger_kernel"})
    rep = envreport.collect()
    text = envreport.format_report(rep)
    assert rep.has_cuda and rep.gpus[0].name == "NVIDIA H200"
    assert "gpu 0      NVIDIA H200, 140.4 GiB" in text
    assert "driver     580.95.05 (CUDA 13.0); GPUs read from NVML" in text
    assert "built for CUDA 13.0" in text
    assert rep.options["hardware"]["h100_80gb"] == "runs"
    assert rep.options["kernels"]["liger"] == "runs"  # the rules' own check: CUDA + liger-kernel present
    assert "flash-attn package, not installed" in rep.options["attention"]["flash_attention_2"]


@pytest.mark.parametrize("present", [set(), {"liger_kernel", "unsloth", "flash_attn"}])
def test_env_option_verdicts_follow_the_rules(monkeypatch, present) -> None:
    _fake_gpu_machine(monkeypatch, present=present)
    opts = envreport.option_support(True)
    for pkg, (group, option) in {
        "liger_kernel": ("kernels", "liger"),
        "unsloth": ("kernels", "unsloth"),
        "flash_attn": ("attention", "flash_attention_2"),
    }.items():
        assert (opts[group][option] == "runs") == (pkg in present), (option, opts[group][option])


def test_env_without_a_gpu_says_why_cuda_is_not_usable(monkeypatch) -> None:
    monkeypatch.setattr(envreport, "_gpus_nvml", lambda: None)
    monkeypatch.setattr(envreport, "_gpus_smi", lambda: None)
    monkeypatch.setattr(envreport, "torch_build", lambda: ("2.11.0+cu130", "13.0"))
    rep = envreport.collect()
    text = envreport.format_report(rep)
    assert not rep.has_cuda and "cuda       not usable here: no GPU found" in text
    assert rep.options["hardware"]["cpu"] == "runs"
    assert rep.options["hardware"]["h100_80gb"].startswith("needs CUDA")
