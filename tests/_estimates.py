"""Configs and measurements the estimator tests compare with: a small random-init Qwen3-architecture
model, the composed config of a list of overrides (one compose per group choice), the CPU tracker's peak
of a real optimizer step, and a result whose measured peak follows known activation factors."""

from __future__ import annotations

import functools

import torch
from omegaconf import OmegaConf

from vramsweep.config import compose
from vramsweep.estimate import knobs_from_cfg
from vramsweep.estimate.analytic import estimate_knobs

# A small Qwen3-architecture model (random init): every knob's code path, seconds on two CPU cores.
SMALL = [
    "model.source=arch",
    "model.hidden_size=64",
    "model.intermediate_size=192",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.vocab_size=512",
]


@functools.cache
def _composed(group_choice: str | None):
    """One Hydra compose per distinct group choice (~0.5 s each on these machines), reused by all tests."""
    return compose([group_choice] if group_choice else [], rules="none")


def _cfg(overrides, results_dir=None):
    """The composed config for ``overrides``: the default composition with each chosen group's node
    swapped in (groups are independent in conf/train.yaml) and the dotted values merged on top."""
    cfg = _composed(None).copy()
    values = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if "." in key:
            values.append(o)
        else:
            cfg[key] = _composed(o)[key]
    if results_dir is not None:
        values.append(f"results_dir={results_dir}")
    if values:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(values))
    return cfg


def _tracked_peak(cfg) -> dict:
    """Peak of the second optimizer step (the first, untracked, creates the optimizer state), as
    :func:`vramsweep.trial._train` tracks its warm-up steps."""
    from vramsweep.knobs import build_model, build_optimizer
    from vramsweep.knobs.registry import loss_fn
    from vramsweep.measure.cpu import TensorMemoryTracker

    model = build_model(cfg).model
    compute_loss = loss_fn(cfg, model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    model.train()
    b, s, ga = int(cfg.train.micro_batch), int(cfg.context.max_tokens), int(cfg.train.grad_accum)
    g = torch.Generator().manual_seed(0)

    def step(tracker=None):
        for _ in range(ga):
            ids = torch.randint(3, int(cfg.model.vocab_size), (b, s), generator=g)
            # as vramsweep.trial: keep only the loss (the output would pin the logits through backward)
            loss = compute_loss(ids, torch.ones_like(ids), ids.clone()) / ga
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if tracker is not None:
            with tracker.optimizer_phase():
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = TensorMemoryTracker(model, opt)
    with tracker:
        step(tracker)
    tracker.close()
    return {"peak": tracker.peak_bytes, "breakdown": tracker.breakdown()}


def _fake_result(overrides, factors, results_dir, trial):
    """A result whose 'measured' peak follows known activation multipliers."""
    cfg = _cfg(overrides, results_dir)
    k = knobs_from_cfg(cfg)
    e = estimate_knobs(k, None)
    f = e.features
    static = e.at_peak["params"] + e.at_peak["grads"] + e.at_peak["optimizer"]
    measured = static + f["fixed"] + sum(factors[n] * f[n] for n in ("layers", "attention", "logits"))
    return {
        "status": "ok",
        "trial": trial,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "metrics": {"peak_memory_bytes": int(measured), "memory_kind": "cpu_tracked"},
        "meta": {},
    }
