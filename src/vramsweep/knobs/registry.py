"""Providers: what each config group does to the built model, to the training step's loss and to the
estimate, registered in one place beside the code that implements it.

A knob's option file (``conf/<group>/<option>.yaml``) sets config values; the config's rules check them
(:mod:`vramsweep.config.rules`). Where a group must change what *runs*, its module registers a
:class:`KnobHooks` provider with :func:`register`. The build runs the hooks stage by stage, in
:data:`STAGES` order, and within a stage in provider order: the place of the registering module in
:data:`PROVIDERS` (the one place the order is written), then registration order within the module:

* ``patch(cfg, b) -> notes``: before anything is loaded (``kernels=liger`` patches the model classes);
* ``load(cfg, b) -> notes``: how the model is loaded: add ``from_pretrained`` keywords to
  ``b.load_kwargs`` (``quantization_config``, ``attn_implementation``, a rope-scaled ``config``), or load
  it (``b.model``; the ``model`` provider loads from the source, last); a loader that builds the whole
  trial model (``kernels=unsloth``: adapter and checkpointing included) sets ``b.done`` and the stages
  after it are skipped;
* ``build(cfg, b) -> notes``: transform ``b.model`` (and ``b.tokenizer`` / ``b.id_map``: vocab slicing),
  in order: read-back notes, vocab, checkpointing, adapter, Liger's instance check, then the knobs
  (``offload``, ``mlp_tiles``, ``loss_chunks``) that work on the finished model;
* ``loss(cfg, model) -> fn(input_ids, attention_mask, labels)``: the training loss instead of the
  model's own (at most one active provider may set it); ``wrap_loss(cfg, model, fn) -> fn`` then wraps
  whichever loss runs (attention's causal fast path);
* ``data(cfg, d) -> notes``: after the build, on the trial's examples (:class:`Batching`): what the loop
  reads (vocab slicing's remapped ids, then packing's rows); the notes land in ``meta.data[<name>]``;
* ``measure(cfg, m)``: what a knob adds to the measurement (:class:`Measuring`), at ``train_start`` (the
  step clock: Liger's sync points) and ``train_end`` (before the throughput is recorded: offload's host
  memory, the tiled MLP's share for MFU);
* ``estimate(cfg, e) -> {field: value}``: fields of the estimator's
  :class:`vramsweep.estimate.analytic.Knobs`, in the same order; ``e.fields`` holds what earlier
  providers set, ``e.note(text)`` adds an assumption to the estimate.

``notes_in`` says where a provider's notes land: ``"knobs"`` (default) under ``meta.build.knobs[<name>]``,
``"build"`` merged into ``meta.build`` itself (the group providers keep their historical keys:
``kernels``, ``rope``, ``quantised_layers``, ``vocab``, ``adapter``, ...).

:func:`vramsweep.knobs.build.build_model`, the trial (:mod:`vramsweep.trial`), the training loop and
:func:`vramsweep.estimate.knobs_from_cfg` run :func:`run_build`, :func:`run_data`, :func:`run_measure`,
:func:`loss_fn` and :func:`estimate_fields`; none of them has a branch for a particular group.
This module imports nothing heavy (the estimator uses it without torch): the providers import their
implementations inside the hooks.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Modules that register providers (imported on first use), one per config group that changes what runs,
#: in pipeline order: within each stage a provider's hooks run at its module's place here (then in
#: registration order); providers registered from any other module (a test) run after these.
PROVIDERS: tuple[str, ...] = (
    "vramsweep.knobs.train_step",  # train / context / hardware: the step's shape and device (estimate only)
    "vramsweep.knobs.attention",
    "vramsweep.knobs.rope",
    "vramsweep.knobs.quant",
    "vramsweep.knobs.vocab",
    "vramsweep.knobs.checkpointing",
    "vramsweep.knobs.adapter",
    "vramsweep.knobs.kernels",
    "vramsweep.knobs.optim",
    "vramsweep.knobs.model",  # loads with what the earlier load hooks set (last of the load stage)
    "vramsweep.knobs.offload_tiling",  # knobs that work on the finished model (after the adapter)
    "vramsweep.knobs.packing",  # data.packing: the data stage only (rows of vocab's remapped examples)
)

#: The build's stages, in the order they run (``data`` after the build, ``loss``/``wrap_loss`` in the
#: loop, ``measure`` around training, ``estimate`` in the estimator, each in provider order).
STAGES: tuple[str, ...] = ("patch", "load", "build")

Hook = Callable[..., Any]


@dataclass(frozen=True)
class KnobHooks:
    name: str  # how results and errors name it, e.g. "offload", "kernels"
    active: Callable[[Any], bool] = lambda cfg: True  # cfg -> does this config turn it on?
    build: Hook | None = None  # (cfg, b: Build) -> notes, after loading
    loss: Callable[[Any, Any], Callable[..., Any]] | None = None  # (cfg, model) -> loss fn
    estimate: Callable[[Any, Estimating], dict[str, Any]] | None = None  # -> analytic.Knobs fields
    patch: Hook | None = None  # (cfg, b: Build) -> notes, before loading
    load: Hook | None = None  # (cfg, b: Build) -> notes: load kwargs, or the loaded model
    wrap_loss: Hook | None = None  # (cfg, model, fn) -> fn, around whichever loss runs
    data: Hook | None = None  # (cfg, d: Batching) -> notes (meta.data[name]), after the build
    measure: Hook | None = None  # (cfg, m: Measuring) -> None, at train_start and train_end
    groups: tuple[str, ...] = ()  # the config groups it implements (conf/<group>/)
    notes_in: str = "knobs"  # "knobs": meta.build.knobs[name]; "build": merged into meta.build


@dataclass
class Build:
    """What the build stages pass along: the inputs, the model so far and the notes (``meta.build``)."""

    cfg: Any
    device: Any  # torch.device
    dtype: Any  # torch dtype of train.dtype
    path: Any = None  # weights folder (None: source=arch, built from the config)
    tokenizer: Any = None
    keep_ids: list[int] | None = None  # vocabulary rows to keep (vocab slicing)
    corpus: list | None = None  # the examples the model will see (vocab slicing chooses keep_ids from them)
    model: Any = None
    id_map: Any = None  # vocab slicing's IdMap
    load_kwargs: dict[str, Any] = field(default_factory=dict)  # from_pretrained keywords
    notes: dict[str, Any] = field(default_factory=dict)
    done: bool = False  # a loader built the whole trial model: the stages after it are skipped


@dataclass
class Batching:
    """What the data hooks see after the build: the trial's examples as the loop will read them."""

    train: list  # the training examples (packing turns them into rows)
    eval: list  # the eval examples (never packed)
    pad_id: int
    tokenizer: Any = None  # the base tokenizer (names ids in errors)
    id_map: Any = None  # vocab slicing's IdMap, from the build (None: the full vocabulary)
    width: int | None = None  # packed rows' width (None: each batch padded to its longest row)


