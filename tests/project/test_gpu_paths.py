"""GPU paths on a CPU machine: which patch or loader each option dispatches to, the validation
and ``unsupported`` statuses, CUDA measurement arithmetic against a fake ``torch.cuda``, the 16 GiB cap
emulation, the architecture-only builder, and the GPU smoke script's dry run (slow).

GPU-only checks carry ``@pytest.mark.gpu`` (skipped without CUDA); Unsloth training on CPU runs when
``unsloth`` is importable (``make unsloth``) and is marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vramsweep.config import ConfigError, compose, rules
from vramsweep.config.rules import UnsupportedError
from vramsweep.knobs import kernels
from vramsweep.measure import cuda as mcuda
from vramsweep.record.units import GIB

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None

#: A small Qwen3 architecture (``source=arch``) that builds in well under a second on a CPU.
SMALL_ARCH = ["model=qwen3_tiny_arch", "model.vocab_size=256", "train.dtype=bf16"]


def _cfg(*overrides: str):
    return compose(list(overrides), rules="none")


# ================================================================================================ Liger
LIGER_SIGNATURE = (
    "rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None"
)


@pytest.fixture()
def fake_liger(monkeypatch):
    """A fake ``liger_kernel.transformers`` whose patch functions record their calls (real signatures)."""
    calls: list[tuple[str, dict]] = []
    pkg = types.ModuleType("liger_kernel")
    mod = types.ModuleType("liger_kernel.transformers")
    for family in ("qwen3", "llama", "qwen3_moe", "mistral"):
        name = f"apply_liger_kernel_to_{family}"
        ns: dict = {}
        exec(
            f"def {name}({LIGER_SIGNATURE}):\n    calls.append(({name!r}, dict(locals())))",
            {"calls": calls},
            ns,
        )
        setattr(mod, name, ns[name])
    ns = {}
    exec(
        "def apply_liger_kernel_to_gemma(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, "
        "rms_norm=True, geglu=True, model=None):\n    calls.append(('apply_liger_kernel_to_gemma', dict(locals())))",
        {"calls": calls},
        ns,
    )
    mod.apply_liger_kernel_to_gemma = ns["apply_liger_kernel_to_gemma"]
    pkg.transformers = mod
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    return calls


ALL_ON = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": True,
    "model": None,
}


@pytest.mark.parametrize(
    ("overrides", "function"),
    [
        (["model=tiny"], "apply_liger_kernel_to_qwen3"),
        (["model=qwen3_8b"], "apply_liger_kernel_to_qwen3"),
        (["model=llama3_1_8b"], "apply_liger_kernel_to_llama"),
    ],
)
def test_liger_dispatches_to_the_family_patch_with_flce(fake_liger, overrides, function):
    desc = kernels.apply_liger(_cfg(*overrides, "kernels=liger"))
    assert fake_liger == [(function, ALL_ON)]
    assert (
        desc.startswith(f"liger_kernel.transformers.{function}(")
        and "fused_linear_cross_entropy=True" in desc
    )


@pytest.mark.parametrize(
    ("model_type", "function"),
    [
        ("llama", "apply_liger_kernel_to_llama"),
        ("qwen3", "apply_liger_kernel_to_qwen3"),
        ("qwen3_moe", "apply_liger_kernel_to_qwen3_moe"),  # exact model_type, not a prefix match
        ("mistral", "apply_liger_kernel_to_mistral"),
    ],
)
def test_liger_reads_model_type_from_local_checkpoint(fake_liger, tmp_path, model_type, function):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    cfg = _cfg("model=local", f"model.path={tmp_path}", "kernels=liger")
    kernels.apply_liger(cfg)
    assert [c[0] for c in fake_liger] == [function]


def test_liger_unknown_family_is_unsupported(fake_liger, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedError, match="no patch for model family 'gpt2'"):
        kernels.apply_liger(_cfg("model=local", f"model.path={tmp_path}", "kernels=liger"))
    assert fake_liger == []


def test_liger_sub_knobs_and_signature_filtering(fake_liger, tmp_path):
    cfg = _cfg("kernels=liger", "kernels.liger_fused_linear_cross_entropy=false", "kernels.liger_rope=false")
    kernels.apply_liger(cfg)
    assert fake_liger[-1][1] == ALL_ON | {"fused_linear_cross_entropy": False, "rope": False}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    gemma = _cfg("model=local", f"model.path={tmp_path}", "kernels=liger")
    plan = kernels.liger_plan(gemma, sys.modules["liger_kernel.transformers"].apply_liger_kernel_to_gemma)
    assert plan.dropped == {"swiglu": True} and "swiglu" not in plan.kwargs
    kernels.apply_liger(gemma)
    assert fake_liger[-1][0] == "apply_liger_kernel_to_gemma" and "swiglu" not in fake_liger[-1][1]


def test_liger_without_the_package_is_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails
    with pytest.raises(UnsupportedError, match="liger-kernel"):
        kernels.apply_liger(_cfg("kernels=liger"))


def _patch_qwen3_like_liger(monkeypatch) -> None:
    """What apply_liger_kernel_to_qwen3 does to the modeling module, with look-alike classes (undone by
    monkeypatch): RMSNorm and MLP classes swapped, the causal-LM forward replaced."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    class LigerRMSNorm(mq.Qwen3RMSNorm):
        pass

    class LigerSwiGLUMLP(mq.Qwen3MLP):
        pass

    orig_forward = mq.Qwen3ForCausalLM.forward

    def lce_forward(self, *args, **kwargs):
        return orig_forward(self, *args, **kwargs)

    lce_forward.__module__ = "liger_kernel.transformers.model.qwen3"
    monkeypatch.setattr(mq, "Qwen3RMSNorm", LigerRMSNorm)
    monkeypatch.setattr(mq, "Qwen3MLP", LigerSwiGLUMLP)
    monkeypatch.setattr(mq.Qwen3ForCausalLM, "forward", lce_forward)


