"""Model FLOPs per token and MFU against the **physical** device that ran the trial.

A hardware profile (``hardware=rtx4080_16gb``) sets the memory budget, and on a bigger card the cap that
emulates the smaller one; it does not slow the bigger card down. So MFU's denominator is the peak of
the GPU that actually executed the steps, looked up by the name torch/NVML report
(``torch.cuda.get_device_name``). An unknown device gives ``mfu: null`` with the reason, never a guess.

Peaks are vendor dense tensor-core rates (no sparsity) for 16-bit inputs with fp32 accumulate, which is
what PyTorch's bf16/fp16 matmuls use. Sources: NVIDIA H100/H200, A100, L40S, L4, A10 datasheets; Ada
GeForce whitepaper (RTX 4090/4080 fp32-accumulate rate is half the fp16-accumulate rate); Turing T4
datasheet (fp16 only: T4 has no bf16 tensor cores).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TFLOPS = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """One row of the device table: a name pattern and its dense 16-bit tensor FLOP/s."""

    key: str
    pattern: str  # regex, matched case-insensitively against the reported device name
    peak_flops: float
    note: str = ""


#: Ordered: the first matching row wins, so specific variants come before their family.
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("b200", r"\bB200\b", 2250 * TFLOPS, "HGX B200, dense bf16"),
    DevicePeak("gh200", r"\bGH200\b", 989 * TFLOPS, "Grace Hopper: H100/H200-class GPU"),
    DevicePeak("h200_nvl", r"\bH200\b.*\bNVL\b", 835 * TFLOPS, "H200 NVL (PCIe)"),
    DevicePeak("h200", r"\bH200\b", 989 * TFLOPS, "H200 SXM"),
    DevicePeak("h100_nvl", r"\bH100\b.*\bNVL\b", 835 * TFLOPS, "H100 NVL"),
    DevicePeak("h100_pcie", r"\bH100\b.*\bPCIe\b", 756 * TFLOPS, "H100 PCIe"),
    DevicePeak("h100", r"\bH100\b", 989 * TFLOPS, "H100 SXM (HBM3)"),
    DevicePeak("h800", r"\bH800\b", 989 * TFLOPS, "H800 SXM"),
    DevicePeak("a100", r"\bA100\b", 312 * TFLOPS, "A100 40/80 GB, SXM and PCIe"),
    DevicePeak("a800", r"\bA800\b", 312 * TFLOPS, "A800"),
    DevicePeak("l40s", r"\bL40S\b", 362 * TFLOPS, "L40S"),
    DevicePeak("l40", r"\bL40\b", 181 * TFLOPS, "L40"),
    DevicePeak("l4", r"\bL4\b", 121 * TFLOPS, "L4"),
    DevicePeak("a10g", r"\bA10G\b", 125 * TFLOPS, "A10G (AWS)"),
    DevicePeak("a10", r"\bA10\b", 125 * TFLOPS, "A10"),
    DevicePeak("rtx6000_ada", r"RTX 6000 Ada", 364 * TFLOPS, "RTX 6000 Ada"),
    DevicePeak("rtx_a6000", r"RTX A6000", 155 * TFLOPS, "RTX A6000"),
    DevicePeak("rtx5090", r"RTX 5090", 209.5 * TFLOPS, "GeForce RTX 5090, fp32 accumulate"),
    DevicePeak("rtx4090", r"RTX 4090", 165.2 * TFLOPS, "GeForce RTX 4090, fp32 accumulate"),
    DevicePeak("rtx4080_super", r"RTX 4080 SUPER", 104.4 * TFLOPS, "GeForce RTX 4080 SUPER, fp32 accumulate"),
    DevicePeak("rtx4080", r"RTX 4080", 97.5 * TFLOPS, "GeForce RTX 4080, fp32 accumulate"),
    DevicePeak("rtx3090", r"RTX 3090", 71 * TFLOPS, "GeForce RTX 3090, fp32 accumulate"),
    DevicePeak("v100", r"\bV100\b", 125 * TFLOPS, "V100 (fp16 only)"),
    DevicePeak("t4", r"\bT4\b", 65 * TFLOPS, "T4 (fp16 only; bf16 runs without tensor cores)"),
)


def device_peak(name: str | None) -> DevicePeak | None:
    """The table row for a device name as torch/NVML report it (``"NVIDIA H200"``), or None."""
    if not name:
        return None
    for row in DEVICE_PEAKS:
        if re.search(row.pattern, name, flags=re.IGNORECASE):
            return row
    return None


def flops_per_token(
    *,
    total_params: int,
    trainable_params: int,
    num_layers: int,
    attn_width: int,
    mean_seq: float,
    recompute: bool,
) -> float:
    """Training FLOPs per token: forward 2P + input gradients 2P for every weight, + weight gradients 2P
    for the trainable ones, + a second forward 2P with activation recompute, + attention 12·L·h·s
    (FlashAttention-2 paper's 6·s·P + 12·L·h·s² per sequence, divided by s)."""
    frozen = total_params - trainable_params
    per_token = 4.0 * frozen + 6.0 * trainable_params
    if recompute:
        per_token += 2.0 * total_params
    return per_token + 12.0 * num_layers * attn_width * mean_seq


def mfu(
    per_token_flops: float, tokens_per_s: float | None, device_name: str | None
) -> tuple[float | None, dict]:
    """``(mfu, info)``: model FLOP/s over the physical device's peak; ``info`` says which peak and why
    ``mfu`` is null when it is."""
    info: dict = {"device": device_name, "flops_per_token": per_token_flops}
    if not tokens_per_s:
        info["reason"] = "no measured tokens/s"
        return None, info
    row = device_peak(device_name)
    if row is None:
        info["reason"] = (
            f"device {device_name!r} is not in the peak table (vramsweep.measure.flops.DEVICE_PEAKS)"
        )
        return None, info
    info.update(peak_key=row.key, peak_flops=row.peak_flops, peak_note=row.note)
    value = per_token_flops * float(tokens_per_s) / row.peak_flops
    if value > 1.0:  # impossible: a wrong FLOP count or a wrong peak; never report it as a fact
        info["reason"] = f"computed MFU {value:.3f} > 1 (FLOPs per token or device peak wrong): not reported"
        info["computed"] = value
        return None, info
    return value, info


def trial_mfu(cfg: Any, notes: dict, tokens_per_s: float | None, mean_seq: float, meta: dict) -> float | None:
    """A trial's MFU against the physical GPU that ran its steps (not the emulated profile's card): the
    composed config gives the shape, ``notes`` the build's parameter counts, ``meta["device"]`` the card;
    ``meta["mfu"]`` gets the peak used (or why there is none). Null on CPU."""
    if cfg.hardware.device != "cuda":
        return None
    per_token = flops_per_token(
        total_params=int(notes.get("total_params", 0)),
        trainable_params=int(notes.get("trainable_params", 0)),
        num_layers=int(cfg.model.num_layers),
        attn_width=int(cfg.model.num_heads) * int(cfg.model.head_dim),
        mean_seq=mean_seq,
        recompute=bool(cfg.checkpointing.enabled),
    )
    value, info = mfu(per_token, tokens_per_s, meta.get("device"))
    meta["mfu"] = info
    return value
