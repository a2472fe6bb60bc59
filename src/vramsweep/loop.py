"""The training loop: optimizer steps over prepared micro-batches, with hooks instead of knob branches.

:func:`fit` knows forward, backward, clip, optimizer step and schedule, and nothing else. What a trial
adds around it is a :class:`Callback`: memory tracking (:class:`CpuMemoryTracking`), the timed window and
token counts (:class:`Timing`), injected faults, progress, per-step logging, periodic evaluation and
pruning. What a knob changes in the step is the loss function (``Loop.loss_fn``: the model's own, or
the chunked one of ``tiling=loss``) or the model itself (applied at build time): the loop has no knob
branches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from vramsweep.measure.steps import StepClock

# (input_ids, attention_mask | None, labels, **kw) -> mean loss over the trained tokens; ``kw`` is
# ``position_ids=`` for packed rows (data/packing.py), empty otherwise
LossFn = Callable[..., Any]


class Diverged(RuntimeError):
    """The train or eval loss is not finite."""


class Pruned(RuntimeError):
    """The sweeper stopped the trial early (an intermediate eval loss was not promising)."""


class Callback:
    """Hooks the loop calls, in list order; every method is optional (one not overridden is not called)."""

    def on_step_start(self, step: int) -> None:
        """Before the step's first micro-batch."""

    def step_context(self, step: int) -> AbstractContextManager | None:
        """A context entered around the whole step (forward, backward and optimizer), or None."""
        return None

    def on_micro_batch(self, step: int, batch: dict) -> None:
        """Before each micro-batch's forward (may raise: injected faults)."""

    def on_grads(self, step: int) -> None:
        """After the step's last backward, before clipping and the optimizer."""

    def optimizer_context(self, step: int) -> AbstractContextManager | None:
        """A context entered around ``optimizer.step()``, or None."""
        return None

    def on_step_end(self, step: int) -> None:
        """After the step's work is issued (the weights are those after ``step + 1`` updates); its loss
        may not be read yet. May raise :class:`Pruned` or :class:`Diverged` (periodic evaluation)."""

    def on_loss(self, step: int, loss: float) -> None:
        """With the step's finite loss, once read: after the next step's work is issued (before that
        step's :meth:`on_step_end`); the last step's at the end of :func:`fit`. May raise."""


_HOOKS = (
    "on_step_start",
    "step_context",
    "on_micro_batch",
    "on_grads",
    "optimizer_context",
    "on_step_end",
    "on_loss",
)


def _hooks(callbacks: Sequence[Callback], name: str) -> list[Callable]:
    """The bound ``name`` methods of the callbacks that override it (no per-step calls to no-ops)."""
    base = getattr(Callback, name)
    return [getattr(cb, name) for cb in callbacks if getattr(type(cb), name, base) is not base]


@dataclass(kw_only=True)
class Loop:
    """What :func:`fit` runs: ``steps`` optimizer steps of ``grad_accum`` micro-batches each. Built with
    keywords only: ``Loop(model=..., optimizer=..., scheduler=..., batches=..., loss_fn=..., device=...,
    steps=..., grad_accum=..., max_grad_norm=..., clock=..., params=..., start_step=...)``."""

    model: Any
    optimizer: Any
    scheduler: Any
    # collated micro-batches (data.prep.collate_batch), steps * grad_accum of them, each with its
    # ``n_loss_tokens`` (the tokens its mean loss averages over: the token weights of the step)
    batches: Sequence[dict]
    loss_fn: LossFn
    device: Any
    steps: int
    grad_accum: int = 1
    max_grad_norm: float = 0.0
    clock: StepClock = field(default_factory=StepClock)
    params: list = field(default_factory=list)  # the trainable parameters (clipped)
    start_step: int = 0  # first step to run (a resumed run: the checkpoint's next step)


def to_device(batch: dict, device: Any, non_blocking: bool = False) -> tuple[Any, Any, Any]:
    """(input_ids, mask, labels) on ``device``; no mask for an unpadded batch, so SDPA can take its
    causal fast path (flash), nor for packed rows (their positions give the model its segments)."""
    ids = batch["input_ids"].to(device, non_blocking=non_blocking)
    labels = batch["labels"].to(device, non_blocking=non_blocking)
    no_mask = batch["no_padding"] or batch.get("packed", False)
    mask = None if no_mask else batch["attention_mask"].to(device, non_blocking=non_blocking)
    return ids, mask, labels


