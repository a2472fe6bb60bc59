"""``data.packing`` as the rules, the estimator and the build read it (no imports: every layer uses it).

Packed rows need no T x T mask: under eager/sdpa the model runs the segment-wise attention of
``vramsweep.knobs.packed_attention`` (causal attention per packed example), FlashAttention-2 its varlen
kernel; so packed rows have no length cap of their own beyond the model's positions and the budget.
"""

from __future__ import annotations

from typing import Any


def packed(cfg: Any) -> bool:
    """``data.packing``: rows of exactly ``context.max_tokens`` (data/packing.py)."""
    return bool(cfg.get("data", {}).get("packing", False))
