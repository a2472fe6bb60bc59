"""Model FLOPs per token and MFU against the **physical** device that ran the trial.

A hardware profile (``hardware=rtx4080_16gb``) sets the memory budget, and on a bigger card the cap that
emulates the smaller one; it does not slow the bigger card down. So MFU's denominator is the peak of
the GPU that actually executed the steps, looked up by the name torch/NVML report
(``torch.cuda.get_device_name``). An unknown device gives ``mfu: null`` with the reason, never a guess.

Peaks are vendor dense tensor-core rates (no sparsity) for 16-bit inputs with fp32 accumulate, which is
what PyTorch's bf16/fp16 matmuls use. Sources: NVIDIA H100/H200, A100, L40S, L4, A10 datasheets; Ada
GeForce whitepaper (RTX 4090/4080 fp32-accumulate rate is half the fp16-accumulate rate); Turing T4
datasheet (fp16 only: T4 has no bf16 tensor cores). The AWS A10G is not the A10: its brief gives 70 dense
bf16 TFLOP/s (the A10's datasheet 125).

FLOP conventions (PaLM, Chowdhery et al. 2022, appendix B):

* **MFU** counts the model FLOPs a training step must do, whatever the implementation: the matmuls of the
  weights the tokens are computed through, 4 per frozen parameter per token (forward 2 + input gradient 2)
  and 6 per trained one (+ weight gradient 2), plus attention's 12·L·h·s per token (non-causal, as PaLM).
  The input embedding is a lookup, not a matmul: it is left out (a tied lm_head is computed through the same
  weights and counts once; an untied lm_head counts). Norm weights stay in P (≈ 4e-5 of Qwen3-8B's).
  Activation recompute is not counted.
* **HFU** adds what gradient checkpointing recomputes: a second forward of the decoder layers (2 per layer
  parameter, LoRA included, + attention 4·L·h·s; the lm_head is outside the checkpointed layers), and the
  sequence-tiled MLP's recompute (``tiling=mlp``, ``vramsweep.longctx.mlp``): its backward runs each tile's
  forward once more, 2 per MLP parameter (LoRA inside the MLP included) per token of a tiled sequence, with or
  without checkpointing (with it, that is the MLP's third forward pass).
* **Attention** is counted non-causal, as PaLM does (12·L·h·s model, 4·L·h·s recompute). A causal kernel
  (FlashAttention-2, SDPA's flash path) skips the masked half, so ``meta.mfu`` also gives the causal count
  (6·L·h·s and 2·L·h·s) and ``mfu_causal`` / ``hfu_causal`` beside the PaLM figures, and states the share of
  the count that attention is (79 % for Qwen3-8B at 65,536 tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vramsweep.record.metrics import MetricName

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
    DevicePeak("a10g", r"\bA10G\b", 70 * TFLOPS, "A10G (AWS g5; NVIDIA's A10G brief, dense bf16)"),
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
    embedding_params: int = 0,
) -> float:
    """**Model** FLOPs per trained token (MFU's numerator, PaLM's convention; no recompute).

    Args:
        total_params: every parameter of the trained model (base + adapter), 4-bit weights unpacked.
        trainable_params: the parameters that get gradients (6 FLOPs/token each; the rest 4).
        embedding_params: the input embedding's parameters when it is not shared with the lm_head (a
            lookup: 0 FLOPs); 0 for tied embeddings.
        attn_width: heads × head dim (query side).
        mean_seq: mean tokens per sequence (attention's 12·L·h·s per token).
    """
    matmul = total_params - embedding_params
    frozen = matmul - trainable_params
    return 4.0 * frozen + 6.0 * trainable_params + 12.0 * num_layers * attn_width * mean_seq


def recompute_flops_per_token(
    *, layer_params: int, num_layers: int, attn_width: int, mean_seq: float
) -> float:
    """FLOPs per token that full activation checkpointing adds: a second forward through the decoder
    layers (2 per layer parameter, adapters included) and their attention (4·L·h·s). HFU counts it; MFU
    does not."""
    return 2.0 * layer_params + 4.0 * num_layers * attn_width * mean_seq


def attention_flops_per_token(*, num_layers: int, attn_width: int, mean_seq: float) -> float:
    """Attention's model FLOPs per token, non-causal (PaLM): 12·L·h·s (QK^T and AV, forward + backward);
    a causal kernel does half of it."""
    return 12.0 * num_layers * attn_width * mean_seq


def tiled_mlp_flops_per_token(*, mlp_params: int, tiled_share: float) -> float:
    """FLOPs per trained token that the sequence-tiled MLP's backward recompute adds (HFU only): one more
    forward of the tiled MLPs, 2 per MLP parameter, over the share of tokens whose sequence was tiled
    (longer than ``tiling.mlp_tile_tokens``; a sequence that fits in one tile runs the MLP plainly)."""
    return 2.0 * mlp_params * tiled_share


def tiled_mlp_params(cfg: Any, model: Any = None) -> int:
    """Parameters of the tiled MLPs: counted on the built model (the MLP modules ``tile_mlps`` patched,
    LoRA adapters inside them included, 4-bit weights unpacked), else from the config (gate, up and down
    projections of every layer, adapters left out); 0 when ``tiling.mlp_tile_tokens`` is 0."""
    tiling = getattr(cfg, "tiling", None)
    tile = int(getattr(tiling, "mlp_tile_tokens", 0) or 0)
    if tile <= 0:
        return 0
    if model is not None:
        mods = [m for m in model.modules() if getattr(m, "_vramsweep_tile_tokens", None) is not None]
        if mods:
            return int(sum(_weights(p) for m in mods for p in m.parameters()))
    m = cfg.model
    return 3 * int(m.hidden_size) * int(m.intermediate_size) * int(m.num_layers)


def _weights(p: Any) -> int:
    """Weights a parameter stands for (a packed 4-bit ``Params4bit`` holds two per uint8 element), as
    ``knobs.build.logical_numel`` counts ``notes["total_params"]``."""
    if type(p).__name__ == "Params4bit":
        return int(p.numel() * p.element_size() * 2)
    return int(p.numel())


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
            f"unknown peak FLOP/s: device {device_name!r} is not in the peak table "
            "(vramsweep.measure.flops.DEVICE_PEAKS)"
        )
        return None, info
    info.update(peak_key=row.key, peak_flops=row.peak_flops, peak_note=row.note)
    value = per_token_flops * float(tokens_per_s) / row.peak_flops
    if value > 1.0:  # impossible: a wrong FLOP count or a wrong peak; never report it as a fact
        info["reason"] = f"computed MFU {value:.3f} > 1 (FLOPs per token or device peak wrong): not reported"
        info["computed"] = value
        return None, info
    return value, info


def embedding_counts(cfg: Any, model: Any = None) -> tuple[int, int]:
    """``(input embedding params not shared with the lm_head, lm_head params)`` from the built model when
    given (vocabulary slicing changes them), else from the config."""
    if model is not None:
        try:
            emb = model.get_input_embeddings().weight
            head = model.get_output_embeddings()
            head_w = getattr(head, "weight", None)
            n_head = int(head_w.numel()) if head_w is not None else 0
            tied = head_w is not None and (head_w is emb or head_w.data_ptr() == emb.data_ptr())
            return (0 if tied else int(emb.numel())), n_head
        except (AttributeError, NotImplementedError):  # a wrapper without the accessors: use the config
            pass
    m = cfg.model
    per = int(m.vocab_size) * int(m.hidden_size)
    return (0 if bool(m.tie_word_embeddings) else per), per


def trial_mfu(
    cfg: Any,
    notes: dict,
    tokens_per_s: float | None,
    mean_seq: float,
    meta: dict,
    model: Any = None,
    tiled_share: float = 0.0,
) -> float | None:
    """A trial's MFU against the physical GPU that ran its steps (not the emulated profile's card): the
    composed config gives the shape, ``notes`` the build's parameter counts, ``meta["device"]`` the card,
    ``model`` (optional) the embedding and tiled-MLP sizes as built, ``tiled_share`` the share of the timed
    tokens whose sequence the tiled MLP split (``tiling=mlp``). ``meta["mfu"]`` gets the peak used (or why
    there is none), the convention, HFU (recompute included) beside MFU, and the causal-attention figures
    beside both. Null on CPU."""
    if cfg.hardware.device != "cuda":
        meta[MetricName.MFU.value] = {"device": meta.get("device"), "reason": NO_CUDA_REASON}
        return None
    total = int(notes.get("total_params", 0))
    trainable = int(notes.get("trainable_params", 0))
    embedding, lm_head = embedding_counts(cfg, model)
    layers = int(cfg.model.num_layers)
    width = int(cfg.model.num_heads) * int(cfg.model.head_dim)
    per_token = flops_per_token(
        total_params=total,
        trainable_params=trainable,
        num_layers=layers,
        attn_width=width,
        mean_seq=mean_seq,
        embedding_params=embedding,
    )
    attention = attention_flops_per_token(num_layers=layers, attn_width=width, mean_seq=mean_seq)
    recompute = recompute_attention = 0.0
    if bool(cfg.checkpointing.enabled):
        recompute = recompute_flops_per_token(
            layer_params=total - embedding - lm_head, num_layers=layers, attn_width=width, mean_seq=mean_seq
        )
        recompute_attention = attention / 3.0  # 4·L·h·s of the layers' second forward
    tiled = tiled_mlp_flops_per_token(mlp_params=tiled_mlp_params(cfg, model), tiled_share=tiled_share)
    value, info = mfu(per_token, tokens_per_s, meta.get("device"))
    info["convention"] = CONVENTION
    info["hardware_flops_per_token"] = per_token + recompute + tiled
    info["tiled_mlp_recompute_flops_per_token"] = tiled
    info["attention"] = ATTENTION_CONVENTION
    info["attention_flops_per_token"] = attention
    info["attention_share"] = attention / per_token if per_token else None
    # a causal kernel skips the masked half of QK^T and AV, in the model pass and in the recompute
    info["causal_flops_per_token"] = per_token - attention / 2.0
    info["causal_hardware_flops_per_token"] = (
        info["hardware_flops_per_token"] - (attention + recompute_attention) / 2
    )
    if info.get("peak_flops") and tokens_per_s:
        rate = float(tokens_per_s) / info["peak_flops"]
        for name, flops in (
            ("hfu", info["hardware_flops_per_token"]),
            ("mfu_causal", info["causal_flops_per_token"]),
            ("hfu_causal", info["causal_hardware_flops_per_token"]),
        ):
            info[name if flops * rate <= 1.0 else f"{name}_computed_above_1"] = flops * rate
    meta[MetricName.MFU.value] = info  # meta.mfu: how the metric was computed
    return value


#: ``meta.mfu.reason`` of a trial that did not run on a GPU (MFU is against a GPU's dense bf16 peak).
NO_CUDA_REASON = (
    "no CUDA device: MFU is model FLOP/s over a GPU's dense bf16 peak FLOP/s, and this trial ran on the CPU "
    "(hardware.device=cpu)"
)

#: Stated in every trial's ``meta.mfu``.
CONVENTION = (
    "PaLM: 4 FLOPs/token per frozen, 6 per trained non-embedding parameter + 12·L·h·s attention; "
    "recompute (checkpointing, the tiled MLP's backward) only in hfu"
)

#: ``meta.mfu.attention``: how the attention term is counted, and what the causal figures mean.
ATTENTION_CONVENTION = (
    "non-causal (PaLM): 12·L·h·s per token in mfu, 4·L·h·s more per recomputed forward in hfu; a causal "
    "kernel (FlashAttention-2, SDPA flash) skips half: mfu_causal and hfu_causal count 6·L·h·s and 2·L·h·s"
)
