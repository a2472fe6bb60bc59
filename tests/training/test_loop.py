"""The training loop's host work per step (a per-step fixed cost on the GPU).

The loop must not make the host wait for the device inside a step: it reads step k's loss only after
step k+1's work is issued (a non-blocking copy into a pinned host scalar + a CUDA event), the chunked
loss keeps its divisor on the device, and clipping reads nothing. A host read of a tensor's value is
seen on CPU as the ops that need one (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``int()``,
``bool()``; ``nonzero``/``masked_select``: data-dependent shapes); on CUDA each is a device sync.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vramsweep.loop as loop_mod
from vramsweep.loop import Callback, Diverged, Every, Loop, OnLoss, Pruned, fit

aten = torch.ops.aten
_READS = (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default)


class HostReads(TorchDispatchMode):
    """Appends ``"read"`` to ``log`` for every op that reads a tensor's value on the host."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.log.append("read")
        return func(*args, **(kwargs or {}))


def _loop(steps=4, ga=2, nan_at=None, log=None, device="cpu", max_grad_norm=1.0):
    """A linear model under SGD (whose step reads nothing): every host read seen is the loop's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    g = torch.Generator().manual_seed(1)
    batches = [
        {
            "input_ids": torch.randn(4, 8, generator=g),
            "labels": torch.randn(4, 1, generator=g),
            "no_padding": True,
            "n_loss_tokens": 4,  # equal weights: the step loss is the mean of the micro-batch means
        }
        for _ in range(steps * ga)
    ]
    calls = {"n": 0}

    def loss_fn(x, mask, y):
        step = calls["n"] // ga
        calls["n"] += 1
        if log is not None:
            log.append(f"fwd{step}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * float("nan") if step == nan_at else loss

    lp = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn,
              device=torch.device(device), steps=steps, grad_accum=ga, max_grad_norm=max_grad_norm,
              params=params)  # fmt: skip
    return lp


def _reference_losses(steps=4, ga=2):
    """The same training, the loss read at once after each step (the plain loop)."""
    lp = _loop(steps, ga)
    out = []
    for step in range(steps):
        total = 0.0
        for k in range(ga):
            b = lp.batches[step * ga + k]
            loss = lp.loss_fn(b["input_ids"], None, b["labels"]) / ga
            loss.backward()
            total = loss.detach() + total
        torch.nn.utils.clip_grad_norm_(lp.params, lp.max_grad_norm)
        lp.optimizer.step()
        lp.scheduler.step()
        lp.optimizer.zero_grad(set_to_none=True)
        out.append(float(total))
    return out


def test_loss_is_read_one_step_late_and_exact():
    log: list = []
    lp = _loop(log=log)
    with HostReads(log):
        losses = fit(lp)
    # One host read per optimizer step, and step k's comes only after step k+1's forward is issued:
    # the host never waits for an empty device queue between steps.
    assert log == [
        "fwd0",
        "fwd0",
        "fwd1",
        "fwd1",
        "read",
        "fwd2",
        "fwd2",
        "read",
        "fwd3",
        "fwd3",
        "read",
        "read",
    ]
    assert losses == _reference_losses()  # exact, not approximately equal


def test_callback_order_with_a_late_loss():
    seen: list = []

    class Rec(Callback):
        def on_step_end(self, step):
            seen.append(("end", step))

        def on_loss(self, step, loss):
            seen.append(("loss", step))

    fit(_loop(steps=3, ga=1), [Rec()])
    assert seen == [("end", 0), ("loss", 0), ("end", 1), ("loss", 1), ("end", 2), ("loss", 2)]


def test_nan_loss_is_diverged_at_most_one_step_later():
    log: list = []
    got: list = []
    with pytest.raises(Diverged, match="at optimizer step 1"):
        fit(_loop(nan_at=1, log=log), [OnLoss(lambda s, v: got.append(s))])
    assert got == [0] and log[-1] == "fwd2"  # step 2 ran (at most one step late), step 3 did not
    with pytest.raises(Diverged, match="at optimizer step 3"):  # the last step's NaN is caught at the end
        fit(_loop(nan_at=3))


def test_pruned_at_a_step_end_reads_that_steps_loss_first():
    def prune(step):
        raise Pruned("stop")

    got: list = []
    with pytest.raises(Pruned):
        fit(_loop(steps=4, ga=1), [OnLoss(lambda s, v: got.append(s)), Every(2, 4, prune)])
    assert got == [0, 1]  # the pruned step's loss was recorded
    with pytest.raises(Diverged, match="step 1"):  # a NaN in the pruned step is a divergence first
        fit(_loop(steps=4, ga=1, nan_at=1), [Every(2, 4, prune)])


def test_cuda_path_waits_on_the_previous_steps_event_only(monkeypatch):
    """The CUDA path on CPU: a fake event, pinned buffers requested, no torch.cuda.synchronize in fit."""
    log: list = []

    class Event:
        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("wait")

    empty_like = torch.empty_like
    pinned: list = []

    def fake_empty_like(t, *a, pin_memory=False, **kw):
        pinned.append(pin_memory)
        return empty_like(t, *a, **kw)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("SYNC"))
    monkeypatch.setattr(torch, "empty_like", fake_empty_like)
    monkeypatch.setattr(loop_mod, "to_device", lambda b, d, nb: (b["input_ids"], None, b["labels"]))
    losses = fit(_loop(steps=3, ga=1, log=log, device="cuda"))
    assert "SYNC" not in log and pinned == [True, True]  # two alternating pinned host scalars
    assert log == ["fwd0", "record", "fwd1", "wait", "record", "fwd2", "wait", "record", "wait"]
    assert losses == _reference_losses(steps=3, ga=1)


def test_unoverridden_hooks_are_not_called_per_step():
    assert loop_mod._hooks([Callback(), OnLoss(print)], "on_loss")[0].__self__.__class__ is OnLoss
    assert loop_mod._hooks([Callback(), OnLoss(print)], "on_step_end") == []


@pytest.mark.parametrize("ignored", ["some", "all"])
def test_chunked_loss_reads_nothing_on_the_host(ignored):
    from vramsweep.longctx.loss import chunked_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, generator=g).requires_grad_(True)
    weight = torch.randn(50, 16, generator=g).requires_grad_(True)
    labels = torch.randint(0, 50, (30,), generator=g)
    labels[::3] = -100
    if ignored == "all":
        labels[:] = -100
    log: list = []
    with HostReads(log):
        out = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=7)
        out.backward()
    assert log == []  # the target count stays on the device
    if ignored == "all":  # no targets: zero loss and gradients (the divisor is clamped to 1)
        assert out.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()
    else:
        ref = torch.nn.functional.cross_entropy(
            hidden.detach() @ weight.detach().t(), labels, ignore_index=-100
        )
        assert out.item() == pytest.approx(ref.item(), rel=1e-6)


# --- the causal fast path of an unpadded batch (vramsweep.knobs.attention)


def _tiny(*over):
    from vramsweep.config import compose
    from vramsweep.knobs import build_model

    built = build_model(compose(["train.dtype=fp32", *over]))
    built.model.train()
    return built.model, compose(["train.dtype=fp32", *over])


@pytest.mark.parametrize("tiling", ["off", "loss"])
def test_unpadded_batch_skips_the_packed_sequence_host_read(monkeypatch, tiling):
    """transformers' mask building reads the position ids on the host (find_packed_sequence_indices: a
    device sync per forward on CUDA) when no mask is passed; the training loss of an unpadded batch on SDPA
    passes the causal mask mapping instead: no such read, and the same loss and gradients."""
    import transformers.masking_utils as mu

    from vramsweep.knobs.registry import loss_fn

    model, cfg = _tiny("attention=sdpa", f"tiling={tiling}")
    ids = torch.randint(3, 3000, (2, 48), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = model(input_ids=ids, attention_mask=None, labels=labels).loss
    assert calls  # transformers' own path reads the positions
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    calls.clear()
    fn = loss_fn(cfg, model)
    got = fn(ids, None, labels)
    got.backward()
    assert calls == []
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_no_fast_path_for_eager_attention():
    from vramsweep.knobs.attention import causal_mask_mapping

    model, _ = _tiny("attention=eager")
    assert causal_mask_mapping(model) is None
    model, _ = _tiny("attention=sdpa")
    assert causal_mask_mapping(model) == {"full_attention": None}
