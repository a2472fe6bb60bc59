"""The trial's :class:`~vramsweep.loop.Loop` and its seeds: what :func:`vramsweep.loop.fit` runs."""

from __future__ import annotations

import random

from omegaconf import DictConfig

from vramsweep.loop import Loop
from vramsweep.measure.steps import StepClock


def seed(t: DictConfig) -> None:
    """``train.seed`` for Python's and torch's generators (``train.threads`` was applied at trial start,
    :func:`vramsweep.measure.threads.apply`)."""
    import torch

    random.seed(int(t.seed))
    torch.manual_seed(int(t.seed))


def trial_loop(
    cfg: DictConfig,
    batches: list,
    device,
    trained: tuple,
    *,
    loss_fn,
    clock: StepClock,
    params: list,
    start: int,
) -> Loop:
    """The trial's :class:`~vramsweep.loop.Loop`: ``trained`` (model, optimizer, scheduler) over the collated
    micro-batches on ``device``, ``train.steps`` steps of ``train.grad_accum`` micro-batches from step
    ``start``."""
    model, optimizer, scheduler = trained
    t = cfg.train
    return Loop(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        loss_fn=loss_fn,
        device=device,
        steps=int(t.steps),
        grad_accum=int(t.grad_accum),
        max_grad_norm=float(t.max_grad_norm),
        clock=clock,
        params=params,
        start_step=start,
    )
