"""Segment-wise attention for packed rows (``data.packing`` under ``attention=sdpa|eager``).

A packed row holds several examples, its ``position_ids`` restarting at 0 for each (and for the padding
after them: data/examples.py). transformers' own eager/SDPA path turns that into a dense block-diagonal
(rows, 1, T, T) mask, so a row's attention costs T² whatever its segments. Here each row is split at its
segment starts and every segment runs causal attention on its own: the cost is the sum of the segments'
squares, and no T x T mask exists.

Registered with transformers' ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask builder) under :data:`PACKED_NAMES`; the attention provider (knobs/attention.py) loads the model
with that name when the config packs. The mask builder returns no mask for a cache-free batch without a
padding mask (packed rows, unpadded rows: the attention function applies causality itself, per segment)
and otherwise defers to transformers' own ``sdpa``/``eager`` mask, which the attention function then hands
to transformers' own ``sdpa``/``eager`` forward (padded eval batches, generation with a cache).
"""

from __future__ import annotations

from typing import Any

import torch

#: attention.implementation -> the registered segment-wise implementation
PACKED_NAMES = {"sdpa": "vramsweep_packed_sdpa", "eager": "vramsweep_packed_eager"}

_last: list[Any] = [None, None]  # (position_ids tensor, its row segments): the bounds of the running forward
#: How many times a forward had to read ``position_ids`` back to the host (a device sync on CUDA): 0 when the
#: loop hands the bounds collate computed (:func:`remember`); tests read it.
HOST_READS = [0]


def bounds_of(position_ids: Any) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, end)`` of each segment (a segment starts where the position is 0), from a
    host tensor or nested lists (collate's, before anything is on the device)."""
    rows = []
    for row in position_ids.tolist() if hasattr(position_ids, "tolist") else position_ids:
        starts = [i for i, p in enumerate(row) if p == 0] or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
        rows.append(list(zip(starts, [*starts[1:], len(row)], strict=True)))
    return rows


def remember(position_ids: torch.Tensor, bounds: list[list[tuple[int, int]]]) -> None:
    """Hand the segment bounds collate computed on the host for ``position_ids`` (the tensor the forward will
    get): the forward then splits the rows without reading the positions back (no host sync)."""
    _last[0], _last[1] = position_ids, bounds


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, end)`` of each segment: the bounds :func:`remember` was given for this tensor,
    else read from it once per forward (a host read, counted in :data:`HOST_READS`)."""
    if _last[0] is position_ids:
        return _last[1]
    HOST_READS[0] += 1
    rows = bounds_of(position_ids)
    _last[0], _last[1] = position_ids, rows
    return rows


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _sdpa_segment(q, k, v, scaling, dropout, n_rep):
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    kw = {}
    if n_rep > 1:  # as transformers' sdpa without a mask: native GQA where it can, else repeat_kv copies
        if use_gqa_in_sdpa(None, k, v):
            kw["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, scale=scaling, is_causal=q.shape[2] > 1, **kw
    )


def _eager_segment(q, k, v, scaling, dropout, n_rep, training):
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    n = q.shape[2]
    if n > 1:
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        w = w.masked_fill(above, torch.finfo(w.dtype).min)
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = torch.nn.functional.dropout(w, p=dropout, training=training)
    return torch.matmul(w, v)


def _segmented(module, query, key, value, position_ids, scaling, dropout, eager):
    """(batch, seq, heads, head_dim): causal attention within each segment of each row."""
    n_rep = int(getattr(module, "num_key_value_groups", 1) or 1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    training = bool(getattr(module, "training", False))
    bounds = (
        segment_bounds(position_ids) if position_ids is not None else [[(0, query.shape[2])]] * query.shape[0]
    )
    if position_ids is not None and position_ids.shape[0] != query.shape[0]:
        bounds = bounds * query.shape[0]
    rows = []
    for r, segs in enumerate(bounds):
        parts = []
        for s, e in segs:
            q, k, v = query[r : r + 1, :, s:e], key[r : r + 1, :, s:e], value[r : r + 1, :, s:e]
            if eager:
                parts.append(_eager_segment(q, k, v, scaling, dropout, n_rep, training))
            else:
                parts.append(_sdpa_segment(q, k, v, scaling, dropout if training else 0.0, n_rep))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _forward(eager: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        same_length = query.shape[2] == key.shape[2]
        if attention_mask is None and same_length and kwargs.get("past_key_values") is None:
            return _segmented(module, query, key, value, kwargs.get("position_ids"), scaling, dropout, eager)
        if eager:  # a padding mask or a cache: transformers' own kernels
            from transformers.models.llama.modeling_llama import eager_attention_forward

            return eager_attention_forward(
                module, query, key, value, attention_mask, scaling, dropout, **kwargs
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    attention.__name__ = f"packed_{'eager' if eager else 'sdpa'}_attention"
    return attention


def _mask(base: str):
    def mask(*args, attention_mask=None, q_offset=0, kv_offset=0, q_length=None, kv_length=None, **kw):
        if attention_mask is None and not q_offset and not kv_offset and q_length == kv_length:
            return None  # causal within each segment: the attention function does it
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[base](
            *args,
            attention_mask=attention_mask,
            q_offset=q_offset,
            kv_offset=kv_offset,
            q_length=q_length,
            kv_length=kv_length,
            **kw,
        )

    return mask


def register() -> None:
    """Register :data:`PACKED_NAMES` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for base, name in PACKED_NAMES.items():
        AttentionInterface.register(name, _forward(base == "eager"))
        AttentionMaskInterface.register(name, _mask(base))
