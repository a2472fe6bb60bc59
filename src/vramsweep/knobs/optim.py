"""Optimizers from their option file (``_target_`` + ``kwargs``) and the LR schedule (transformers).

An optimizer is declared in ``conf/optimizer/<name>.yaml``: ``_target_`` names the class (torch,
bitsandbytes, transformers or any importable one), ``kwargs`` its constructor keywords besides the params
and ``lr`` (``train.lr``), ``state`` what it keeps (read by the estimator). There is no branch per
optimizer here: an option whose class takes no ``eps`` (Lion) simply lists none.

``adapter.dtype=compute`` + ``adapter.fp32_master=true`` (the default): the optimizer steps fp32 master
copies of the 16-bit adapter weights (:class:`Fp32Master`), so updates smaller than half a bf16 ulp of a
weight are not rounded away; the model keeps computing with (and saving activations in) the 16-bit
weights. Cost: 4 bytes/param for the master copy, and the optimizer state is then fp32 like the masters
(torch AdamW: 8 instead of 2 x 2 bytes/param). bitsandbytes' optimizers keep no master copy of their own:
their CPU kernels step a 16-bit param in fp32 and round it back to nearest
(``bitsandbytes/backends/cpu/ops.py``: ``p.data.copy_(p_fp32)``), so they get the same wrapper.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.errors import ConfigError
from vramsweep.config.paths import find_option
from vramsweep.knobs.optim_source import read_target
from vramsweep.knobs.registry import KnobHooks, register

if TYPE_CHECKING:  # torch is imported where it runs: the estimator reads this provider without it
    import torch


def optimizer_class(target: str) -> type:
    """The class named by ``optimizer._target_`` (``package.module.Class``)."""
    module, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not isinstance(cls, type):
        raise _target_error(target, function=callable(cls))
    return cls


def _target_error(target: str, *, function: bool) -> ConfigError:
    what = "names a function, not an optimizer class" if function else "is not an importable class"
    return ConfigError(
        f"optimizer._target_={target!r} {what}",
        key="optimizer._target_",
        allowed=["<package.module.Class>, e.g. torch.optim.AdamW"],
    )


def optimizer_kwargs(cfg: DictConfig, cls: type) -> dict[str, Any]:
    """``optimizer.kwargs`` resolved (lists become tuples: betas, Adafactor's eps), checked against the
    constructor's signature so that a keyword the class does not take names the option."""
    kwargs = OmegaConf.to_container(cfg.optimizer.kwargs, resolve=True) or {}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    sig = inspect.signature(cls.__init__).parameters
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())
    check_keywords(cfg, kwargs, cls.__name__, None if var_keyword else list(sig))
    return kwargs


def check_keywords(
    cfg: DictConfig, kwargs: Iterable[str], cls_name: str, params: Sequence[str] | None
) -> None:
    """Each of ``kwargs`` is a keyword of ``params`` (the ``__init__``'s parameter names; ``None``: it
    takes ``**kwargs``) other than ``self``, ``params`` and ``lr`` (passed from ``train.lr``)."""
    if params is None:
        return
    name = cfg.optimizer.name
    takes = [n for n in params if n not in ("self", "params")]
    for k in kwargs:
        if k == "lr":
            raise ConfigError(
                f"optimizer={name}: optimizer.kwargs.lr duplicates train.lr (the learning rate is passed "
                "from train.lr)",
                key="optimizer.kwargs.lr",
                allowed=["train.lr=<value> (and no optimizer.kwargs.lr)"],
            )
        if k not in takes:
            raise ConfigError(
                f"optimizer={name}: {cls_name} takes no keyword {k!r} (optimizer.kwargs.{k})",
                key=f"optimizer.kwargs.{k}",
                allowed=[n for n in takes if n != "lr"],
            )


