"""MFU against the physical device: the peak FLOPs of the GPU that ran, not of the ``hardware`` profile
(an H200 run under ``hardware=rtx4080_16gb`` must not read MFU above 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vramsweep.config import compose
from vramsweep.measure.flops import (
    DEVICE_PEAKS,
    device_peak,
    embedding_counts,
    flops_per_token,
    mfu,
    trial_mfu,
)

T = 1e12


@pytest.mark.parametrize(
    ("name", "key", "peak"),
    [
        ("NVIDIA H200", "h200", 989 * T),
        ("NVIDIA H200 NVL", "h200_nvl", 835 * T),
        ("NVIDIA H100 80GB HBM3", "h100", 989 * T),
        ("NVIDIA H100 PCIe", "h100_pcie", 756 * T),
        ("NVIDIA A100-SXM4-80GB", "a100", 312 * T),
        ("NVIDIA A100 80GB PCIe", "a100", 312 * T),
        ("NVIDIA L40S", "l40s", 362 * T),
        ("NVIDIA L4", "l4", 121 * T),
        ("NVIDIA GeForce RTX 4090", "rtx4090", 165.2 * T),
        ("NVIDIA GeForce RTX 4080", "rtx4080", 97.5 * T),
        ("NVIDIA GeForce RTX 4080 SUPER", "rtx4080_super", 104.4 * T),
        ("Tesla T4", "t4", 65 * T),
        ("NVIDIA A10G", "a10g", 70 * T),
    ],
)
def test_device_table_by_reported_name(name, key, peak):
    row = device_peak(name)
    assert row is not None and row.key == key and row.peak_flops == pytest.approx(peak)


def test_unknown_device_gives_null_with_reason():
    assert device_peak("NVIDIA Quantum Toaster") is None
    value, info = mfu(1e9, 1000.0, "NVIDIA Quantum Toaster")
    assert (
        value is None
        and info["reason"].startswith("unknown peak FLOP/s")
        and "not in the peak table" in info["reason"]
    )
    assert mfu(1e9, None, "NVIDIA H200")[0] is None


def test_keys_unique():
    keys = [r.key for r in DEVICE_PEAKS]
    assert len(keys) == len(set(keys))


# The 2026-12-01 run: Qwen3-8B architecture, nf4_dq + LoRA r16, checkpointing, hardware=rtx4080_16gb on an
# H200. (tokens/s, mean tokens per sequence, MFU as recorded against the RTX 4080 peak)
GPU_RUN = [(1461.97, 1024, 0.769), (2351.98, 1024, 1.238), (5491.73, 4096, 3.196), (5847.74, 4096, 3.403)]


@pytest.mark.parametrize(("tps", "seq", "old"), GPU_RUN)
def test_emulated_profile_uses_the_physical_h200_peak(tps, seq, old):
    cfg = compose(
        ["model=qwen3_8b", "quant=nf4_dq", "hardware=rtx4080_16gb", "checkpointing=on"],
        rules="none",
    )
    total, trainable = 8_190_735_360, 43_646_976  # Qwen3-8B + LoRA r16 all-linear
    notes = {"total_params": total, "trainable_params": trainable}
    meta = {"device": "NVIDIA H200"}
    value = trial_mfu(cfg, notes, tps, seq, meta)
    per_token = flops_per_token(
        total_params=total,
        trainable_params=trainable,
        num_layers=36,
        attn_width=32 * 128,
        mean_seq=seq,
        embedding_params=151_936 * 4096,  # untied: the input embedding is a lookup
    )
    assert value == pytest.approx(per_token * tps / (989 * T))
    assert 0 < value <= 1
    assert meta["mfu"]["peak_key"] == "h200"
    # what the old code computed: HFU-like FLOPs (recompute + embedding, ~1.5x) over the RTX 4080 peak
    assert meta["mfu"]["hfu"] * 989 / 97.5 == pytest.approx(old, rel=0.1)


def test_mfu_above_one_is_not_reported():
    value, info = mfu(1e12, 1e6, "NVIDIA GeForce RTX 4080")
    assert value is None and "> 1" in info["reason"]


def test_cpu_mfu_is_null():
    cfg = compose([])
    assert trial_mfu(cfg, {"total_params": 1, "trainable_params": 1}, 100.0, 10, {"device": "cpu"}) is None


# Hand computation, Qwen3-8B (hidden 4096, MLP 12288, 36 layers, 32 query / 8 kv heads of 128, vocab
# 151,936, untied lm_head) + LoRA r16 on every linear of the decoder layers, nf4_dq, checkpointing on.
H, MLP, L, V, KV = 4096, 12288, 36, 151_936, 1024
LAYER_LINEAR = 2 * H * H + 2 * H * KV + 3 * H * MLP  # q, o + k, v + gate, up, down = 192,937,984
LAYER_NORMS = 2 * H + 2 * 128  # input/post-attention RMSNorm + q_norm/k_norm
LORA = L * 16 * (2 * (H + H) + 2 * (H + KV) + 3 * (H + MLP))  # 43,646,976
EMB = V * H  # input embedding = lm_head size: 622,329,856
TOTAL = L * (LAYER_LINEAR + LAYER_NORMS) + 2 * EMB + H + LORA  # every parameter of the PEFT model


def _qwen3_8b_cfg(*, checkpointing: bool) -> SimpleNamespace:
    """What trial_mfu reads of the composed config (conf/model/qwen3_8b.yaml), without composing."""
    model = SimpleNamespace(
        num_layers=L, num_heads=32, head_dim=128, vocab_size=V, hidden_size=H, tie_word_embeddings=False
    )
    return SimpleNamespace(
        model=model,
        hardware=SimpleNamespace(device="cuda"),
        checkpointing=SimpleNamespace(enabled=checkpointing),
    )


def hand_mfu_flops(s: int) -> float:
    frozen_matmul = L * LAYER_LINEAR + EMB  # the decoder linears + the lm_head (a matmul); no embedding
    return 4 * frozen_matmul + 6 * LORA + 12 * L * (32 * 128) * s


def hand_recompute_flops(s: int) -> float:
    return 2 * (L * LAYER_LINEAR + LORA) + 4 * L * (32 * 128) * s  # decoder layers' second forward


@pytest.mark.parametrize(
    ("seq", "mfu_flops", "hfu_flops"),
    [(1024, 32_346_210_304, 46_929_018_880), (65_536, 146_498_387_968, 199_131_922_432)],
)
def test_mfu_is_palm_model_flops_and_hfu_adds_recompute(seq, mfu_flops, hfu_flops):
    """MFU = model FLOPs (no recompute, no embedding lookup); HFU beside it, with the recompute."""
    assert TOTAL - LORA == 8_190_735_360 and LORA == 43_646_976
    assert hand_mfu_flops(seq) == mfu_flops
    assert hand_mfu_flops(seq) + hand_recompute_flops(seq) == hfu_flops
    cfg = _qwen3_8b_cfg(checkpointing=True)
    tps = 1461.97
    meta = {"device": "NVIDIA H200"}
    value = trial_mfu(cfg, {"total_params": TOTAL, "trainable_params": LORA}, tps, seq, meta)
    # norm weights stay in P at 4 FLOPs each: 4 * 308,224 = 1.2 MFLOP/token (4e-5 relative)
    assert value == pytest.approx(mfu_flops * tps / (989 * T), rel=1e-4)
    assert meta["mfu"]["hfu"] == pytest.approx(hfu_flops * tps / (989 * T), rel=1e-4)
    assert meta["mfu"]["hardware_flops_per_token"] / meta["mfu"]["flops_per_token"] == pytest.approx(
        hfu_flops / mfu_flops, rel=1e-4
    )
    assert "PaLM" in meta["mfu"]["convention"]


def test_mfu_without_checkpointing_equals_hfu():
    cfg = _qwen3_8b_cfg(checkpointing=False)
    meta = {"device": "NVIDIA H200"}
    value = trial_mfu(cfg, {"total_params": TOTAL, "trainable_params": LORA}, 1000.0, 1024, meta)
    assert value == pytest.approx(meta["mfu"]["hfu"])


def test_tied_embedding_counts_once_as_the_lm_head():
    """A tied embedding is the lm_head's weight: a matmul, counted once (the lookup is free)."""
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight

    class M(torch.nn.Module):
        def get_input_embeddings(self):
            return emb

        def get_output_embeddings(self):
            return head

    cfg = _qwen3_8b_cfg(checkpointing=False)
    assert embedding_counts(cfg, M()) == (0, 800)
    head.weight = torch.nn.Parameter(torch.zeros(100, 8))
    assert embedding_counts(cfg, M()) == (800, 800)