@dataclass
class Measuring:
    """What the measure hooks see: the trained model and the step clock at ``train_start``; at
    ``train_end`` also the step timing, the result's meta and ``mfu`` (keywords for the MFU figure)."""

    phase: str  # "train_start" | "train_end"
    model: Any
    clock: Any = None  # vramsweep.measure.steps.StepClock
    timing: Any = None  # vramsweep.loop.Timing (train_end)
    meta: dict[str, Any] = field(default_factory=dict)
    mfu: dict[str, Any] = field(default_factory=dict)


@dataclass
class Estimating:
    """What the estimate hooks see: the model dims, the requested tokens per sequence (None: the
    config's), the fields set so far and the assumptions (notes) of the estimate."""

    dims: Any  # vramsweep.estimate.dims.ModelDims
    seq_len: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text)


_HOOKS: dict[str, KnobHooks] = {}
_MODULE: dict[str, str] = {}  # provider name -> the module that registered it
_loaded = False


def register(hooks: KnobHooks) -> KnobHooks:
    """Register (or replace, by name) a provider's hooks; returns them. Its place in the pipeline is the
    place in :data:`PROVIDERS` of the module that calls this (the caller's ``__name__``)."""
    _HOOKS[hooks.name] = hooks
    _MODULE[hooks.name] = sys._getframe(1).f_globals.get("__name__", "")
    return hooks


