"""Optimizers by name (torch, bitsandbytes, transformers) and the LR schedule (transformers)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig


def build_optimizer(cfg: DictConfig, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, dict]:
    """Return the optimizer named by ``cfg.optimizer.impl`` and notes for ``meta``.

    The paged bitsandbytes optimizers keep their state in CUDA unified memory; on CPU bitsandbytes
    falls back to ordinary (non-paged) state, which the notes record.
    """
    o = cfg.optimizer
    lr = float(cfg.train.lr)
    betas = (float(o.betas[0]), float(o.betas[1]))
    notes: dict = {"optimizer_class": None, "paged": False}
    if o.impl == "torch_adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
    elif o.impl == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(
            params,
            lr=lr,
            eps=(1e-30, 1e-3),
            beta1=None,
            weight_decay=o.weight_decay,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
        )
    else:
        import bitsandbytes as bnb

        cls = {
            "bnb_adamw8bit": bnb.optim.AdamW8bit,
            "bnb_paged_adamw8bit": bnb.optim.PagedAdamW8bit,
            "bnb_paged_adamw32bit": bnb.optim.PagedAdamW32bit,
        }[o.impl]
        kwargs = dict(lr=lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
        if o.impl != "bnb_paged_adamw32bit":
            kwargs["min_8bit_size"] = int(o.min_8bit_size)
        opt = cls(params, **kwargs)
        if "paged" in o.impl:
            on_cuda = any(p.is_cuda for p in params)
            notes["paged"] = on_cuda
            if not on_cuda:
                notes["paged_fallback"] = (
                    "CPU: bitsandbytes keeps paged-optimizer state as ordinary (non-paged) tensors"
                )
    notes["optimizer_class"] = f"{type(opt).__module__}.{type(opt).__name__}"
    return opt, notes


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer):
    from transformers import get_scheduler

    return get_scheduler(
        cfg.train.schedule,
        optimizer=optimizer,
        num_warmup_steps=int(cfg.train.warmup_steps),
        num_training_steps=int(cfg.train.steps),
    )