def test_a10g_is_not_an_a10():
    """NVIDIA's A10G brief: 70 dense bf16 TFLOP/s (the A10 datasheet's 125 is another card)."""
    assert device_peak("NVIDIA A10G").peak_flops == pytest.approx(70 * T)
    assert device_peak("NVIDIA A10").peak_flops == pytest.approx(125 * T)


# The tiled MLP's backward recompute (the MLP's third forward with checkpointing) and the
# causal-attention figure beside PaLM's non-causal one.
MLP_PARAMS = L * 3 * H * MLP  # gate, up, down of every layer: 5,435,817,984
MLP_LORA = L * 16 * 3 * (H + MLP)  # LoRA r16 on gate, up, down: 28,311,552


def _tiled_cfg(*, checkpointing: bool, tile: int) -> SimpleNamespace:
    cfg = _qwen3_8b_cfg(checkpointing=checkpointing)
    cfg.model.intermediate_size = MLP
    cfg.tiling = SimpleNamespace(mlp_tile_tokens=tile)
    return cfg


@pytest.mark.parametrize("checkpointing", [True, False])
def test_hfu_counts_the_tiled_mlp_recompute(checkpointing):
    """tiling=mlp: the tiled backward runs each tile's forward once more (with checkpointing that is the MLP's
    third pass): 2 FLOPs per MLP parameter per tiled token, 10.9 GFLOP/token for Qwen3-8B. MFU unchanged."""
    assert 2 * MLP_PARAMS == 10_871_635_968
    notes = {"total_params": TOTAL, "trainable_params": LORA}
    seq, tps = 65_536, 300.0
    plain, tiled = {"device": "NVIDIA H200"}, {"device": "NVIDIA H200"}
    v0 = trial_mfu(_tiled_cfg(checkpointing=checkpointing, tile=0), notes, tps, seq, plain, tiled_share=1.0)
    v1 = trial_mfu(
        _tiled_cfg(checkpointing=checkpointing, tile=4096), notes, tps, seq, tiled, tiled_share=1.0
    )
    assert v0 == v1  # model FLOPs: recompute is not counted
    extra = tiled["mfu"]["hardware_flops_per_token"] - plain["mfu"]["hardware_flops_per_token"]
    assert extra == 2 * MLP_PARAMS == tiled["mfu"]["tiled_mlp_recompute_flops_per_token"]
    assert tiled["mfu"]["hfu"] - plain["mfu"]["hfu"] == pytest.approx(2 * MLP_PARAMS * tps / (989 * T))
    expected = hand_mfu_flops(seq) + (hand_recompute_flops(seq) if checkpointing else 0) + 2 * MLP_PARAMS
    assert tiled["mfu"]["hardware_flops_per_token"] == pytest.approx(expected, rel=1e-4)
    # only the tokens of sequences longer than a tile are tiled
    half = {"device": "NVIDIA H200"}
    trial_mfu(_tiled_cfg(checkpointing=checkpointing, tile=4096), notes, tps, seq, half, tiled_share=0.5)
    assert half["mfu"]["tiled_mlp_recompute_flops_per_token"] == MLP_PARAMS


