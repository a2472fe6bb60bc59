"""The step's shape and device (``train``, ``context``, ``hardware``): groups that only set values.

Nothing is built from them (the build reads ``train.dtype`` and ``hardware.device`` directly); this
provider turns them into the estimator's fields: bytes of the compute dtype, tokens per micro-batch, the
device, the CUDA context and the budget, with the assumptions they imply.
"""

from __future__ import annotations

from typing import Any

from vramsweep.config.packing import packed
from vramsweep.knobs.registry import Estimating, KnobHooks, register
from vramsweep.record.units import GIB

#: Bytes per element of ``train.dtype`` (the compute / activation dtype).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def budget_bytes(cfg: Any) -> int | None:
    """``hardware.budget_gib`` in bytes (GiB = 2**30); None when 0 (no budget)."""
    gib = float(cfg.hardware.budget_gib)
    return int(gib * GIB) if gib > 0 else None


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
            "CUDA: the peak is the caching allocator's reserved memory (what the budget and the emulated "
            "cap limit): allocated tensors + the reserve model (idle loss blocks, one layer's cycling "
            "working set, small-pool holes); the CUDA context "
            f"(hardware.overhead_bytes={int(cfg.hardware.overhead_bytes)}) lives outside the allocator and "
            "is not counted against the budget"
        )
    return {
        "c": DTYPE_BYTES[str(cfg.train.dtype)],
        "micro_batch": int(cfg.train.micro_batch),
        "grad_accum": int(cfg.train.grad_accum),
        "seq_len": s,
        "device": device,
        "overhead": int(cfg.hardware.overhead_bytes) if device == "cuda" else 0,
        # documents of different lengths in one micro-batch are padded (arch models train on random ids);
        # packed rows are full rows without a mask (segment-wise attention, knobs/packed_attention.py)
        "padded_batches": int(cfg.train.micro_batch) > 1 and not packed(cfg) and cfg.model.source != "arch",
        "packed": packed(cfg),
        "budget": budget_bytes(cfg),
        "allocator": device == "cuda",
    }


register(
    KnobHooks(
        name="step",
        estimate=_estimate,
        groups=("train", "context", "hardware"),
        notes_in="build",
    )
)
