"""Every knob changes what is built: each test fails if its knob were ignored."""

from __future__ import annotations

import math

import pytest
import torch

from vramsweep.config import compose
from vramsweep.knobs import build_model, build_optimizer
from vramsweep.measure import TensorMemoryTracker
from vramsweep.measure.cpu import (
    _quant_state_tensors,
    model_state_tensors,
    optimizer_state_tensors,
    tensor_bytes,
)

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _build(*overrides):
    cfg = compose(list(overrides))
    return cfg, build_model(cfg)


def _linear_bits(model, cls_name):
    """(bits/param incl. per-block constants, excluding the per-layer code tables) over quantised linears."""
    nbits, nparams = 0, 0
    for mod in model.modules():
        if type(mod).__name__ != cls_name:
            continue
        w = mod.weight
        nparams += mod.in_features * mod.out_features
        nbits += 8 * w.untyped_storage().nbytes()
        qs = w.quant_state
        nbits += 8 * qs.absmax.untyped_storage().nbytes()
        if qs.nested:
            nbits += 8 * qs.state2.absmax.untyped_storage().nbytes()
    return nbits / nparams


@pytest.mark.parametrize(
    ("quant", "expected_bits"), [("nf4_dq", 4.127), ("nf4", 4.5), ("fp4", 4.5), ("fp4_dq", 4.127)]
)
def test_4bit_quant_makes_linear4bit_at_expected_bits(quant, expected_bits):
    cfg, built = _build(f"quant={quant}")
    n_linear = 7 * cfg.model.num_layers  # q k v o gate up down
    assert built.notes["quantised_layers"].get("Linear4bit") == n_linear
    bits = _linear_bits(built.model, "Linear4bit")
    assert bits == pytest.approx(expected_bits, rel=0.01)
    qtypes = {
        m.weight.quant_state.quant_type for m in built.model.modules() if type(m).__name__ == "Linear4bit"
    }
    assert qtypes == {quant[:3]}
    # lm_head and embeddings stay unquantised
    assert built.model.get_output_embeddings().weight.dtype == torch.bfloat16


def test_int8_quant_makes_linear8bit():
    cfg, built = _build("quant=int8")
    assert built.notes["quantised_layers"].get("Linear8bitLt") == 7 * cfg.model.num_layers
    w = next(m.weight for m in built.model.modules() if type(m).__name__ == "Linear8bitLt")
    assert w.dtype == torch.int8


def test_param_bytes_fp32_gt_bf16_gt_nf4():
    sizes, base = {}, {}
    for name, over in {"fp32": ["train.dtype=fp32"], "bf16": [], "nf4": ["quant=nf4_dq"]}.items():
        _, built = _build(*over)
        sizes[name] = tensor_bytes(model_state_tensors(built.model))
        base[name] = sum(
            p.untyped_storage().nbytes() for n, p in built.model.named_parameters() if "lora_" not in n
        )
    assert sizes["fp32"] > sizes["bf16"] > sizes["nf4"]
    assert base["fp32"] == 2 * base["bf16"]  # LoRA adapters stay fp32 in both (PEFT autocast)


def _one_step(built, cfg):
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt, notes = build_optimizer(cfg, params)
    x = torch.randint(5, cfg.model.vocab_size, (1, 64))
    built.model.train()
    built.model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return opt, notes, params


def test_adamw_8bit_state_is_quarter_of_adamw():
    state = {}
    for opt_name in ("adamw", "adamw_8bit", "paged_adamw_8bit"):
        cfg, built = _build(f"optimizer={opt_name}")
        opt, notes, params = _one_step(built, cfg)
        state[opt_name] = tensor_bytes(optimizer_state_tensors(opt))
        dtypes = {
            v.dtype for s in opt.state.values() for k, v in s.items() if k in ("state1", "state2", "exp_avg")
        }
        if opt_name == "adamw":
            assert dtypes == {torch.float32}
            assert state[opt_name] >= 8 * sum(p.numel() for p in params)
        else:
            assert dtypes == {torch.uint8}, dtypes
    ratio = state["adamw_8bit"] / state["adamw"]
    assert 0.24 <= ratio <= 0.28, ratio
    assert state["paged_adamw_8bit"] == state["adamw_8bit"]


def test_paged_optimizer_on_cpu_records_fallback():
    cfg, built = _build("optimizer=paged_adamw_32bit")
    _, notes, _ = _one_step(built, cfg)
    assert notes["paged"] is False and "non-paged" in notes["paged_fallback"]
    assert "PagedAdamW" in notes["optimizer_class"]