def test_tiled_mlp_params_from_the_built_model_include_its_adapters():
    """Counted on the modules tile_mlps patched (LoRA inside them included), else from the config."""
    torch = pytest.importorskip("torch")
    from vramsweep.longctx.mlp import tile_mlps
    from vramsweep.measure.flops import tiled_mlp_params

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Linear(4, 4)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4, bias=False))

    model = torch.nn.Sequential(Layer(), Layer())
    cfg = SimpleNamespace(
        tiling=SimpleNamespace(mlp_tile_tokens=2),
        model=SimpleNamespace(hidden_size=4, intermediate_size=8, num_layers=2),
    )
    assert tiled_mlp_params(cfg, model) == 3 * 4 * 8 * 2  # not patched yet: the config's 3·h·i·L
    assert tile_mlps(model, 2) == 2
    assert tiled_mlp_params(cfg, model) == 2 * (4 * 8 + 8 + 8 * 4)  # the patched MLPs, biases included
    cfg.tiling.mlp_tile_tokens = 0
    assert tiled_mlp_params(cfg, model) == 0


def test_attention_convention_stated_and_causal_figures_beside():
    """At 65,536 tokens 79 % of Qwen3-8B's count is non-causal attention; a causal kernel does half of it."""
    seq, tps = 65_536, 300.0
    meta = {"device": "NVIDIA H200"}
    notes = {"total_params": TOTAL, "trainable_params": LORA}
    value = trial_mfu(_qwen3_8b_cfg(checkpointing=True), notes, tps, seq, meta)
    info = meta["mfu"]
    attention = 12 * L * 32 * 128 * seq
    assert info["attention_flops_per_token"] == attention == 115_964_116_992
    assert info["attention_share"] == pytest.approx(attention / hand_mfu_flops(seq), rel=1e-4)
    assert round(info["attention_share"], 2) == 0.79
    assert (
        "non-causal" in info["attention"]
        and "PaLM" in info["attention"]
        and "mfu_causal" in info["attention"]
    )
    causal = hand_mfu_flops(seq) - attention / 2
    assert info["causal_flops_per_token"] == pytest.approx(causal, rel=1e-4)
    assert info["mfu_causal"] == pytest.approx(causal * tps / (989 * T), rel=1e-4)
    assert info["mfu_causal"] / value == pytest.approx(causal / hand_mfu_flops(seq), rel=1e-4)
    causal_hw = hand_mfu_flops(seq) + hand_recompute_flops(seq) - (12 + 4) * L * 32 * 128 * seq / 2
    assert info["causal_hardware_flops_per_token"] == pytest.approx(causal_hw, rel=1e-4)
    assert info["hfu_causal"] == pytest.approx(causal_hw * tps / (989 * T), rel=1e-4)


