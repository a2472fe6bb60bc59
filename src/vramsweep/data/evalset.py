"""What a trial's held-out loss is over: the eval-set fingerprint (``meta.eval_set`` of a result).

Every trial of a sweep must score the same held-out tokens for its ``eval_loss`` to compare with another's.
The held-out records are rendered and masked under the format's default ``data.train_on``, whatever the
trial trains on (:func:`vramsweep.data.prep.eval_reference`), so a sweep over ``data.train_on`` scores one
set. Knobs that still change the scored tokens (the template, ``data.enable_thinking``, truncation to
``context.max_tokens``, the eval file, the tokenizer, ``train.eval_batches``) change the fingerprint, and
``report``/``pick`` refuse to rank trials whose fingerprints differ (:mod:`vramsweep.report.evalset`).

The fingerprint is a hash of exactly what :func:`vramsweep.measure.eval.evaluate` scores: the token ids,
the labels (``-100`` where nothing is scored) and the fact spans of each example of the fixed eval subset
(:func:`vramsweep.data.prep.eval_subset`), taken before any vocabulary remapping (``vocab.mode``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.data.prep import EVAL_BATCH, eval_subset

#: Hex digits of the fingerprint kept in the result (64 bits: collisions are not a concern at sweep sizes).
FINGERPRINT_HEX = 16


def fingerprint(examples: Sequence[Any]) -> str:
    """A hash of the scored examples' ids, labels and fact spans, in order."""
    h = hashlib.sha256()
    for e in examples:
        for part in (e.input_ids, e.labels, [x for span in e.fact_spans for x in span]):
            h.update(len(part).to_bytes(4, "little"))
            h.update(array("q", (int(x) for x in part)).tobytes())
    return h.hexdigest()[:FINGERPRINT_HEX]


def scored_tokens(examples: Sequence[Any]) -> int:
    """Tokens the eval loss averages over (labels shift by one: position 0 predicts nothing)."""
    return sum(sum(1 for t in e.labels[1:] if t != IGNORE_INDEX) for e in examples)


def eval_set(examples: Sequence[Any], n_batches: int, stats: dict | None = None) -> dict[str, Any]:
    """``meta.eval_set``: the fingerprint of the held-out examples a trial scores (the eval subset of
    ``n_batches`` batches), their count, the scored tokens and the mask they were scored under."""
    scored = eval_subset(list(examples), int(n_batches) * EVAL_BATCH)
    stats = stats or {}
    out: dict[str, Any] = {
        "fingerprint": fingerprint(scored),
        "examples": len(scored),
        "scored_tokens": scored_tokens(scored),
    }
    for key, name in (("eval_train_on", "train_on"), ("format", "format"), ("eval_from", "eval_from")):
        if stats.get(key) is not None:
            out[name] = stats[key]
    if stats.get("random_tokens"):
        out["train_on"] = "all (random tokens)"
    return out
