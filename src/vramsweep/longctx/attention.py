"""Attention in head groups (``tiling.attention_heads=<G>``): each layer's attention runs as G calls over
GQA-aligned head groups, each its own autograd node.

Group g takes the kv heads ``[g·K/G, (g+1)·K/G)`` and the ``H/G`` query heads that share them, so every
call is an ordinary GQA attention with the layer's ``num_key_value_groups``; heads never interact, so the
concatenated output equals the ungrouped call's (fp32 on CPU: bitwise, in
tests/knobs/test_grouped_attention.py; bf16: to rounding of the kernel's own blocking).

Why: on CUDA, SDPA's flash backward (FlashAttention-2 ``mha_bwd``) allocates, per call, an fp32
``dq_accum``, ``dk``/``dv`` expanded to every query head before the GQA reduction and the fp32
``softmax_d``: heads × (2·head_dim + 1) × 4 B per token in bf16 (Qwen3-8B: 32,896 B/token, 2.01 GiB at
65,536 tokens — the allocation that ran out of memory on 2026-12-04). A group's call needs 1/G of it; the
groups' backward runs one after the other, so the block is 1/G. What does not shrink: the kernel's
``dq``/``dk``/``dv`` outputs (compute dtype), which stay alive until the last group is done, and the
concatenation of the query gradient (``split``'s backward: one more query-sized block at that moment).
:func:`vramsweep.estimate.analytic.attention_backward_bytes_per_token` counts both.

The base implementation (sdpa, eager, flash_attention_2, or the segment-wise packed variants of
:mod:`vramsweep.knobs.packed_attention`) is registered under ``vramsweep_grouped_<base>`` with
transformers' ``AttentionInterface`` (and the base's mask builder under the same name); the group count is
read from each attention module's ``_vramsweep_attention_groups`` (set by :func:`group_attention`).
Attention weights are not returned (the decoder layers discard them in training).
"""

from __future__ import annotations

from typing import Any

import torch

GROUPED_PREFIX = "vramsweep_grouped_"
GROUPS_ATTR = "_vramsweep_attention_groups"


def grouped_name(base: str) -> str:
    """The registered name of the grouped wrapper of attention implementation ``base``."""
    return base if base.startswith(GROUPED_PREFIX) else GROUPED_PREFIX + base


def base_name(name: str | None) -> str | None:
    """The implementation a (possibly grouped) name wraps."""
    if name is not None and name.startswith(GROUPED_PREFIX):
        return name[len(GROUPED_PREFIX) :]
    return name


def allowed_groups(num_heads: int, num_kv_heads: int) -> list[int]:
    """Group counts that keep every group GQA-aligned: the divisors of the kv-head count."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return [1]
    return [g for g in range(1, num_kv_heads + 1) if num_kv_heads % g == 0]


def head_groups(num_heads: int, num_kv_heads: int, groups: int) -> list[tuple[int, int]]:
    """Per group, (query heads, kv heads) in order; raises ValueError if ``groups`` splits a kv head's
    query heads apart or does not divide the kv heads."""
    if groups not in allowed_groups(num_heads, num_kv_heads):
        raise ValueError(
            f"tiling.attention_heads={groups}: the groups must divide the {num_kv_heads} kv heads "
            f"(query heads {num_heads}); allowed: {allowed_groups(num_heads, num_kv_heads)}"
        )
    return [(num_heads // groups, num_kv_heads // groups)] * groups


def _base_function(base: str):
    if base == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def grouped_call(fn, groups: int, module, query, key, value, attention_mask, **kwargs):
    """``fn`` (a transformers attention function, ``(batch, heads, seq, head_dim)`` inputs,
    ``(batch, seq, heads, head_dim)`` output) over ``groups`` head groups; one call when ``groups`` is 1.

    With grad, the inputs are ``split`` (one autograd node that concatenates the groups' gradients) and
    the outputs concatenated; without grad the groups write into one preallocated output."""
    if groups <= 1:
        return fn(module, query, key, value, attention_mask, **kwargs)
    if getattr(module, "sinks", None) is not None:
        raise ValueError("tiling.attention_heads > 1 does not support attention sinks (per-head s_aux)")
    (qh, kh), *_ = head_groups(query.shape[1], key.shape[1], groups)
    qs, ks, vs = query.split(qh, dim=1), key.split(kh, dim=1), value.split(kh, dim=1)
    if torch.is_grad_enabled():
        outs = [fn(module, q, k, v, attention_mask, **kwargs)[0] for q, k, v in zip(qs, ks, vs, strict=True)]
        return torch.cat(outs, dim=2), None
    out = None
    for g, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        o = fn(module, q, k, v, attention_mask, **kwargs)[0]
        if out is None:
            out = o.new_empty((o.shape[0], o.shape[1], query.shape[1], o.shape[3]))
        out[:, :, g * qh : (g + 1) * qh] = o
        del o
    return out, None


def _forward(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        groups = int(getattr(module, GROUPS_ATTR, 1) or 1)
        return grouped_call(_base_function(base), groups, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"grouped_{base}_attention"
    return attention


def register(base: str) -> str:
    """Register the grouped wrapper of ``base`` (and ``base``'s mask builder) with transformers;
    returns its name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = grouped_name(base)
    AttentionInterface.register(name, _forward(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def group_attention(model: torch.nn.Module, groups: int) -> dict[str, Any]:
    """Set the head-group count on every decoder layer's ``self_attn`` of ``model`` (checked against its
    heads); the model must run a grouped implementation (:func:`register`). Returns the build notes."""
    n = 0
    for module in model.modules():
        attn = getattr(module, "self_attn", None)
        if not isinstance(attn, torch.nn.Module) or not hasattr(module, "mlp"):
            continue
        cfg = attn.config
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_groups(heads, kv, groups)  # raises with the allowed counts
        setattr(attn, GROUPS_ATTR, int(groups))
        n += 1
    if not n:
        raise RuntimeError("tiling.attention_heads found no decoder layer with a self_attn module")
    return {"groups": int(groups), "layers": n}