def test_timing_share_of_tiled_tokens():
    """The trial's tiled share: the timed tokens of micro-batches longer than the tile."""
    torch = pytest.importorskip("torch")
    from vramsweep.loop import Timing
    from vramsweep.measure.steps import StepClock

    timing = Timing(StepClock(), timed_from=0)
    timing.on_step_start(0)
    for length, n in ((8, 10), (16, 30)):
        ids = torch.zeros(2, length, dtype=torch.long)
        timing.on_micro_batch(0, {"n_tokens": n, "n_targets": n, "input_ids": ids, "attention_mask": ids})
    assert timing.share_longer_than(8) == pytest.approx(0.75)
    assert timing.share_longer_than(16) == 0.0 and timing.share_longer_than(0) == 0.0
    assert timing.share_longer_than(4) == 1.0


def test_a_model_without_embedding_accessors_falls_back_to_the_config_and_a_bug_is_not_hidden():
    """Only a missing accessor falls back to the config's counts; any other error in reading them raises."""
    cfg = _qwen3_8b_cfg(checkpointing=False)
    assert embedding_counts(cfg, object()) == embedding_counts(cfg)

    class Broken:
        def get_input_embeddings(self):
            raise RuntimeError("a bug in the model wrapper")

    with pytest.raises(RuntimeError, match="a bug"):
        embedding_counts(cfg, Broken())