def test_adafactor_state_is_factored():
    cfg, built = _build("optimizer=adafactor")
    opt, _, params = _one_step(built, cfg)
    assert tensor_bytes(optimizer_state_tensors(opt)) < 4 * sum(p.numel() for p in params)


def _peak_activations(*overrides, seq=384):
    cfg, built = _build(*overrides)
    model = built.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randint(5, cfg.model.vocab_size, (2, seq))
    tracker = TensorMemoryTracker(model, opt)
    with tracker:
        model(input_ids=x, labels=x).loss.backward()
    tracker.close()
    return tracker.breakdown()["activations"]


def test_checkpointing_lowers_tracked_activation_peak():
    off = _peak_activations("checkpointing=off")
    on = _peak_activations("checkpointing=on")
    assert on < 0.75 * off, (on, off)


def test_eager_attention_keeps_more_activations_than_sdpa():
    cfg, built = _build("attention=eager")
    assert built.notes["attn_implementation"] == "eager"
    eager = _peak_activations("attention=eager")
    sdpa = _peak_activations("attention=sdpa")
    assert eager > sdpa


def test_rslora_scaling_alpha_over_sqrt_r():
    for name, expected in (("lora", 32 / 16), ("rslora", 32 / math.sqrt(16))):
        _, built = _build(f"adapter={name}")
        scalings = {
            m.scaling["default"]
            for m in built.model.modules()
            if hasattr(m, "scaling") and isinstance(m.scaling, dict) and "default" in m.scaling
        }
        assert len(scalings) == 1 and next(iter(scalings)) == pytest.approx(expected)


def test_adapter_rank_changes_trainable_params():
    _, r8 = _build("adapter.r=8")
    _, r32 = _build("adapter.r=32")
    assert r32.notes["trainable_params"] == 4 * r8.notes["trainable_params"]


def test_dora_adds_magnitude_vectors():
    cfg, built = _build("adapter=dora")
    mags = [n for n, _ in built.model.named_parameters() if "lora_magnitude_vector" in n]
    assert len(mags) == 7 * cfg.model.num_layers
    _, lora = _build("adapter=lora")
    assert not [n for n, _ in lora.model.named_parameters() if "lora_magnitude_vector" in n]


def test_full_finetune_trains_every_param():
    _, built = _build("adapter=full")
    assert built.notes["trainable_params"] == built.notes["total_params"]


def test_lora_targets_restrict_adapted_modules():
    cfg, built = _build("adapter.targets=[q_proj,v_proj]")
    names = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in built.model.named_parameters() if "lora_A" in n
    }
    assert names == {"q_proj", "v_proj"}


def test_quant_state_tensors_are_counted_as_params():
    _, built = _build("quant=nf4_dq")
    w = next(m.weight for m in built.model.modules() if type(m).__name__ == "Linear4bit")
    assert len(list(_quant_state_tensors(w))) >= 4  # absmax, code, nested absmax, nested code (+offset)


@pytest.mark.parametrize("adapter_dtype", ["fp32", "compute"])
def test_lion_8bit_keeps_one_8bit_moment_counted_exactly_by_the_estimator(adapter_dtype):
    """optimizer=lion_8bit builds bitsandbytes' Lion8bit from its option file alone: one uint8 momentum + one
    fp32 absmax per 256 elements + one shared 256-entry qmap (Optimizer1State), no second moment, about
    half of AdamW8bit's state; the estimator's optimizer bytes equal the real state bytes exactly (with
    adapter.dtype=compute: fp32 masters and state sized by them)."""
    from vramsweep.estimate import estimate

    cfg, built = _build("optimizer=lion_8bit", f"adapter.dtype={adapter_dtype}")
    before = [p.detach().clone() for p in built.model.parameters() if p.requires_grad]
    opt, notes, params = _one_step(built, cfg)
    assert notes["optimizer_class"] == "bitsandbytes.optim.lion.Lion8bit"
    assert ("fp32_master" in notes) == (adapter_dtype == "compute")
    stepped = [p for g in opt.param_groups for p in g["params"]]
    for p in stepped:
        st = opt.state[p]
        assert "state2" not in st and st["state1"].dtype == torch.uint8 and st["state1"].shape == p.shape
        assert st["absmax1"].numel() == -(-p.numel() // 256) and st["qmap1"].numel() == 256
    assert any(not torch.equal(b, p) for b, p in zip(before, params))  # it stepped
    real = tensor_bytes(optimizer_state_tensors(opt))
    assert estimate(cfg, calibration=False)["components_bytes"]["optimizer"] == real
    n = sum(p.numel() for p in params)
    masters = 4 * n if adapter_dtype == "compute" else 0
    assert n <= real - masters <= 1.02 * n + 1024  # ~1 byte/param (+ absmax, qmap): half of adamw_8bit
