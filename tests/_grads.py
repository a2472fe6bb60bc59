"""One optimizer step's loss and gradients on CPU over examples split into micro-batches as asked, and the
relative difference of two gradient lists: the accumulation and packing tests compare steps with them."""

from __future__ import annotations

import torch

from vramsweep.config import compose
from vramsweep.data.examples import IGNORE_INDEX, Example
from vramsweep.data.prep import collate_batch, micro_batches
from vramsweep.knobs import build_model
from vramsweep.knobs.registry import loss_fn
from vramsweep.loop import Callback, Loop, fit


def _examples(lengths_targets, vocab=3000, seed=5):
    """Examples of the given (length, trained tokens) with the trained tokens last (like a completion)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, t) in enumerate(lengths_targets):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n - t) + ids[n - t :]
        out.append(Example(ids, labels, doc_id=f"d{i}", target_section=1, n_context_tokens=n - t))
    return out


class _KeepGrads(Callback):
    def __init__(self, params):
        self.params, self.grads = params, None

    def on_grads(self, step: int) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]


def _step_grads(overrides, examples, micro_batch, grad_accum):
    """The gradients and loss of one optimizer step over ``examples`` split as asked (lr 0: no update)."""
    cfg = compose(["train.dtype=fp32", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg).model
    model.eval()  # no dropout: the two splits see the same function
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    micro = micro_batches(examples, micro_batch, grad_accum, 1, seed=0)
    batches = [collate_batch(b, 0) for b in micro]
    keep = _KeepGrads(params)
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn(cfg, model),
                device=torch.device("cpu"), steps=1, grad_accum=grad_accum, params=params)  # fmt: skip
    losses = fit(loop, [keep])
    return losses[0], keep.grads


def _rel(a, b):
    num = torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)))
    den = torch.sqrt(sum((y**2).sum() for y in b))
    return float(num / den)