def loss_kwargs(batch: dict, device: Any, non_blocking: bool = False) -> dict[str, Any]:
    """The loss function's keyword arguments for ``batch``: ``position_ids`` for packed rows (they restart
    at each example: the model masks attention across examples and the positions restart), else none."""
    if not batch.get("packed", False):
        return {}
    pos = batch["position_ids"].to(device, non_blocking=non_blocking)
    if batch.get("segment_bounds") is not None:  # collate's host-side segments: no host read in the forward
        from vramsweep.knobs.packed_attention import remember

        remember(pos, batch["segment_bounds"])
    return {"position_ids": pos}


def token_weights(micro: Sequence[dict]) -> list[float]:
    """The weight of each micro-batch's mean loss in its optimizer step: its trained tokens over the
    step's (``n_loss_tokens``, counted on the host by collate), so the step's loss is the sum of its token
    losses over the step's trained tokens, as one batch of all its rows would give (not the mean of the
    micro-batches' means, which weighs a token of a short micro-batch more). All zero when the step has
    no trained token."""
    counts = [int(b["n_loss_tokens"]) for b in micro]
    n = sum(counts)
    return [c / n if n else 0.0 for c in counts]


def _enter(stack: contextlib.ExitStack, contexts: Sequence[AbstractContextManager | None]) -> None:
    for cm in contexts:
        if cm is not None:
            stack.enter_context(cm)


