"""Peak of live tensor bytes by category — the CPU analogue of ``torch.cuda.max_memory_allocated``.

A ``TorchDispatchMode`` sees every tensor an op creates; each new storage is counted once (views share
it) and uncounted when Python drops the last reference (weakref callback on the storage object, the
pattern of ``torch.distributed._tools.mem_tracker``, whose per-module hooks fail on frozen LoRA bases).

Categories (shared with the estimator, docs/CONTRACTS.md): ``params`` (parameters, buffers and
bitsandbytes quant-state tensors, registered before tracking), ``grads`` (``.grad`` of trainable
parameters, re-labelled the moment autograd accumulates them), ``optimizer`` (storages created inside
``optimizer.step()`` that outlive it: the state), ``activations`` (everything else created in
forward/backward: saved tensors, logits, loss temporaries), ``other``.

The mode costs a Python call per op, so the trial tracks only its warm-up steps (which are excluded
from tokens/s) and runs the measured steps untracked.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """Storages behind ``t``, unwrapping traceable tensor subclasses."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for a in attrs:
            out.extend(_storages(getattr(t, a)))
        return out
    if t.is_meta or t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _quant_state_tensors(param: torch.Tensor) -> Iterator[torch.Tensor]:
    qs = getattr(param, "quant_state", None)
    while qs is not None:
        for name in ("absmax", "code", "offset"):
            v = getattr(qs, name, None)
            if isinstance(v, torch.Tensor):
                yield v
        qs = getattr(qs, "state2", None)
    for name in ("SCB", "CB"):  # bitsandbytes Int8Params
        v = getattr(param, name, None)
        if isinstance(v, torch.Tensor):
            yield v


def model_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model owns: parameters, buffers and quantisation state (absmax, code, SCB...)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        out.extend(_quant_state_tensors(p))
    out.extend(model.buffers())
    for mod in model.modules():  # int8 layers keep the scale on the module state too
        st = getattr(mod, "state", None)
        for name in ("SCB", "CB"):
            v = getattr(st, name, None) if st is not None else None
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            seen[id(st) if st.data_ptr() == 0 else st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class TensorMemoryTracker(TorchDispatchMode):
    """Track live tensor bytes by category; ``peak_bytes`` / ``peak_breakdown`` after use.

    Usage::

        tracker = TensorMemoryTracker(model, optimizer)
        with tracker:
            ...  # forward / backward
            with tracker.optimizer_phase():
                optimizer.step()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self._info = WeakIdKeyDictionary()  # storage -> [nbytes, category, weakref]
        self._refs: dict[int, list] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_breakdown = dict(self.current)
        self._phase = "activations"
        self._hooks = []
        self._model = model
        self._optimizer = optimizer
        for t in model_state_tensors(model):
            self._add(t, "params")
        if optimizer is not None:
            for t in optimizer_state_tensors(optimizer):
                self._add(t, "optimizer")
        for p in model.parameters():
            if p.grad is not None:
                self._add(p.grad, "grads")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._update_peak()

    # -- bookkeeping ---------------------------------------------------------------------------
    def _on_free(self, ref) -> None:  # weakref callback
        entry = self._refs.pop(id(ref), None)
        if entry is not None:
            nbytes, cat = entry[0], entry[1]
            self.current[cat] -= nbytes

    def _add(self, t: torch.Tensor, category: str) -> None:
        for st in _storages(t):
            entry = self._info.get(st)
            if entry is not None:
                if entry[1] != category and category in ("params", "grads", "optimizer"):
                    self.current[entry[1]] -= entry[0]
                    self.current[category] += entry[0]
                    entry[1] = category
                continue
            nbytes = st.nbytes()
            ref = weakref.ref(st, self._on_free)
            entry = [nbytes, category, ref]
            self._info[st] = entry
            self._refs[id(ref)] = entry
            self.current[category] += nbytes

    def _update_peak(self) -> None:
        total = sum(self.current.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_breakdown = dict(self.current)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._add(p.grad, "grads")

    @contextmanager
    def optimizer_phase(self):
        """Storages created inside this block that survive it are optimizer state."""
        self._phase = "optimizer"
        try:
            yield
        finally:
            self._phase = "activations"
            if self._optimizer is not None:
                for t in optimizer_state_tensors(self._optimizer):
                    self._add(t, "optimizer")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                # Temporaries of optimizer.step() count as "other"; surviving state is re-labelled
                # "optimizer" when the phase ends.
                self._add(t, "other" if self._phase == "optimizer" else "activations")
        self._update_peak()
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def breakdown(self) -> dict[str, int]:
        """Category bytes at the peak (``other`` = optimizer-step temporaries)."""
        return {k: int(v) for k, v in self.peak_breakdown.items()}


def close_tracker(tracker: TensorMemoryTracker, optimizer: Any) -> tuple[int, dict[str, int], str | None]:
    """Close the CPU tracker: (peak bytes, breakdown, note). Optimizer state that did not exist yet at the
    tracked peak (AdamW creates it in the first ``optimizer.step()``, after step 0's forward/backward) is
    alive during every later step, so it is added to the peak and its breakdown (the note says so)."""
    tracker.close()
    peak, breakdown = int(tracker.peak_bytes), tracker.breakdown()
    state = tensor_bytes(optimizer_state_tensors(optimizer))
    missing = state - int(breakdown.get("optimizer", 0))
    note = None
    if missing > 0:
        peak += missing
        breakdown["optimizer"] = state
        note = (
            f"optimizer state ({missing / 2**20:.2f} MiB) was created by the first optimizer step, after the "
            "tracked forward/backward peak; it is alive in every later step, so it is added to the peak"
        )
    return peak, breakdown, note
