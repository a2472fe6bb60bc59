"""Turn the data config into train/eval examples (documents -> sections -> truncation -> tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from vramsweep.data.documents import load_jsonl
from vramsweep.data.synthetic import generate_documents

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
        return (
            generate_documents(int(d.num_docs), int(d.seed)),
            generate_documents(int(d.num_eval_docs), int(d.seed) + EVAL_SEED_OFFSET),
        )

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


def trial_data(cfg: DictConfig, tokenizer: Any) -> TrialData:
    """Documents -> examples, or exact-length random tokens (``data=random``, or a model without tokenizer)."""
    if tokenizer is None or cfg.data.source == "random":
        return random_token_data(cfg)
    return build_trial_data(cfg, tokenizer)


def random_token_data(cfg: DictConfig):
    """Random token sequences of exactly ``context.max_tokens`` (architecture-only models have no tokenizer;
    ``data=random`` asks for them: memory/speed at an exact length, e.g. max-context searches)."""
    import torch

    from vramsweep.data.examples import Example

    g = torch.Generator().manual_seed(int(cfg.data.seed))
    n = max(8, int(cfg.train.micro_batch) * 2)
    L = int(cfg.context.max_tokens)
    V = int(cfg.model.vocab_size)

    def mk(i: int) -> Example:
        ids = torch.randint(3, V, (L,), generator=g).tolist()
        return Example(
            input_ids=ids,
            labels=list(ids),
            doc_id=f"random-{i}",
            target_section=0,
            n_context_tokens=0,
            fact_spans=[],
        )

    return TrialData(
        train=[mk(i) for i in range(n)],
        eval=[mk(n + i) for i in range(4)],
        pad_id=0,
        stats={"random_tokens": True},
    )


def micro_batches(examples: list, micro_batch: int, grad_accum: int, steps: int, seed: int) -> list[list]:
    """``steps * grad_accum`` micro-batches of ``micro_batch`` examples, grouped by optimizer step.

    Step ``k`` takes the next ``micro_batch * grad_accum`` examples of a seeded shuffle (reshuffled at
    each pass over the data), so a step holds the same examples whatever the ``micro_batch x grad_accum``
    split: with token-weighted accumulation (:func:`vramsweep.loop.token_weights`) the split changes
    memory and speed, not the maths. Whole steps are then reordered, never micro-batches across steps:
    the two steps holding the longest examples go first (fail fast: an OOM shows on step 0, and the
    tracked warm-up steps see the worst case), and inside a step the examples go longest first (its first
    micro-batch is its widest; rows of like length share a micro-batch, so less padding)."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    per_step = micro_batch * grad_accum
    grouped: list[list] = []
    pos = 0
    for _ in range(steps):
        step = []
        for _ in range(per_step):
            if pos % len(order) == 0 and pos:
                rng.shuffle(order)
            step.append(examples[order[pos % len(order)]])
            pos += 1
        grouped.append(sorted(step, key=lambda e: -len(e.input_ids)))  # stable: ties keep their order
    longest = [len(s[0].input_ids) for s in grouped]
    ranked = sorted(range(len(grouped)), key=lambda i: (-longest[i], i))
    first = ranked[: min(2, len(grouped))]
    ordered = [grouped[i] for i in first + [i for i in range(len(grouped)) if i not in first]]
    return [s[k : k + micro_batch] for s in ordered for k in range(0, per_step, micro_batch)]


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def eval_subset(examples: list, n: int) -> list:
    """A fixed held-out subset: up to half of it examples whose target repeats facts (so the task score
    has spans to check), the rest spread evenly over the other examples; original order kept."""
    if len(examples) <= n:
        return list(examples)
    with_facts = [i for i, e in enumerate(examples) if e.fact_spans]
    picked = set(_spread(with_facts, n // 2))
    rest = [i for i in range(len(examples)) if i not in picked]
    picked |= set(_spread(rest, n - len(picked)))
    return [examples[i] for i in sorted(picked)]


def collate_batch(examples: list, pad_id: int, width: int | None = None) -> dict:
    """A collated micro-batch with the host-side counts the loop and the timing read (no device reads).

    Packed rows (``data.packing``) get ``position_ids`` and ``packed: True``: the loop then passes no
    attention mask, so the model builds its block-diagonal mask from the positions."""
    from vramsweep.data.examples import collate

    b = collate(examples, pad_id, width)
    b["fact_spans"] = [list(e.fact_spans) for e in examples]
    # Counted once here, on the host, so the loop never reads device tensors for bookkeeping.
    b["n_tokens"] = int(b["attention_mask"].sum())
    b["n_targets"] = int((b["labels"] != -100).sum())
    # The tokens the causal-LM loss averages over (labels shift by one: position 0 predicts nothing):
    # each micro-batch's weight in its optimizer step (vramsweep.loop.token_weights).
    b["n_loss_tokens"] = int((b["labels"][:, 1:] != -100).sum())
    b["packed"] = "position_ids" in b
    b["no_padding"] = b["n_tokens"] == int(b["attention_mask"].numel())
    return b


def eval_batches(examples: list, n_batches: int, pad_id: int) -> list[dict]:
    """The held-out batches (:data:`EVAL_BATCH` rows each) of the fixed eval subset."""
    ex = eval_subset(examples, n_batches * EVAL_BATCH)
    return [collate_batch(ex[i : i + EVAL_BATCH], pad_id) for i in range(0, len(ex), EVAL_BATCH)]