def test_liger_class_patch_reaches_an_arch_model_and_is_verified(monkeypatch):
    from vramsweep.knobs.arch import build_arch_model

    cfg = _cfg(*SMALL_ARCH, "kernels=liger", "quant=nf4")
    plain, _ = build_arch_model(cfg, "cpu")
    with pytest.raises(RuntimeError, match="did not reach the model"):
        kernels.apply_liger_to_instance(cfg, plain)  # a Liger knob that did nothing must not pass
    _patch_qwen3_like_liger(monkeypatch)
    model, _ = build_arch_model(cfg, "cpu")
    notes = kernels.apply_liger_to_instance(cfg, model)
    n = int(cfg.model.num_layers)
    assert notes["liger_modules"] == {"LigerRMSNorm": 4 * n + 1, "LigerSwiGLUMLP": n}
    assert notes["fused_linear_cross_entropy_forward"] is True and notes["verified"] is True


@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed (gpu extra)"
)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_real_liger_patches_reach_the_model(family):
    """The real liger-kernel package: dispatch, class patches before the build, verification after PEFT.
    In a subprocess (Liger's class patches are process-global); no Triton kernel runs, so a CPU will do."""
    code = f"""
from peft import LoraConfig, get_peft_model
from vramsweep.knobs import kernels
from vramsweep.knobs.arch import build_arch_model
from vramsweep.config import compose
cfg = compose({SMALL_ARCH + [f"model.family={family}", "kernels=liger", "quant=nf4"]!r}, rules="none")
print(kernels.apply_liger(cfg))
model, _ = build_arch_model(cfg, "cpu")
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
print(kernels.apply_liger_to_instance(cfg, model))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"apply_liger_kernel_to_{family}(rope=True" in proc.stdout
    assert (
        "'fused_linear_cross_entropy_forward': True" in proc.stdout and "'LigerSwiGLUMLP': 2" in proc.stdout
    )


# ============================================================================================== Unsloth
def test_unsloth_translates_qlora_rslora_checkpointing(fake_unsloth, tmp_path):
    cfg = _cfg(
        "kernels=unsloth",
        "quant=nf4_dq",
        "adapter=rslora",
        "adapter.r=32",
        "checkpointing=on",
        "context.max_tokens=256",
        "train.dtype=bf16",
        "train.seed=7",
    )
    model, tok = kernels.load_with_unsloth(cfg, tmp_path)
    assert model.kind == "peft" and tok == "tokenizer"
    load = fake_unsloth["from_pretrained"]
    assert load["model_name"] == str(tmp_path)
    assert load["load_in_4bit"] is True and load["load_in_8bit"] is False and load["load_in_16bit"] is False
    assert load["max_seq_length"] == 256 and load["dtype"] is torch.bfloat16
    assert load["full_finetuning"] is False and load["use_gradient_checkpointing"] == "unsloth"
    peft = fake_unsloth["get_peft_model"]
    assert peft == {
        "r": 32,
        "lora_alpha": float(cfg.adapter.alpha),
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "bias": "none",
        "use_rslora": True,
        "use_gradient_checkpointing": "unsloth",
        "random_state": 7,
    }


def test_unsloth_translates_16bit_int8_dora_full(fake_unsloth, tmp_path):
    kernels.load_with_unsloth(_cfg("kernels=unsloth", "quant=none", "checkpointing=off"), tmp_path)
    load = fake_unsloth["from_pretrained"]
    assert (load["load_in_4bit"], load["load_in_8bit"], load["load_in_16bit"]) == (False, False, True)
    assert load["use_gradient_checkpointing"] is False
    assert fake_unsloth["get_peft_model"]["use_gradient_checkpointing"] is False
    kernels.load_with_unsloth(
        _cfg("kernels=unsloth", "quant=int8", "adapter=dora", "adapter.targets=[q_proj,v_proj]"), tmp_path
    )
    assert fake_unsloth["from_pretrained"]["load_in_8bit"] is True
    assert fake_unsloth["get_peft_model"]["use_dora"] is True
    assert fake_unsloth["get_peft_model"]["target_modules"] == ["q_proj", "v_proj"]
    fake_unsloth.clear()
    model, _ = kernels.load_with_unsloth(_cfg("kernels=unsloth", "adapter=full"), tmp_path)
    assert fake_unsloth["from_pretrained"]["full_finetuning"] is True
    assert "get_peft_model" not in fake_unsloth and model.kind == "base"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["quant=fp4"], "quant"),
        (["quant=nf4"], "quant"),  # Unsloth double-quantises anyway: it would be measured as nf4_dq
        (["quant=nf4_dq", "train.dtype=fp16"], "quant.compute_dtype"),
        (["vocab=sliced"], "vocab"),
        (["attention=eager"], "attention"),
    ],
)
def test_unsloth_rejects_what_it_cannot_honour(fake_unsloth, tmp_path, overrides, key):
    with pytest.raises(UnsupportedError) as exc:
        kernels.load_with_unsloth(_cfg("kernels=unsloth", *overrides), tmp_path)
    assert exc.value.key == key and fake_unsloth == {}


def test_unsloth_needs_weights_on_disk(fake_unsloth, tmp_path):
    kernels.check_unsloth(_cfg("kernels=unsloth", "model=qwen3_8b"))  # arch: build_model writes a folder
    with pytest.raises(UnsupportedError, match="loads weights from disk"):
        kernels.load_with_unsloth(_cfg("kernels=unsloth", "model=qwen3_8b"), None)
    kernels.check_unsloth(_cfg("kernels=unsloth"))  # embedded model, sdpa, bf16 LoRA: fine
    assert fake_unsloth == {}


# ================================================================================================ rules
def test_liger_and_unsloth_together_are_rejected():
    with pytest.raises(ConfigError) as exc:
        compose(["kernels=liger", "kernels.unsloth=true"])
    assert not isinstance(exc.value, UnsupportedError) and exc.value.key == "kernels"
    assert "cannot both be on" in str(exc.value)


def _machine(monkeypatch, *, cuda: bool, present: set[str]):
    """Pretend CUDA is (not) there and only ``present`` optional packages are installed."""
    real = importlib.util.find_spec
    optional = {"flash_attn", "liger_kernel", "unsloth"}

    def find_spec(name, *a, **kw):
        if name in optional:
            return SimpleNamespace(name=name) if name in present else None
        return real(name, *a, **kw)

    monkeypatch.setattr(rules, "cuda_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    ("cuda", "present", "hardware", "match"),
    [
        (False, {"flash_attn"}, "cpu", "needs a CUDA device"),
        (True, set(), "rtx4080_16gb", "needs the flash-attn package"),
        (True, {"flash_attn"}, "cpu", "needs a CUDA device"),  # CUDA present but a CPU profile chosen
        (True, {"flash_attn"}, "rtx4080_16gb", None),
    ],
)
def test_flash_attention_2_branches(monkeypatch, cuda, present, hardware, match):
    _machine(monkeypatch, cuda=cuda, present=present)
    cfg = _cfg("attention=flash_attention_2", f"hardware={hardware}")
    if match is None:
        rules.validate(cfg)
        return
    with pytest.raises(UnsupportedError, match=match) as exc:
        rules.validate(cfg)
    assert exc.value.key == "attention" and "sdpa" in exc.value.allowed


def test_flash_attention_2_fp32_is_a_config_error(monkeypatch):
    _machine(monkeypatch, cuda=True, present={"flash_attn"})
    with pytest.raises(ConfigError, match="fp16/bf16") as exc:
        rules.validate(_cfg("attention=flash_attention_2", "hardware=rtx4080_16gb", "train.dtype=fp32"))
    assert not isinstance(exc.value, UnsupportedError)


@pytest.mark.parametrize(
    ("cuda", "present", "overrides", "match"),
    [
        (False, {"liger_kernel"}, ["kernels=liger"], "needs CUDA"),
        (True, set(), ["kernels=liger", "hardware=h100_80gb"], "needs liger-kernel"),
        (True, {"liger_kernel"}, ["kernels=liger", "hardware=h100_80gb"], None),
        (False, set(), ["kernels=unsloth"], "needs unsloth"),
        (False, {"unsloth"}, ["kernels=unsloth"], None),  # Unsloth trains on CPU
    ],
)
def test_kernel_machine_rules(monkeypatch, cuda, present, overrides, match):
    _machine(monkeypatch, cuda=cuda, present=present)
    cfg = _cfg(*overrides)
    if match is None:
        rules.validate(cfg)
    else:
        with pytest.raises(UnsupportedError, match=match):
            rules.validate(cfg)


def test_gpu_profile_without_cuda_is_recorded_unsupported(tmp_path, monkeypatch):
    from vramsweep.trial import run_trial

    monkeypatch.setattr(rules, "cuda_available", lambda: False)
    res = run_trial(_cfg("hardware=rtx4080_16gb", "kernels=liger"), result_path=tmp_path / "r.json")
    assert res["status"] == "unsupported" and "CUDA" in res["reason"]
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "unsupported"


# ======================================================================================= CUDA measurement
class FakeCuda:
    """Scripted ``torch.cuda`` memory counters (values in bytes) and a call log."""

    def __init__(self, total: int, name: str = "NVIDIA H200"):
        self.total, self.name = total, name
        self.alloc = self.reserved = 0
        self.calls: list[tuple] = []

    def install(self, monkeypatch) -> None:
        c = torch.cuda
        for attr, fn in {
            "get_device_properties": lambda i=0: SimpleNamespace(
                total_memory=self.total, name=self.name, uuid="0123-abcd"
            ),
            "set_per_process_memory_fraction": lambda f, d=None: self.calls.append(("fraction", f, d)),
            "max_memory_allocated": lambda d=None: self.alloc,
            "max_memory_reserved": lambda d=None: self.reserved,
            "reset_peak_memory_stats": lambda d=None: self.calls.append(("reset", d)),
            "empty_cache": lambda: self.calls.append(("empty_cache",)),
            "synchronize": lambda d=None: None,
            "set_device": lambda d: self.calls.append(("set_device", d)),
            "current_device": lambda: 0,
            "get_allocator_backend": lambda: "native",
        }.items():
            monkeypatch.setattr(c, attr, fn)


@pytest.fixture()
def fake_nvml(monkeypatch):
    """A fake ``pynvml``: this process uses 9 GiB, the device 10 GiB."""
    state = {"proc": 9 * GIB, "used": 10 * GIB, "pid": os.getpid(), "uuid_ok": True, "init": 0}
    mod = types.ModuleType("pynvml")

    def by_uuid(u):
        if not state["uuid_ok"] or u != "GPU-0123-abcd":
            raise RuntimeError("not found")
        return "handle"

    mod.nvmlInit = lambda: state.__setitem__("init", state["init"] + 1)
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetHandleByUUID = by_uuid
    mod.nvmlDeviceGetHandleByIndex = lambda i: "handle"
    mod.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=state["used"], total=141 * GIB)
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        SimpleNamespace(pid=state["pid"], usedGpuMemory=state["proc"]),
        SimpleNamespace(pid=1, usedGpuMemory=mcuda.NVML_VALUE_NOT_AVAILABLE),
    ]
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return state


def test_cap_emulates_a_16gb_card_on_a_bigger_gpu(monkeypatch):
    fake = FakeCuda(total=int(139.8 * GIB))
    fake.install(monkeypatch)
    info = mcuda.apply_memory_cap(_cfg("hardware=rtx4080_16gb"))
    assert info["applied"] is True and info["cap_bytes"] == 15 * GIB
    assert info["cap_fraction"] == pytest.approx(15 * GIB / int(139.8 * GIB))
    assert fake.calls == [("fraction", info["cap_fraction"], 0)]
    assert info["profile"] == "rtx4080_16gb" and "emulating rtx4080_16gb" in info["reason"]


@pytest.mark.parametrize(
    ("total_gib", "overrides", "reason"),
    [
        (15.6, ["hardware=rtx4080_16gb"], "not larger than"),  # the card itself
        (79.1, ["hardware=h100_80gb"], "not larger than"),
        (14.5, ["hardware=rtx4080_16gb"], "it is smaller"),
        (141.0, ["hardware=rtx4080_16gb", "hardware.emulate_cap=false"], "emulate_cap=false"),
        (141.0, ["hardware=rtx4080_16gb", "hardware.budget_gib=0"], "no budget"),
    ],
)
def test_cap_not_applied(monkeypatch, total_gib, overrides, reason):
    fake = FakeCuda(total=int(total_gib * GIB))
    fake.install(monkeypatch)
    info = mcuda.apply_memory_cap(_cfg(*overrides))
    assert info["applied"] is False and info["cap_bytes"] is None and reason in info["reason"]
    assert not [c for c in fake.calls if c[0] == "fraction"]


def test_monitor_metrics_phases_nvml_and_meta(monkeypatch, fake_nvml):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    fake = FakeCuda(total=141 * GIB)
    fake.install(monkeypatch)
    mon = mcuda.CudaMemoryMonitor(_cfg("hardware=rtx4080_16gb"), nvml_interval_s=0.01)
    mon.start()
    assert ("reset", 0) in fake.calls and ("empty_cache",) in fake.calls  # reset at trial start
    fake.alloc, fake.reserved = 7 * GIB, 8 * GIB  # build + initial eval peaks
    mon.phase("train")
    fake.alloc, fake.reserved = 12 * GIB, 14 * GIB  # training peaks
    mon.stop()
    state = {"params": 6 * GIB, "grads": GIB // 4, "optimizer": GIB // 2}
    m = mon.metrics(state)
    assert m["memory_kind"] == "cuda_reserved" and m["memory_phase"] == "train"
    assert m["peak_memory_bytes"] == m["cuda_max_reserved_bytes"] == 14 * GIB
    assert m["cuda_max_allocated_bytes"] == 12 * GIB
    assert m["cuda_fragmentation_bytes"] == 2 * GIB
    assert m["cuda_trial_peak_reserved_bytes"] == 14 * GIB
    bd = m["memory_breakdown_bytes"]
    assert bd == {
        "params": 6 * GIB,
        "grads": GIB // 4,
        "optimizer": GIB // 2,
        "activations": 12 * GIB - 6 * GIB - GIB // 4 - GIB // 2,
        "other": 2 * GIB,
    }
    assert sum(bd.values()) == m["peak_memory_bytes"]
    assert m["nvml_process_peak_bytes"] == 9 * GIB and m["nvml_device_used_peak_bytes"] == 10 * GIB
    meta = mon.meta()
    assert meta["alloc_conf"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert meta["cap"]["applied"] is True and meta["cap"]["cap_bytes"] == 15 * GIB
    assert meta["phases"]["setup"]["max_reserved_bytes"] == 8 * GIB
    assert meta["phases"]["train"]["max_allocated_bytes"] == 12 * GIB
    assert meta["nvml"]["available"] and meta["nvml"]["handle"] == "uuid GPU-0123-abcd"
    assert meta["device_name"] == "NVIDIA H200" and meta["allocator_backend"] == "native"
    assert not mon.nvml.is_alive()  # the sampler thread stops (and joins)
    json.dumps(meta), json.dumps(m)  # JSON-safe


def test_monitor_without_phases_measures_the_whole_trial(monkeypatch, fake_nvml):
    fake = FakeCuda(total=141 * GIB)
    fake.install(monkeypatch)
    mon = mcuda.CudaMemoryMonitor(_cfg("hardware=h200_141gb"), nvml_interval_s=0.01)
    mon.start()
    fake.alloc, fake.reserved = 3 * GIB, 3 * GIB + 5
    mon.stop()
    m = mon.metrics({"params": GIB})
    assert m["memory_phase"] == "trial" and m["peak_memory_bytes"] == 3 * GIB + 5
    assert m["memory_breakdown_bytes"]["activations"] == 2 * GIB and m["cuda_fragmentation_bytes"] == 5
    assert mon.meta()["cap"]["applied"] is False  # 138 GiB budget on a 141 GiB card: nothing to emulate


def test_nvml_missing_or_pid_hidden(monkeypatch, fake_nvml):
    fake = FakeCuda(total=141 * GIB)
    fake.install(monkeypatch)
    fake_nvml["pid"] = 424242  # a PID namespace hides us from NVML: only the device figure remains
    fake_nvml["uuid_ok"] = False
    mon = mcuda.CudaMemoryMonitor(_cfg("hardware=rtx4080_16gb"), nvml_interval_s=0.01)
    mon.start()
    mon.stop()
    m = mon.metrics({})
    assert m["nvml_process_peak_bytes"] is None and m["nvml_device_used_peak_bytes"] == 10 * GIB
    assert mon.meta()["nvml"]["handle"] == "index 0" and mon.meta()["nvml"]["process_visible"] is False
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    mon = mcuda.CudaMemoryMonitor(_cfg("hardware=rtx4080_16gb"), nvml_interval_s=0.01)
    mon.start()
    mon.stop()
    assert mon.metrics({})["nvml_process_peak_bytes"] is None
    assert mon.meta()["nvml"]["available"] is False and "Error" in mon.meta()["nvml"]["error"]


# ======================================================================================== arch builder
@pytest.mark.parametrize(
    ("quant", "cls", "per_layer"),
    [("nf4_dq", "Linear4bit", 7), ("int8", "Linear8bitLt", 7), ("none", None, 0)],
)
def test_arch_builder_quantises_in_place(quant, cls, per_layer):
    from transformers import AutoModelForCausalLM

    from vramsweep.knobs.arch import build_arch_model
    from vramsweep.knobs.build import count_quantised_layers, hf_config

    cfg = _cfg(*SMALL_ARCH, f"quant={quant}")
    model, notes = build_arch_model(cfg, "cpu")
    n = int(cfg.model.num_layers)
    assert count_quantised_layers(model) == ({cls: per_layer * n} if cls else {})
    assert notes["quantised_linears"] == per_layer * n
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.lm_head.weight.dtype is torch.bfloat16  # lm_head and embeddings stay in train.dtype
    ref = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.bfloat16)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert model.model.embed_tokens.weight.float().std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(model.model.norm.weight == 1)
    if quant == "nf4_dq":
        w = model.model.layers[0].mlp.down_proj.weight
        assert w.bnb_quantized and w.quant_state.nested and w.dtype is torch.uint8
        assert model.is_loaded_in_4bit and model.config.quantization_config.bnb_4bit_use_double_quant
    if quant == "int8":
        w = model.model.layers[0].self_attn.q_proj.weight
        assert w.dtype is torch.int8 and w.SCB is not None and model.is_loaded_in_8bit
    if quant == "none":
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
        assert model.model.layers[0].mlp.up_proj.weight.float().std().item() == pytest.approx(0.02, rel=0.1)


def test_arch_builder_never_holds_the_bf16_model():
    """The point of the direct path: peak live bytes while building a 4-bit model stay far below the
    bf16 model (an 8B would otherwise need 16 GB before quantisation)."""
    from vramsweep.knobs.arch import build_arch_model
    from vramsweep.measure.cpu import TensorMemoryTracker

    cfg = _cfg(*SMALL_ARCH, "quant=nf4_dq")
    tracker = TensorMemoryTracker(torch.nn.Module())
    with tracker:
        model, _ = build_arch_model(cfg, "cpu")
    m = cfg.model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = 2 * m.hidden_size * q + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.intermediate_size
    bf16_model = 2 * (
        m.num_layers * per_layer + 2 * m.vocab_size * m.hidden_size
    )  # linears + embed + lm_head
    assert tracker.peak_bytes < 0.5 * bf16_model, (tracker.peak_bytes, bf16_model)
    assert model is not None


def test_arch_builder_ties_embeddings_and_trains_lora():
    from peft import LoraConfig, get_peft_model

    from vramsweep.knobs.arch import build_arch_model

    cfg = _cfg(*SMALL_ARCH, "model.tie_word_embeddings=true", "quant=nf4")
    model, _ = build_arch_model(cfg, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    peft.train()
    ids = torch.randint(0, 256, (2, 16))
    peft(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in peft.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads)


def test_arch_builder_is_seeded():
    from vramsweep.knobs.arch import build_arch_model

    a, _ = build_arch_model(_cfg(*SMALL_ARCH, "train.seed=3"), "cpu")
    b, _ = build_arch_model(_cfg(*SMALL_ARCH, "train.seed=3"), "cpu")
    c, _ = build_arch_model(_cfg(*SMALL_ARCH, "train.seed=4"), "cpu")
    wa, wb, wc = (m.model.layers[1].mlp.gate_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


# ========================================================================================== smoke script
def _smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_sweep_file_plans_for_gpu_and_dry_run():
    from vramsweep.sweeper.engine import plan_from_args

    smoke = _smoke_module()
    gpu = plan_from_args(["sweep=gpu_smoke"])
    assert gpu.design == "ablation" and gpu.n_total == 6 and gpu.budget_gib == 15.0
    knobs = {o.split("=")[0] for p in gpu.points for o in p.overrides}
    assert sum("kernels=unsloth" in p.overrides for p in gpu.points) == 2  # Unsloth on the 8B architecture
    assert {"quant", "attention", "kernels", "checkpointing", "tiling", "context.max_tokens"} <= knobs
    dry = smoke.dry_design_overrides(ROOT / "sweeps" / "gpu_smoke.yaml")
    assert dry[0] == (
        "sweep.baseline=['quant=nf4_dq','attention=sdpa','kernels=none','checkpointing=on','context.max_tokens=128']"
    )
    assert dry[1] == (
        "sweep.factors=[['kernels=unsloth'],['checkpointing=offload'],['tiling=on'],"
        "['context.max_tokens=512','kernels=unsloth'],['context.max_tokens=512']]"
    )  # the same design, contexts / 8: the dry run plans and runs it (test_gpu_smoke_dry_run, slow)


def test_smoke_summary_and_bundle(tmp_path):
    from datetime import UTC, datetime

    smoke = _smoke_module()
    trials = [
        {
            "trial": 0,
            "status": "ok",
            "reason": None,
            "overrides": [],
            "config": {"model": {"name": "qwen3_8b"}},
            "metrics": {
                "peak_memory_bytes": 9 * GIB,
                "memory_kind": "cuda_reserved",
                "cuda_max_allocated_bytes": 8 * GIB,
                "cuda_fragmentation_bytes": GIB,
                "nvml_process_peak_bytes": int(9.5 * GIB),
                "tokens_per_s": 2500.0,
                "step_time_s": 0.41,
                "mfu": 0.21,
            },
            "meta": {
                "design": {"role": "baseline"},
                "wall_s": 20.0,
                "cuda": {"cap": {"applied": True, "cap_bytes": 15 * GIB, "profile": "rtx4080_16gb"}},
            },
        },
        {
            "trial": 1,
            "status": "oom",
            "reason": "OutOfMemoryError: CUDA out of memory | tried",
            "overrides": [],
            "metrics": {},
            "meta": {"design": {"role": "factor", "change": ["quant=none"]}},
        },
    ]
    env = {
        "torch": "2.11.0+cu130",
        "torch_cuda": "13.0",
        "device": "NVIDIA H200",
        "device_total_bytes": int(139.8 * GIB),
        "versions": {"bitsandbytes": "0.50.2"},
        "alloc_conf": {},
    }
    rows = smoke.summary_rows(trials)
    md = smoke.render_summary(
        rows,
        env,
        trials,
        dry=False,
        command="bash scripts/gpu_smoke.sh",
        when=datetime(2026, 11, 29, tzinfo=UTC),
        sweep_rc=0,
        timed_out=False,
    )
    assert md.startswith(
        "### GPU smoke — 2026-11-29 (NVIDIA H200, 139.8 GiB; emulating rtx4080_16gb: capped at 15.00 GiB)"
    )
    assert "| 0 | (baseline) | ok | 9.00 | 8.00 | 1.00 | 9.50 | 2500 | 0.41 | 0.210 |  |" in md
    assert "| 1 | quant=none | oom | – |" in md and "out of memory / tried" in md
    assert smoke.verdict(trials, 2, 0) == (
        True,
        "every trial that ran recorded a result and the baseline trained",
    )
    assert smoke.verdict(trials + [{"trial": 2, "status": "error"}], 3, 0)[0] is False
    (tmp_path / "sweep").mkdir()
    log = tmp_path / "log"
    log.write_text("x")
    files = smoke.bundle(
        tmp_path / "out",
        summary_md=md,
        summary_csv_text=smoke.summary_csv(rows),
        trials=trials,
        sweep_dir=tmp_path / "sweep",
        report_dir=tmp_path / "none",
        log=log,
    )
    assert [f.name for f in files] == ["smoke.log", "summary.csv", "summary.md", "trials.jsonl"]
    assert len((tmp_path / "out" / "trials.jsonl").read_text().splitlines()) == 2
    (tmp_path / "out" / "stray.txt").write_text("")
    with pytest.raises(SystemExit, match="other files"):
        smoke.bundle(
            tmp_path / "out",
            summary_md=md,
            summary_csv_text="",
            trials=[],
            sweep_dir=tmp_path,
            report_dir=tmp_path,
            log=log,
        )


@pytest.mark.slow
def test_gpu_smoke_dry_run(tmp_path):
    """``scripts/gpu_smoke.sh --dry-run``: the device script end to end on CPU, every phase in the issue's
    order (37.9), with the embedded tiny model (a few minutes on 2 idle cores; the subprocess may take the
    dry run's whole 2,400 s budget on loaded ones)."""
    out = tmp_path / "out"
    env = {**os.environ, "VRAMSWEEP_CACHE": os.environ["VRAMSWEEP_CACHE"], "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--dry-run", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=2460
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "bundle ready for the loan" in proc.stdout or "bundle is NOT ready" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["phases.json", "smoke.log", "summary.csv", "summary.md", "trials.jsonl"]
    results = json.loads((out / "phases.json").read_text())["results"]
    assert [r["phase"] for r in results] == [
        "env",
        "fork",
        "exact",
        "batching",
        "packing_bf16",
        "resume",
        "nf4_use",
        "memprobe",
        "memprobe_fp32",
        "memprobe_grouped",
        "trial",
        "snapshot",
        "step_time",
    ]  # the dry run also goes through the second call's opt-in phases
    status = {r["phase"]: r["status"] for r in results}
    assert status.pop("snapshot") == "not run"  # the allocator's trace is CUDA-only
    assert set(status.values()) == {"PASS"}, results
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["tokens"], r["adapter"]) for r in rows] == [
        ("memprobe", 224, "compute"),  # 57,344 / 256
        ("memprobe", 240, "compute"),  # 61,440 / 256: tried after 224 fitted
        ("memprobe_fp32", 176, "fp32"),
        ("memprobe_grouped", 224, "compute"),  # 57,344 / 256, ascending: 65,536 after it fitted (the dry
        ("memprobe_grouped", 256, "compute"),  # run's scaled cap leaves out 73,728)
        ("trial", 240, "compute"),  # the longest that fitted (no cap on CPU: all of them)
    ]
    assert all(r["status"] == "ok" and r["peak_reserved_bytes"] and r["estimate_bytes"] for r in rows)
    assert all(r["pool_bytes"] for r in rows)  # checkpointing=offload: the host pool is recorded
    md = (out / "summary.md").read_text()
    assert md.startswith("### GPU smoke — DRY RUN on CPU (") and "Verdict: PASS" in md
    assert "- fork: PASS: isolation fork (CUDA host: False)" in md
    assert "- exact: PASS: verdict: PASS" in md and "- batching: PASS: verdict: PASS" in md
    assert "64 MiB pinned round trip: not run (no CUDA device)" in md
    assert "- step_time: PASS: " in md and "median step time" in md
    # issue 53's third call: its figures in the phase lines, every call's cap sum printed
    assert "packed/padded" in md and "(bitwise)" in md and "step time deterministic / not" in md
    assert "model on cpu (" in md and "merged vs trained max |dlogit|" in md
    assert "--only packing_bf16,resume,nf4_use,memprobe_grouped: 538 s <= 540 s" in proc.stdout


