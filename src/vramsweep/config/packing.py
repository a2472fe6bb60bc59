"""``data.packing`` as the rules, the estimator and the build read it (no imports: every layer uses it)."""

from __future__ import annotations

from typing import Any

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
