"""MFU against the physical device (issue: the 2026-12-01 H200 run under hardware=rtx4080_16gb read MFU
0.77, 1.10, 1.24, 3.20, 3.40, 4.63 because the RTX 4080's peak was the denominator)."""

from __future__ import annotations

import pytest

from vramsweep.config import compose
from vramsweep.measure.flops import DEVICE_PEAKS, device_peak, flops_per_token, mfu, trial_mfu

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
        ("NVIDIA A10G", "a10g", 125 * T),
    ],
)
def test_device_table_by_reported_name(name, key, peak):
    row = device_peak(name)
    assert row is not None and row.key == key and row.peak_flops == pytest.approx(peak)


def test_unknown_device_gives_null_with_reason():
    assert device_peak("NVIDIA Quantum Toaster") is None
    value, info = mfu(1e9, 1000.0, "NVIDIA Quantum Toaster")
    assert value is None and "not in the peak table" in info["reason"]
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
        recompute=True,
    )
    assert value == pytest.approx(per_token * tps / (989 * T))
    assert 0 < value <= 1
    assert meta["mfu"]["peak_key"] == "h200"
    # what the old code computed: the same FLOPs over the RTX 4080 peak
    assert per_token * tps / (97.5 * T) == pytest.approx(old, rel=0.1)


def test_mfu_above_one_is_not_reported():
    value, info = mfu(1e12, 1e6, "NVIDIA GeForce RTX 4080")
    assert value is None and "> 1" in info["reason"]


def test_cpu_mfu_is_null():
    cfg = compose([])
    assert trial_mfu(cfg, {"total_params": 1, "trainable_params": 1}, 100.0, 10, {"device": "cpu"}) is None