# ================================================================================================== GPU
@pytest.fixture()
def uncapped():
    """Undo the per-process memory cap a GPU test applied (it would otherwise outlive the test)."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_arch_8b_nf4_builds_fast_under_a_16gib_cap(uncapped):
    import time

    from vramsweep.knobs.arch import build_arch_model

    cfg = _cfg("model=qwen3_8b", "quant=nf4_dq", "hardware=rtx4080_16gb")
    mon = mcuda.CudaMemoryMonitor(cfg)
    mon.start()
    t0 = time.perf_counter()
    model, notes = build_arch_model(cfg, "cuda")
    mon.stop()
    assert time.perf_counter() - t0 < 90 and notes["quantised_linears"] == 7 * 36
    m = mon.metrics({})
    assert m["cuda_max_allocated_bytes"] < 8 * GIB, m  # ~6.1 GB of NF4 linears + bf16 embeddings
    del model


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_trial_records_cuda_metrics_and_cap(tmp_path, uncapped, monkeypatch):
    from conftest import FAST
    from vramsweep.trial import run_trial_overrides

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    res = run_trial_overrides(["hardware=rtx4080_16gb", "quant=nf4", *FAST], result_path=tmp_path / "r.json")
    assert res["status"] == "ok", res["reason"]
    m, cuda = res["metrics"], res["meta"]["cuda"]
    assert m["memory_kind"] == "cuda_reserved" and m["peak_memory_bytes"] == m["cuda_max_reserved_bytes"]
    assert m["cuda_fragmentation_bytes"] == m["cuda_max_reserved_bytes"] - m["cuda_max_allocated_bytes"]
    assert cuda["alloc_conf"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    big = torch.cuda.get_device_properties(0).total_memory > 16.8 * GIB
    assert cuda["cap"]["applied"] is big and (not big or cuda["cap"]["cap_bytes"] == 15 * GIB)


# ============================================================================================== Unsloth
@pytest.mark.slow
@pytest.mark.skipif(not HAS_UNSLOTH, reason="unsloth not installed (make unsloth)")
def test_unsloth_trains_on_cpu(tmp_path, embedded_model_dir):
    """Real Unsloth (``make unsloth``): it loads the embedded model through FastLanguageModel, wraps it
    with its LoRA, and our loop trains it on the CPU (its no-GPU fallback)."""
    from vramsweep.knobs import build_model
    from vramsweep.trial import run_trial_overrides

    cfg = _cfg("kernels=unsloth", "adapter=rslora", "adapter.r=8", "context.max_tokens=128")
    built = build_model(cfg)
    peft_cfg = built.model.peft_config["default"]
    assert peft_cfg.r == 8 and peft_cfg.use_rslora is True
    assert sum(p.numel() for p in built.model.parameters() if p.requires_grad) > 0
    from conftest import FAST

    res = run_trial_overrides(["kernels=unsloth", *FAST], result_path=tmp_path / "r.json")
    assert res["status"] == "ok", (res["reason"], res["meta"].get("traceback"))
    assert res["meta"]["build"]["kernels"] == "unsloth.FastLanguageModel"
    m = res["metrics"]
    assert m["eval_loss"] < m["initial_eval_loss"] and m["state_bytes"]["grads"] > 0