class _PendingLoss:
    """A step's loss on its way to the host. On CUDA: a non-blocking copy into a page-locked host scalar
    and an event recorded after it, so reading it (:meth:`take`, once the next step is issued) waits for
    that step's kernels only and never drains the device queue. Elsewhere the loss is kept as is.
    The host scalar has the device loss's dtype, so the value read is exact. Two slots alternate: step
    k's copy is queued while step k-1's is still unread."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.slots: list[tuple[Any, Any] | None] = [None, None]
        self.pending: tuple[int, Any, Any] | None = None  # (step, host scalar, event | None)

    def queue(self, step: int, total: Any) -> None:
        if not self.cuda:  # already on the host: nothing to copy (no extra op per step)
            self.pending = (step, total, None)
            return
        import torch

        slot = self.slots[step % 2]
        if slot is None or slot[0].dtype != total.dtype or slot[0].shape != total.shape:
            buf = torch.empty_like(total, device="cpu", pin_memory=self.cuda)
            slot = self.slots[step % 2] = (buf, torch.cuda.Event() if self.cuda else None)
        buf, event = slot
        buf.copy_(total, non_blocking=self.cuda)
        if event is not None:
            event.record()
        self.pending = (step, buf, event)

    def take(self) -> tuple[int, float] | None:
        """(step, loss) of the queued copy, waiting for it if needed; None when nothing is queued."""
        if self.pending is None:
            return None
        step, buf, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        return step, float(buf)


def fit(loop: Loop, callbacks: Sequence[Callback] = ()) -> list[float]:
    """Run the optimizer steps; returns the per-step losses (each the exact value of the step's loss,
    summed on the device over its micro-batches, each micro-batch's mean weighted by its share of the
    step's trained tokens: :func:`token_weights`).

    The loop adds no host sync inside a step, and reads each step's loss one step late: step k's loss is
    copied to the host without blocking (:class:`_PendingLoss`) and read after step k+1's work is issued,
    so the host never waits for an empty device queue between steps (``sync_wait`` is the wait for step
    k to finish while step k+1 is queued). Hence :meth:`Callback.on_loss` for step k comes after step
    k+1's work is issued (just before its :meth:`Callback.on_step_end`), and a non-finite loss still
    ends the trial with :class:`Diverged` naming its step, but at most one step later (step k+1 has run
    by then; a NaN at the last step is caught at the end). Every phase is timed on ``loop.clock``, on
    the host and, on CUDA, with device events that are read once a later step's loss read has waited for
    them (``StepClock.collect``: no wait of its own).

    Args:
        loop: the model's loss function, optimizer, scheduler, micro-batches, device, step range
            (``start_step`` to ``steps``), gradient accumulation, clipping and clock.
        callbacks: the hooks called around each step, in list order (:class:`Callback`).

    Returns:
        The losses of the steps run, in step order.

    Raises:
        Diverged: a step's loss is not finite (or a callback found a non-finite eval loss).
        Pruned: a callback stopped the trial early.
    """
    clock = loop.clock
    cuda = getattr(loop.device, "type", str(loop.device)) == "cuda"
    hooks = {name: _hooks(callbacks, name) for name in _HOOKS}
    pending = _PendingLoss(cuda)
    losses: list[float] = []

    def read() -> None:
        """Read the queued loss (if any): record it, or end the trial when it is not finite."""
        _read_loss(clock, pending, losses, hooks["on_loss"])

    for step in range(loop.start_step, loop.steps):
        for fn in hooks["on_step_start"]:
            fn(step)
        clock.begin_step()  # device events (CUDA, timed steps): recorded, read steps later
        with contextlib.ExitStack() as stack:
            _enter(stack, [fn(step) for fn in hooks["step_context"]])
            total = _forward_backward(loop, step, hooks["on_micro_batch"], cuda)
            for fn in hooks["on_grads"]:
                fn(step)
            _optimizer_step(loop, step, hooks["optimizer_context"])
            clock.end_step()
        # Step k-1's loss is read now that step k is queued, then step k's is queued (a diverged step's
        # loss is NaN before or after the update). Step k-1's events are complete once its loss is read.
        read()
        clock.collect()
        pending.queue(step, total)
        del total
        try:
            for fn in hooks["on_step_end"]:
                fn(step)
        except Pruned:
            read()  # the evaluation synchronised anyway: a NaN loss of this step is a divergence first
            raise
    read()
    return losses


def _read_loss(
    clock: StepClock, pending: _PendingLoss, losses: list[float], on_loss: Sequence[Callable]
) -> None:
    """Read the queued loss (if any, timed as ``sync_wait``): append it to ``losses`` and pass it to the
    ``on_loss`` hooks, or raise :class:`Diverged` when it is not finite."""
    with clock.phase("sync_wait"):
        got = pending.take()
    if got is None:
        return
    step, loss = got
    if not math.isfinite(loss):
        raise Diverged(f"train loss is {loss} at optimizer step {step}")
    losses.append(loss)
    for fn in on_loss:
        fn(step, loss)


def _forward_backward(loop: Loop, step: int, on_micro_batch: Sequence[Callable], cuda: bool) -> Any:
    """Forward and backward over step ``step``'s micro-batches, each loss weighted by its share of the
    step's trained tokens; returns the step's loss summed on the device (detached, not read)."""
    ga, clock = loop.grad_accum, loop.clock
    total = None
    micro = loop.batches[step * ga : (step + 1) * ga]
    weights = token_weights(micro)
    for batch, w in zip(micro, weights, strict=True):
        for fn in on_micro_batch:
            fn(step, batch)
        with clock.phase("h2d"):
            ids, mask, labels = to_device(batch, loop.device, cuda)
            kw = loss_kwargs(batch, loop.device, cuda)
        with clock.phase("forward"):
            # Keep only the loss: holding the output would pin the logits through backward.
            loss = loop.loss_fn(ids, mask, labels, **kw)
            if w == 0.0:  # no trained token here: the mean is 0/0; it adds nothing to the step
                loss = loss.nan_to_num(0.0) * 0.0
            elif w != 1.0:
                loss = loss * w
        with clock.phase("backward"):
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    return total


def _optimizer_step(loop: Loop, step: int, optimizer_context: Sequence[Callable]) -> None:
    """The step's update, timed as ``optimizer``: clip (when ``max_grad_norm > 0``), optimizer step inside
    the ``optimizer_context`` hooks' contexts, schedule step, and zero the gradients."""
    import torch

    with loop.clock.phase("optimizer"):
        if loop.max_grad_norm > 0:  # no host read: the clip factor stays on the device
            torch.nn.utils.clip_grad_norm_(loop.params, loop.max_grad_norm)
        with contextlib.ExitStack() as opt_stack:
            _enter(opt_stack, [fn(step) for fn in optimizer_context])
            loop.optimizer.step()
        loop.scheduler.step()
        loop.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- callbacks


class Timing(Callback):
    """The timed window: starts at step ``timed_from`` (after warm-up and tracked steps, fenced by a
    device sync so nothing queued before is charged to it) and counts the tokens of the timed steps.
    ``eval_s`` is evaluation time inside the window (subtracted from the training time)."""

    def __init__(self, clock: StepClock, timed_from: int):
        self.clock, self.timed_from = clock, timed_from
        self.t_start: float | None = None
        self.eval_s = 0.0
        self.tokens = self.pad_tokens = self.target_tokens = self.rows = 0
        self.tokens_by_length: dict[int, int] = {}  # timed tokens by their micro-batch's sequence length
        self._t_step = 0.0
        self.step_s: float | None = None  # wall seconds of the last finished step

    def on_step_start(self, step: int) -> None:
        self._t_step = time.perf_counter()
        if step == self.timed_from:
            self.clock.sync()
            self.t_start = time.perf_counter()
            self.clock.start()

    def on_micro_batch(self, step: int, batch: dict) -> None:
        if self.t_start is None:
            return
        n = batch["n_tokens"]
        self.tokens += n
        self.pad_tokens += int(batch["attention_mask"].numel()) - n
        self.target_tokens += batch["n_targets"]
        self.rows += int(batch["input_ids"].shape[0])
        length = int(batch["input_ids"].shape[-1])
        self.tokens_by_length[length] = self.tokens_by_length.get(length, 0) + n

    def on_step_end(self, step: int) -> None:
        self.step_s = time.perf_counter() - self._t_step  # the host's seconds for the step

    def train_seconds(self) -> float | None:
        """Seconds of training in the window so far (evaluation excluded); None before it starts."""
        if self.t_start is None:
            return None
        return time.perf_counter() - self.t_start - self.eval_s

    def tokens_per_s(self) -> float | None:
        s = self.train_seconds()
        return self.tokens / s if s and self.tokens else None

    def mean_seq(self) -> float:
        return self.tokens / max(self.rows, 1)

    def share_longer_than(self, length: int) -> float:
        """Share of the timed tokens in micro-batches whose sequences are longer than ``length`` (those the
        tiled MLP splits when ``length`` is its tile); 0 when ``length`` <= 0 or nothing was timed."""
        if length <= 0 or not self.tokens:
            return 0.0
        return sum(n for k, n in self.tokens_by_length.items() if k > length) / self.tokens


class CpuMemoryTracking(Callback):
    """Runs the first ``steps`` steps under the CPU tensor tracker (a Python call per op, so never during
    timed steps), then closes it; ``on_close(tracker)`` records the peak."""

    def __init__(self, tracker: Any, steps: int, on_close: Callable[[Any], None]):
        self.tracker, self.steps, self.on_close = tracker, steps, on_close

    def close(self) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            self.on_close(tracker)

    def on_step_start(self, step: int) -> None:
        if step == self.steps:
            self.close()

    def step_context(self, step: int) -> AbstractContextManager | None:
        return self.tracker

    def optimizer_context(self, step: int) -> AbstractContextManager | None:
        return self.tracker.optimizer_phase() if self.tracker is not None else None


class Every(Callback):
    """Calls ``fn(step + 1)`` after every ``n``-th optimizer step except the last (periodic evaluation)."""

    def __init__(self, n: int, last: int, fn: Callable[[int], None]):
        self.n, self.last, self.fn = n, last, fn

    def on_step_end(self, step: int) -> None:
        if self.n and (step + 1) % self.n == 0 and step + 1 < self.last:
            self.fn(step + 1)


class OnLoss(Callback):
    """Calls ``fn(step, loss)`` with each step's loss, once read (progress line, per-step logging, running
    metrics): one step late, see :func:`fit`."""

    def __init__(self, fn: Callable[[int, float], None]):
        self.fn = fn

    def on_loss(self, step: int, loss: float) -> None:
        self.fn(step, loss)
