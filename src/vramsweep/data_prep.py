"""Turn the data config into train/eval examples (documents -> sections -> truncation -> tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

EVAL_SEED_OFFSET = 100_003  # eval documents come from a disjoint seed stream
EVAL_BATCH = 4  # held-out batch size (fixed, so eval does not depend on train.micro_batch)


@dataclass
class TrialData:
    train: list
    eval: list
    pad_id: int
    stats: dict = field(default_factory=dict)


def load_documents(cfg: DictConfig) -> tuple[list[dict], list[dict]]:
    d = cfg.data
    if d.source == "embedded":
        from vramsweep.data.synthetic import generate_documents

        return (
            generate_documents(int(d.num_docs), int(d.seed)),
            generate_documents(int(d.num_eval_docs), int(d.seed) + EVAL_SEED_OFFSET),
        )
    from vramsweep.data.documents import load_jsonl

    docs = load_jsonl(str(d.path))
    if d.eval_path:
        return docs, load_jsonl(str(d.eval_path))
    n_eval = max(1, len(docs) // 10)
    if len(docs) < 2:
        raise ValueError(
            f"data.path={d.path}: need at least 2 documents (or data.eval_path) for a held-out eval"
        )
    return docs[:-n_eval], docs[-n_eval:]


def build_trial_data(cfg: DictConfig, tokenizer: Any) -> TrialData:
    """Examples for training and held-out eval, truncated to ``context.max_tokens`` as configured."""
    from vramsweep.data.examples import build_examples, examples_stats

    train_docs, eval_docs = load_documents(cfg)
    c = cfg.context
    kw = dict(
        max_tokens=int(c.max_tokens),
        truncation=str(c.truncation),
        decay=float(c.decay),
        min_tokens_per_section=int(c.min_tokens_per_section),
        instructions=str(cfg.data.instructions),
    )
    train = build_examples(train_docs, tokenizer, **kw)
    ev = build_examples(eval_docs, tokenizer, **kw)
    if not train:
        raise ValueError("the training documents produced no examples (need documents with >= 2 sections)")
    if not ev:
        raise ValueError("the eval documents produced no examples (need documents with >= 2 sections)")
    stats = {"train": examples_stats(train), "eval": examples_stats(ev)}
    return TrialData(train=train, eval=ev, pad_id=int(tokenizer.pad_token_id), stats=stats)