def _place(h: KnobHooks) -> int:
    """The provider's place in the pipeline: its module's index in :data:`PROVIDERS` (others: after)."""
    module = _MODULE.get(h.name, "")
    return PROVIDERS.index(module) if module in PROVIDERS else len(PROVIDERS)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in PROVIDERS:
            importlib.import_module(mod)


def registered() -> list[KnobHooks]:
    """Every provider, in pipeline order (its module's place in :data:`PROVIDERS`, then registration)."""
    _load()
    return sorted(_HOOKS.values(), key=_place)  # sorted() is stable: registration breaks ties


def active(cfg: Any) -> list[KnobHooks]:
    """The providers the composed config turns on, in pipeline order."""
    return [h for h in registered() if h.active(cfg)]


def _record(b: Build, h: KnobHooks, notes: Any) -> None:
    if h.notes_in == "build":
        b.notes.update(notes or {})
    else:
        b.notes.setdefault("knobs", {})[h.name] = notes


def run_build(cfg: Any, b: Build) -> Build:
    """Run every active provider's ``patch``, ``load`` and ``build`` hooks on ``b``, stage by stage."""
    hooks = active(cfg)
    for stage in STAGES:
        for h in hooks:
            fn = getattr(h, stage)
            if fn is not None and not b.done:
                _record(b, h, fn(cfg, b))
    if not b.done:
        b.notes.setdefault("knobs", {})  # meta.build.knobs: present (maybe empty) for every built model
    return b


def run_data(cfg: Any, d: Batching) -> dict[str, Any]:
    """Run every active provider's ``data`` hook on ``d`` in order; returns their notes by provider name
    (for ``meta.data``)."""
    notes: dict[str, Any] = {}
    for h in active(cfg):
        if h.data is not None and (out := h.data(cfg, d)) is not None:
            notes[h.name] = out
    return notes


def run_measure(cfg: Any, m: Measuring) -> Measuring:
    """Run every active provider's ``measure`` hook for ``m.phase``, in order."""
    for h in active(cfg):
        if h.measure is not None:
            h.measure(cfg, m)
    return m


def loss_fn(cfg: Any, model: Any) -> Callable[..., Any]:
    """The training loss ``fn(input_ids, attention_mask, labels, **kw) -> mean loss over target tokens``
    (``kw``: ``position_ids`` of packed rows, passed to the model):
    the active provider's, or the model's own; then every active ``wrap_loss`` around it (attention's
    causal fast path for an unpadded batch)."""
    hooks = active(cfg)
    owners = [h for h in hooks if h.loss is not None]
    if len(owners) > 1:
        raise ValueError(f"knobs {[h.name for h in owners]} each replace the training loss: choose one")
    if owners:
        fn = owners[0].loss(cfg, model)
    else:

        def fn(ids, mask, labels, **kw):
            return model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss

    for h in hooks:
        if h.wrap_loss is not None:
            fn = h.wrap_loss(cfg, model, fn)
    return fn


def estimate_fields(cfg: Any, e: Estimating | None = None) -> dict[str, Any]:
    """The estimator's fields set by the active providers, in order (a later provider wins on a clash);
    their notes go to ``e.notes``."""
    e = e if e is not None else Estimating(dims=None)
    for h in active(cfg):
        if h.estimate is not None:
            e.fields.update(h.estimate(cfg, e))
    return e.fields
