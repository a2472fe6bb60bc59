"""The step's shape and device (``train``, ``context``, ``hardware``): groups that only set values.

Nothing is built from them (the build reads ``train.dtype`` and ``hardware.device`` directly); this
provider turns them into the estimator's fields: bytes of the compute dtype, tokens per micro-batch, the
device, the CUDA context and the budget, with the assumptions they imply.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import ORDER, Estimating, KnobHooks, register
from vramsweep.record.units import GIB

#: Bytes per element of ``train.dtype`` (the compute / activation dtype).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def budget_bytes(cfg: Any) -> int | None:
    """``hardware.budget_gib`` in bytes (GiB = 2**30); None when 0 (no budget)."""
    gib = float(cfg.hardware.budget_gib)
    return int(gib * GIB) if gib > 0 else None


#: The longest packed row eager/SDPA attention accepts: their block-diagonal mask is a (rows, 1, T, T)
#: tensor (a bool one and, for SDPA, its compute-dtype copy: 768 MiB per row at 16,384 tokens in bf16,
#: 3 GiB at 32,768), quadratic where everything else grows linearly; FlashAttention-2 packs through
#: position_ids (varlen) and keeps no mask. The rules refuse longer rows; ``max_context`` stops there.
PACKED_MASK_MAX_TOKENS = 16_384


def packed(cfg: Any) -> bool:
    """``data.packing``: rows of exactly ``context.max_tokens`` (data/packing.py)."""
    return bool(cfg.get("data", {}).get("packing", False))


def packed_mask_cap(cfg: Any) -> int | None:
    """:data:`PACKED_MASK_MAX_TOKENS` when the config packs rows under a masked attention (eager/sdpa),
    else None (no packing, or varlen FlashAttention-2)."""
    if packed(cfg) and str(cfg.attention.implementation) != "flash_attention_2":
        return PACKED_MASK_MAX_TOKENS
    return None


def _estimate(cfg: Any, e: Estimating) -> dict[str, Any]:
    s = int(e.seq_len) if e.seq_len is not None else int(cfg.context.max_tokens)
    device = str(cfg.hardware.device)
    if packed(cfg):
        s = int(cfg.context.max_tokens)  # a packed row is always padded to the full length
        e.note(f"data.packing: every row is exactly {s} tokens (context.max_tokens)")
    else:
        e.note(
            f"every micro-batch is {s} tokens long (context.max_tokens): an upper bound for shorter documents"
        )
    if device == "cuda":
        e.note(
            "CUDA: the peak is the caching allocator's reserved memory (what the budget and the emulated cap "
            "limit): allocated tensors + the reserve model (idle loss blocks, one layer's cycling working set, "
            f"small-pool holes); the CUDA context (hardware.overhead_bytes={int(cfg.hardware.overhead_bytes)}) "
            "lives outside the allocator and is not counted against the budget"
        )
    return {
        "c": DTYPE_BYTES[str(cfg.train.dtype)],
        "micro_batch": int(cfg.train.micro_batch),
        "grad_accum": int(cfg.train.grad_accum),
        "seq_len": s,
        "device": device,
        "overhead": int(cfg.hardware.overhead_bytes) if device == "cuda" else 0,
        # documents of different lengths in one micro-batch are padded (arch models train on random ids);
        # packed rows get a block-diagonal (b,1,s,s) mask from their positions, like a padding mask
        "padded_batches": (int(cfg.train.micro_batch) > 1 or packed(cfg)) and cfg.model.source != "arch",
        "budget": budget_bytes(cfg),
        "allocator": device == "cuda",
    }


register(
    KnobHooks(
        name="step",
        estimate=_estimate,
        order=ORDER["step"],
        groups=("train", "context", "hardware"),
        notes_in="build",
    )
)