def check_optimizer_source(cfg: DictConfig) -> None:
    """:func:`optimizer_class` and :func:`optimizer_kwargs`'s checks without importing the optimizer's
    module (a sweep's parent process never imports torch): ``_target_`` and its ``__init__`` are read
    from source (:mod:`vramsweep.knobs.optim_source`). What cannot be read for certain is left to the
    trial, which checks the imported class."""
    target = str(cfg.optimizer["_target_"])
    found = read_target(target)
    if found is None:
        return
    if found.kind != "class":
        raise _target_error(target, function=found.kind == "function")
    kwargs = OmegaConf.to_container(cfg.optimizer.kwargs, resolve=True) or {}
    check_keywords(cfg, kwargs, found.name, found.params)


def build_optimizer(cfg: DictConfig, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, dict]:
    """The optimizer declared by ``cfg.optimizer`` (``_target_(params, lr=train.lr, **kwargs)``) and notes
    for ``meta``.

    The paged bitsandbytes optimizers (``state.paged``) keep their state in CUDA unified memory; on CPU
    bitsandbytes falls back to ordinary (non-paged) state, which the notes record.
    """
    o = cfg.optimizer
    cls = optimizer_class(o["_target_"])
    kwargs = optimizer_kwargs(cfg, cls)
    master = Fp32Master(params) if wants_fp32_master(cfg) else None
    if master is not None and master.pairs:
        params = master.optimizer_params()
    else:
        master = None
    opt = cls(params, lr=float(cfg.train.lr), **kwargs)
    notes: dict = {"optimizer_class": f"{type(opt).__module__}.{type(opt).__name__}", "paged": False}
    if bool(o.state.paged):
        on_cuda = any(p.is_cuda for p in params)
        notes["paged"] = on_cuda
        if not on_cuda:
            notes["paged_fallback"] = (
                "CPU: bitsandbytes keeps paged-optimizer state as ordinary (non-paged) tensors"
            )
    if master is not None:
        notes["fp32_master"] = master.attach(opt)
    return opt, notes


def wants_fp32_master(cfg: DictConfig) -> bool:
    """LoRA adapters in a 16-bit compute dtype (``adapter.dtype=compute``) with ``adapter.fp32_master``."""
    a = cfg.adapter
    return (
        str(a.method) == "lora"
        and str(a.get("dtype", "fp32")) == "compute"
        and bool(a.get("fp32_master", True))
        and str(cfg.train.dtype) != "fp32"
    )


