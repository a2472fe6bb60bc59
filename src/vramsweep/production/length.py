"""The run's length in optimizer steps: ``train.epochs`` passes over the training examples, or
``train.steps``."""

from __future__ import annotations

import math

from omegaconf import DictConfig, open_dict


def steps_for_epochs(n_examples: int, epochs: float, micro_batch: int, grad_accum: int) -> int:
    """Optimizer steps that cover ``epochs`` passes over ``n_examples`` (examples per step = micro_batch x
    grad_accum; the last step of a fractional pass counts whole)."""
    per_step = max(1, int(micro_batch) * int(grad_accum))
    return max(1, math.ceil(float(epochs) * int(n_examples) / per_step))


def apply_epochs(cfg: DictConfig, n_examples: int) -> int | None:
    """With ``train.epochs > 0``: set ``train.steps`` to :func:`steps_for_epochs` (so the LR schedule, the
    batches and every ``Every`` callback span the whole run) and return it; None when steps rule."""
    t = cfg.train
    if float(t.get("epochs", 0) or 0) <= 0:
        return None
    steps = steps_for_epochs(n_examples, float(t.epochs), int(t.micro_batch), int(t.grad_accum))
    with open_dict(cfg):
        cfg.train.steps = steps
        # warm-up and the measured window are clamped to the run (they were checked against train.steps)
        cfg.train.warmup_steps = min(int(t.warmup_steps), steps)
        cfg.train.measure_warmup_steps = min(int(t.measure_warmup_steps), max(steps - 1, 0))
    return steps
