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

LossFn = Callable[[Any, Any, Any], Any]  # (input_ids, attention_mask | None, labels) -> mean loss


class Diverged(RuntimeError):
    """The train or eval loss is not finite."""


class Pruned(RuntimeError):
    """The sweeper stopped the trial early (an intermediate eval loss was not promising)."""


class Callback:
    """Hooks the loop calls, in list order; every method is optional."""

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

    def on_step_end(self, step: int, loss: float) -> None:
        """After the step, with its (finite) loss; may raise :class:`Pruned` or :class:`Diverged`."""


@dataclass
class Loop:
    """What :func:`fit` runs: ``steps`` optimizer steps of ``grad_accum`` micro-batches each."""

    model: Any
    optimizer: Any
    scheduler: Any
    batches: Sequence[dict]  # collated micro-batches (data_prep.collate_batch), steps * grad_accum of them
    loss_fn: LossFn
    device: Any
    steps: int
    grad_accum: int = 1
    max_grad_norm: float = 0.0
    clock: StepClock = field(default_factory=StepClock)
    params: list = field(default_factory=list)  # the trainable parameters (clipped)


def to_device(batch: dict, device: Any, non_blocking: bool = False) -> tuple[Any, Any, Any]:
    """(input_ids, mask, labels) on ``device``; no mask for an unpadded batch, so SDPA can take its
    causal fast path (flash)."""
    ids = batch["input_ids"].to(device, non_blocking=non_blocking)
    labels = batch["labels"].to(device, non_blocking=non_blocking)
    mask = None if batch["no_padding"] else batch["attention_mask"].to(device, non_blocking=non_blocking)
    return ids, mask, labels


def _enter(stack: contextlib.ExitStack, contexts: Sequence[AbstractContextManager | None]) -> None:
    for cm in contexts:
        if cm is not None:
            stack.enter_context(cm)


def fit(loop: Loop, callbacks: Sequence[Callback] = ()) -> list[float]:
    """Run the optimizer steps; returns the per-step losses. One host sync per optimizer step (the loss,
    summed on the device over the micro-batches); every phase is timed on ``loop.clock`` while it runs."""
    import torch

    clock, ga = loop.clock, loop.grad_accum
    non_blocking = getattr(loop.device, "type", str(loop.device)) == "cuda"
    losses: list[float] = []
    for step in range(loop.steps):
        for cb in callbacks:
            cb.on_step_start(step)
        with contextlib.ExitStack() as stack:
            _enter(stack, [cb.step_context(step) for cb in callbacks])
            total = None
            for k in range(ga):
                batch = loop.batches[step * ga + k]
                for cb in callbacks:
                    cb.on_micro_batch(step, batch)
                with clock.phase("h2d"):
                    ids, mask, labels = to_device(batch, loop.device, non_blocking)
                with clock.phase("forward"):
                    # Keep only the loss: holding the output would pin the logits through backward.
                    loss = loop.loss_fn(ids, mask, labels) / ga
                with clock.phase("backward"):
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
                del loss
            for cb in callbacks:
                cb.on_grads(step)
            with clock.phase("optimizer"):
                if loop.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(loop.params, loop.max_grad_norm)
                with contextlib.ExitStack() as opt_stack:
                    _enter(opt_stack, [cb.optimizer_context(step) for cb in callbacks])
                    loop.optimizer.step()
                loop.scheduler.step()
                loop.optimizer.zero_grad(set_to_none=True)
            # After the step's kernels are queued (a diverged step's loss is NaN before or after the update).
            with clock.phase("sync_wait"):
                step_loss = float(total)
        if not math.isfinite(step_loss):
            raise Diverged(f"train loss is {step_loss} at optimizer step {step}")
        losses.append(step_loss)
        for cb in callbacks:
            cb.on_step_end(step, step_loss)
    return losses


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

    def on_step_end(self, step: int, loss: float) -> None:
        self.step_s = time.perf_counter() - self._t_step

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

    def on_step_end(self, step: int, loss: float) -> None:
        if self.n and (step + 1) % self.n == 0 and step + 1 < self.last:
            self.fn(step + 1)


class OnStepEnd(Callback):
    """Calls ``fn(step, loss)`` after each step (progress line, per-step logging, running metrics)."""

    def __init__(self, fn: Callable[[int, float], None]):
        self.fn = fn

    def on_step_end(self, step: int, loss: float) -> None:
        self.fn(step, loss)
