"""Packing: training examples concatenated into rows of ``context.max_tokens``, without cross-example
attention.

:func:`pack_examples` fills rows by best-fit decreasing (each example, longest first, goes into the row
whose free space it fills best; ties between equal lengths keep a seeded order), then orders the rows by a
seeded shuffle: deterministic for a given data set and seed. A packed row is an :class:`Example` whose
``segments`` lists the length of each example in it, in order. The row's labels are its examples' labels,
with the first label of every segment after the first set to -100: that position would be predicted from
the previous example's last token (a causal LM's labels shift by one), which the unpacked example never
does — so a row's token losses are exactly its examples' token losses.

:func:`vramsweep.data.prep.collate_batch` gives a packed row ``position_ids`` that restart at 0 for each
example and pads it to ``context.max_tokens`` with a trailing segment of its own; the loop then passes no
attention mask; under eager/SDPA the model runs :mod:`vramsweep.knobs.packed_attention` (causal attention
per segment, split at the positions' restarts; no ``T x T`` mask), under ``flash_attention_2`` the varlen
kernel: no token attends to another example. With token-weighted accumulation
(:func:`vramsweep.loop.token_weights`) the loss and gradients of a packed step equal those of its examples
unpacked (``tests/data/test_packing.py``).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vramsweep.data.examples import IGNORE_INDEX, Example

__all__ = ["pack_examples", "packing_stats"]


def pack_examples(examples: Sequence[Example], max_tokens: int, seed: int) -> list[Example]:
    """Best-fit-decreasing packing of ``examples`` into rows of at most ``max_tokens`` tokens.

    Raises:
        ValueError: an example is longer than ``max_tokens`` (examples are truncated before packing).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)  # equal lengths: a seeded order, not the input's
    order.sort(key=lambda i: -len(examples[i].input_ids))  # stable: longest first
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row index), sorted: the best fit is the first >= n
    for i in order:
        n = len(examples[i].input_ids)
        if n > max_tokens:
            raise ValueError(f"example {examples[i].doc_id!r} has {n} tokens > max_tokens={max_tokens}")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, row = free.pop(at)
            rows[row].append(i)
            if room - n > 0:
                bisect.insort(free, (room - n, row))
        else:
            rows.append([i])
            if max_tokens - n > 0:
                bisect.insort(free, (max_tokens - n, len(rows) - 1))
    rng.shuffle(rows)
    return [_concat([examples[i] for i in row]) for row in rows]


def _concat(parts: Sequence[Example]) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    spans: list[tuple[int, int]] = []
    for k, e in enumerate(parts):
        base = len(ids)
        ids.extend(e.input_ids)
        lab = list(e.labels)
        if k > 0 and lab:
            lab[0] = IGNORE_INDEX  # never predicted from the previous example's last token
        labels.extend(lab)
        spans.extend((base + s, base + t) for s, t in e.fact_spans)
    first = parts[0]
    return replace(
        first,
        input_ids=ids,
        labels=labels,
        doc_id="+".join(e.doc_id for e in parts),
        n_context_tokens=sum(e.n_context_tokens for e in parts),
        fact_spans=spans,
        segments=[len(e.input_ids) for e in parts],
    )


def packing_stats(rows: Sequence[Example], max_tokens: int) -> dict[str, float | int]:
    """Rows, examples and the padding fraction of rows padded to ``max_tokens`` (for ``meta.data``)."""
    real = sum(len(r.input_ids) for r in rows)
    slots = len(rows) * max_tokens
    return {
        "rows": len(rows),
        "examples": sum(len(r.segments or [1]) for r in rows),
        "row_tokens": max_tokens,
        "padding_fraction": (1 - real / slots) if slots else 0.0,
    }


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
