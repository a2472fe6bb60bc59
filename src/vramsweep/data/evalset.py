"""What a trial's held-out loss is over: the eval-set fingerprint (``meta.eval_set`` of a result).

Every trial of a sweep must score the same held-out tokens for its ``eval_loss`` to compare with another's.
The held-out records are rendered and masked under one reference, whatever the trial trains on
(:func:`vramsweep.data.prep.eval_reference`): the format's default ``data.train_on`` and, in a sweep, the
baseline's chat template, ``data.enable_thinking`` and ``context.max_tokens``
(:mod:`vramsweep.data.reference`), so a sweep over any of them scores one set. A trial whose context is too
short for the reference's examples scores its own and is marked ``comparable: false`` (with
``not_comparable``: why). Knobs that still change the scored tokens (``context.truncation``, the eval file,
the tokenizer, ``train.eval_batches``) change the fingerprint, and ``report``/``pick`` refuse to rank trials
whose fingerprints differ (:mod:`vramsweep.report.evalset`).

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
    ref = stats.get("eval_reference")
    if isinstance(ref, dict):  # what the records were rendered under; comparable: false names why
        out["reference"] = {k: v for k, v in ref.items() if k not in ("comparable", "not_comparable")}
        out["comparable"] = bool(ref.get("comparable", True))
        if ref.get("not_comparable"):
            out["not_comparable"] = str(ref["not_comparable"])
    return out
