"""Gradient accumulation is the maths of a bigger batch: ``micro_batch x grad_accum`` splits of one optimizer
step give the same gradients, for every loss owner that runs on CPU, on targets of varying length.

The step's loss is the sum of its token losses over the step's trained tokens (each micro-batch's mean
weighted by its share: :func:`vramsweep.loop.token_weights`), and the same examples fall in the same step
whatever the split (:func:`vramsweep.data.prep.micro_batches` orders whole steps).
"""

from __future__ import annotations

import pytest
import torch

from _grads import _examples, _rel, _step_grads
from vramsweep.config import compose
from vramsweep.data.prep import collate_batch, micro_batches
from vramsweep.knobs import build_model
from vramsweep.loop import token_weights

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


# Variable lengths and very different trained-token counts (the mean-of-means bug weighs a token of the
# short micro-batch several times more than one of the long).
_LT = [(70, 58), (250, 239), (40, 9), (180, 120)]


@pytest.mark.parametrize(
    "owner", [[], ["tiling=loss", "tiling.loss_chunk_tokens=64"]], ids=["model_loss", "tiling_loss"]
)
@pytest.mark.parametrize("n", [2, 4])
def test_accumulation_equals_the_bigger_batch(owner, n):
    ex = _examples(_LT[:n])
    big_loss, big = _step_grads(owner, ex, micro_batch=n, grad_accum=1)
    acc_loss, acc = _step_grads(owner, ex, micro_batch=1, grad_accum=n)
    assert _rel(acc, big) < 1e-5, f"relative gradient difference {_rel(acc, big):.2e}"
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)
    # and the reference by hand: all trained tokens' losses over their count, in one batch
    cfg = compose(["train.dtype=fp32", *owner])
    torch.manual_seed(0)
    model = build_model(cfg).model.eval()
    b = collate_batch(ex, 0)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"][:, 1:].flatten())
    assert big_loss == pytest.approx(float(ref), rel=1e-4)


def test_token_weights_follow_trained_tokens():
    b = [{"n_loss_tokens": 57}, {"n_loss_tokens": 238}, {"n_loss_tokens": 0}]
    w = token_weights(b)
    assert w == pytest.approx([57 / 295, 238 / 295, 0.0])
    assert token_weights([{"n_loss_tokens": 0}, {"n_loss_tokens": 0}]) == [0.0, 0.0]


def test_a_micro_batch_without_trained_tokens_adds_nothing():
    """A micro-batch whose targets were all masked has a 0/0 mean loss: the step's loss and gradients are
    those of the other micro-batches alone (no NaN)."""
    ex = _examples([(60, 30), (50, 0)])
    loss2, g2 = _step_grads([], ex, micro_batch=1, grad_accum=2)
    loss1, g1 = _step_grads([], ex[:1], micro_batch=1, grad_accum=1)
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    assert _rel(g2, g1) < 1e-6


def test_collate_counts_the_shifted_targets():
    ex = _examples([(10, 10), (6, 2)])  # row 0's first token is a label the shifted loss never sees
    b = collate_batch(ex, 0)
    assert b["n_targets"] == 12
    assert b["n_loss_tokens"] == 11


@pytest.mark.parametrize("split", [(2, 1), (1, 2), (4, 1), (1, 4)])
def test_the_same_examples_fall_in_the_same_step_whatever_the_split(split):
    ex = _examples([(20 + 13 * (i % 7), 10) for i in range(11)])
    per = split[0] * split[1]
    ref = micro_batches(ex, per, 1, 7, seed=3)
    got = micro_batches(ex, split[0], split[1], 7, seed=3)
    assert len(got) == 7 * split[1]

    def steps(mbs, ga):
        return [sorted(e.doc_id for mb in mbs[s * ga : (s + 1) * ga] for e in mb) for s in range(7)]

    assert steps(got, split[1]) == steps(ref, 1)
    # the first step holds the longest example and its first micro-batch is the widest
    longest = max(len(e.input_ids) for e in ex)
    assert len(got[0][0].input_ids) == longest
    assert all(len(mb) == split[0] for mb in got)
