"""Knob hooks: what a knob does to the built model, to the training step's loss and to the estimate,
registered in one place beside the code that implements it.

A knob's option file (``conf/<group>/<option>.yaml``) sets config values; the config's rules check them
(:mod:`vramsweep.config.rules`). Where an option must change what *runs*, its module registers a
:class:`KnobHooks` with :func:`register`:

* ``build(cfg, model, device) -> notes``: transform the built model (after the adapter is attached); the
  notes land in ``meta.build.knobs[<name>]``;
* ``loss(cfg, model) -> fn(input_ids, attention_mask, labels)``: the training loss instead of the
  model's own (at most one active knob may set it);
* ``estimate(cfg) -> {field: value}``: fields of the estimator's
  :class:`vramsweep.estimate.analytic.Knobs` (its memory terms read them).

The build, the training loop and the estimator ask :func:`active` for the hooks of a composed config;
none of them has a branch for a particular knob. This module imports nothing heavy (the estimator uses it
without torch): the providers import their implementations inside the hooks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Modules that register knob hooks (imported on first use). A new knob in one of them needs no entry here.
PROVIDERS: tuple[str, ...] = ("vramsweep.knobs.longctx",)


@dataclass(frozen=True)
class KnobHooks:
    name: str  # how results and errors name it, e.g. "checkpointing=offload"
    active: Callable[[Any], bool]  # cfg -> does this config turn the knob on?
    build: Callable[[Any, Any, Any], Any] | None = None  # (cfg, model, device) -> notes
    loss: Callable[[Any, Any], Callable[..., Any]] | None = None  # (cfg, model) -> loss fn
    estimate: Callable[[Any], dict[str, Any]] | None = None  # cfg -> analytic.Knobs fields


_HOOKS: dict[str, KnobHooks] = {}
_loaded = False


def register(hooks: KnobHooks) -> KnobHooks:
    """Register (or replace, by name) a knob's hooks; returns them."""
    _HOOKS[hooks.name] = hooks
    return hooks


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in PROVIDERS:
            importlib.import_module(mod)


def registered() -> list[KnobHooks]:
    _load()
    return list(_HOOKS.values())


def active(cfg: Any) -> list[KnobHooks]:
    """The hooks the composed config turns on, in registration order."""
    return [h for h in registered() if h.active(cfg)]


def apply_build(cfg: Any, model: Any, device: Any) -> dict[str, Any]:
    """Run every active knob's build hook on the model; returns ``{name: notes}``."""
    return {h.name: h.build(cfg, model, device) for h in active(cfg) if h.build is not None}


def loss_fn(cfg: Any, model: Any) -> Callable[..., Any]:
    """The training loss ``fn(input_ids, attention_mask, labels) -> mean loss over target tokens``:
    the active knob's, or the model's own; an unpadded batch (``attention_mask=None``) goes through
    :func:`vramsweep.knobs.attention.with_causal_fast_path`."""
    from vramsweep.knobs.attention import with_causal_fast_path

    owners = [h for h in active(cfg) if h.loss is not None]
    if len(owners) > 1:
        raise ValueError(f"knobs {[h.name for h in owners]} each replace the training loss: choose one")
    if owners:
        fn = owners[0].loss(cfg, model)
    else:

        def fn(ids, mask, labels):
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    # an unpadded batch on SDPA/FlashAttention-2: the causal mask mapping, not None (no host read)
    return with_causal_fast_path(fn, model, cfg)


def estimate_fields(cfg: Any) -> dict[str, Any]:
    """The estimator's knob fields set by the active knobs (later registrations win on a clash)."""
    out: dict[str, Any] = {}
    for h in active(cfg):
        if h.estimate is not None:
            out.update(h.estimate(cfg))
    return out