class Fp32Master:
    """fp32 master copies of 16-bit trainable params, kept by the optimizer.

    The inner optimizer is built on the fp32 copies (so its state is fp32 too). A step pre-hook moves each
    16-bit gradient into its master's ``.grad`` as fp32 (freeing the 16-bit one: they never coexist for
    the whole model); a post-hook rounds the masters back into the 16-bit params (round to nearest) and
    drops the fp32 grads. After the first step each master is also referenced from its optimizer state
    (``state[master]["fp32_master"]``), so memory accounting that reads ``optimizer.state`` counts it as
    optimizer state. Works for any ``torch.optim.Optimizer`` subclass (torch, bitsandbytes, transformers)
    because torch runs step hooks for all of them; the LR scheduler sees the inner optimizer unchanged.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._master_of: dict[int, torch.Tensor] = {}
        for p in self.params:
            if p.is_floating_point() and p.element_size() < 4:
                m = p.detach().float().requires_grad_(True)  # a leaf, as optimizers require
                self.pairs.append((p, m))
                self._master_of[id(p)] = m

    def optimizer_params(self) -> list[torch.Tensor]:
        """The params to build the optimizer on: the fp32 master in place of each 16-bit param."""
        return [self._master_of.get(id(p), p) for p in self.params]

    def attach(self, opt: torch.optim.Optimizer) -> dict:
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)
        opt.fp32_master = self  # type: ignore[attr-defined]
        inner_zero_grad = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:  # the 16-bit grads too (a step frees them anyway)
            inner_zero_grad(set_to_none)
            for p, _ in self.pairs:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

        opt.zero_grad = zero_grad  # type: ignore[method-assign]
        return {
            "params": len(self.pairs),
            "bytes": int(sum(m.numel() * 4 for _, m in self.pairs)),
            "dtype": str(self.pairs[0][0].dtype).replace("torch.", ""),
        }

    def restore(self, opt: torch.optim.Optimizer) -> int:
        """After ``opt.load_state_dict`` (a resumed run): put each saved master back into the master the
        optimizer steps, and drop the loaded copy; returns how many masters came from the checkpoint.

        The optimizer is built on masters made from the fresh adapter, and ``load_state_dict`` casts the
        saved state into *new* tensors: ``state[m]["fp32_master"]`` then held the checkpoint's master while
        ``m`` still held the initial weights, so the first resumed step wrote ``initial + update`` back into
        the model (the training before the checkpoint lost) and an extra fp32 copy of the adapter stayed on
        the device. A master with no saved state (no step taken yet) is set from its 16-bit param."""
        import torch

        restored = 0
        with torch.no_grad():
            for p, m in self.pairs:
                st = opt.state.get(m)
                saved = st.pop("fp32_master", None) if st else None
                if saved is not None and saved is not m:
                    m.copy_(saved)
                    restored += 1
                else:
                    m.copy_(p)
                if st:
                    st["fp32_master"] = m
        return restored

    def _pre(self, opt, args, kwargs) -> None:
        import torch

        with torch.no_grad():
            for p, m in self.pairs:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    def _post(self, opt, args, kwargs) -> None:
        import torch

        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)  # round to nearest: the master keeps what the 16-bit weight cannot hold
                m.grad = None
                st = opt.state.get(m)
                if st and "fp32_master" not in st:  # after the optimizer initialised its own state
                    st["fp32_master"] = m


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer):
    from transformers import get_scheduler

    return get_scheduler(
        cfg.train.schedule,
        optimizer=optimizer,
        num_warmup_steps=int(cfg.train.warmup_steps),
        num_training_steps=int(cfg.train.steps),
    )


# ------------------------------------------------------------------------------------------- provider
def state_spec(o: DictConfig) -> dict[str, Any]:
    """The optimizer's state spec (``optimizer.state``, declared in its option file) as a plain mapping
    (:class:`vramsweep.estimate.analytic.OptimizerState`'s fields), with the 8-bit threshold the class is
    given (``optimizer.kwargs.min_8bit_size``; else the spec's, the class default).

    A result written before optimizers were declarative (``optimizer.impl``, no ``state``) takes the spec
    of the option file of the same name and its own ``min_8bit_size``."""
    if "state" in o:
        state, kwargs = o.state, o.get("kwargs") or {}
    else:
        path = find_option("optimizer", str(o.name))
        if path is None:
            raise ValueError(f"optimizer={o.name}: no state spec and no file conf/optimizer/{o.name}.yaml")
        declared = OmegaConf.load(path)
        state, kwargs = declared.state, dict(declared.get("kwargs") or {})
        if "min_8bit_size" in kwargs and "min_8bit_size" in o:
            kwargs["min_8bit_size"] = o.min_8bit_size
    spec = {str(k): state[k] for k in state}
    if "min_8bit_size" in kwargs:
        spec["min_8bit_size"] = int(kwargs["min_8bit_size"])
    return spec


def _estimate(cfg: DictConfig, e: Any) -> dict[str, Any]:
    spec = state_spec(cfg.optimizer)
    if e.fields.get("device") == "cuda" and bool(spec.get("paged") or False):
        e.note("paged optimizer state is counted on the device (it only pages out under pressure)")
    return {"optimizer": str(cfg.optimizer.name), "opt": spec}


# the optimizer itself is built by the trial (build_optimizer: after the model, from the trainable params)
register(
    KnobHooks(
        name="optimizer",
        estimate=_estimate,
        groups=("optimizer",),
        notes_in="build",
    )
)
