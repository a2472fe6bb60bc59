"""Data: long documents -> sections -> truncation to the context budget -> token examples.

* :mod:`~vramsweep.data.synthetic`: the embedded synthetic grant reports (facts stated early, repeated later).
* :mod:`~vramsweep.data.documents`: the JSONL input format, its validation and the section rendering.
* :mod:`~vramsweep.data.tokenizer`: the embedded model's byte-level BPE tokenizer.
* :mod:`~vramsweep.data.truncation`: ``context.truncation`` strategies (none, head, tail, exp_decay).
* :mod:`~vramsweep.data.examples`: instructions + context -> target-section examples, collation, task spans.
* :mod:`~vramsweep.data.prep`: the data config -> a trial's train/eval examples and micro-batches
  (``trial_data``, ``collate_batch``, ``micro_batches``).

Names are imported lazily, so ``import vramsweep.data.truncation`` (e.g. from the estimator) does not pull in
torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "document_text": "documents",
    "format_section": "documents",
    "load_jsonl": "documents",
    "write_jsonl": "documents",
    "IGNORE_INDEX": "examples",
    "Example": "examples",
    "build_examples": "examples",
    "collate": "examples",
    "examples_stats": "examples",
    "span_exact_match": "examples",
    "generate_documents": "synthetic",
    "pretrain_documents": "synthetic",
    "pretrain_texts": "synthetic",
    "SPECIAL_TOKENS": "tokenizer",
    "train_tokenizer": "tokenizer",
    "STRATEGIES": "truncation",
    "ContextOverflowError": "truncation",
    "kept_lengths": "truncation",
    "truncate_sections": "truncation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"vramsweep.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'vramsweep.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
