"""Held-out evaluation of a trained model: loss over target tokens and the fact-copy task score."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Evaluation:
    loss: float  # mean cross-entropy over target tokens (nats)
    task_score: float | None  # fraction of fact spans copied exactly (teacher-forced); None without spans
    task_spans: int  # fact spans checked


EVAL_CHUNK = 1024  # positions per fp32 cross-entropy chunk in evaluate(): bounds eval memory at large vocabs


def evaluate(
    model,
    batches: list[dict],
    device,
    *,
    causal_lm: Callable[[Any], Any] | None = None,
    meter: Any = None,
) -> Evaluation:
    """Held-out mean loss over target tokens, and the task score (teacher-forced exact match of the
    fact values the target repeats from earlier sections; None when no spans).

    ``causal_lm(model)`` returns the causal LM inside wrappers (PEFT), so the decoder and the LM head can be
    called separately; without it (or when that fails) the whole model's logits are used. ``meter`` (a
    :class:`vramsweep.measure.quality.QualityMeter`) also gets each sequence's per-token NLL and argmax,
    for the fact/control token metrics. The model runs under ``no_grad``; a tiled MLP
    (``tiling.mlp_tile_tokens``) still runs tile by tile there.

    One sequence at a time, cross-entropy in chunks of :data:`EVAL_CHUNK` positions: the logits are
    ``seq x vocab`` (Qwen3: 4096 x 151936 = 1.2 GB in bf16 per sequence), and a batch of 4 upcast to
    fp32 would take 10 GB, more than the training step it measures on a 16 GB card."""
    import torch

    was_training = model.training
    model.eval()
    lm = head = None
    if causal_lm is not None:
        try:  # decoder + lm_head per chunk: the seq x vocab logits never exist at once (long contexts)
            lm = causal_lm(model)
            head = lm.get_output_embeddings()
        except (TypeError, AttributeError):
            lm = head = None
    total, count, hits, spans = 0.0, 0, 0, 0
    with torch.no_grad():
        for b in batches:
            for row in range(b["input_ids"].shape[0]):
                ids = b["input_ids"][row : row + 1].to(device)
                mask = b["attention_mask"][row : row + 1].to(device)
                if head is not None:
                    hidden = lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[
                        0
                    ]
                    logits_at = lambda s, e, h=hidden: head(h[s:e])  # noqa: E731
                else:
                    full = model(input_ids=ids, attention_mask=mask).logits[0]
                    logits_at = lambda s, e, f=full: f[s:e]  # noqa: E731
                labels = b["labels"][row, 1:].to(device)
                n = labels.shape[0]
                preds, nlls = [], []
                for s in range(0, n, EVAL_CHUNK):
                    chunk = labels[s : s + EVAL_CHUNK]
                    logits = logits_at(s, s + chunk.shape[0])
                    nlls.append(
                        torch.nn.functional.cross_entropy(
                            logits.float(), chunk, ignore_index=-100, reduction="none"
                        )
                    )
                    total += float(nlls[-1].sum())
                    count += int((chunk != -100).sum())
                    preds.append(logits.argmax(-1))
                    del logits
                pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=ids.device)
                if meter is not None:
                    meter.add(torch.cat(nlls) if nlls else pred.float(), pred, labels, b["fact_spans"][row])
                logits_at = None
                for start, end in b["fact_spans"][row]:
                    if start < 1 or end > ids.shape[1]:
                        continue
                    spans += 1
                    hits += int(bool((pred[start - 1 : end - 1] == ids[0, start:end]).all()))
    if was_training:
        model.train()
    return Evaluation(
        loss=total / max(count, 1), task_score=hits / spans if spans else None, task_spans=spans
    )
