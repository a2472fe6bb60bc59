"""Failures are data: the one mapping from the exception a trial ended with to its status and reason.

The trial (:func:`vramsweep.trial.run_trial`) and the sweeper's safety net for a trial function that raised
(:func:`vramsweep.sweeper.outcome.result_from_exception`) both call :func:`classify_exception`, so the same
exception is the same status wherever it is caught. Checked in this order:

1. ``UnsupportedError`` (``vramsweep.config.rules``: a valid config this machine or library set cannot
   run) -> ``unsupported``, its message;
2. ``ConfigError`` (bad input, docs/CONTRACTS.md) -> ``error``, ``config: <message>``;
3. ``Diverged`` (``vramsweep.loop``: a loss is not finite) -> ``diverged``, its message;
   ``FloatingPointError`` -> ``diverged``, ``FloatingPointError: <message>``;
4. ``Pruned`` (``vramsweep.loop``) -> ``pruned``, its message;
5. ``Preempted`` (``vramsweep.production.checkpoint``) -> ``error``, ``preempted: <message>``;
6. a full disk anywhere in the exception's chain (ENOSPC, EDQUOT) -> ``error``,
   ``no space left on device: <path>`` (:mod:`vramsweep.record.diskfull`);
7. :class:`~vramsweep.record.hostmem.HostMemoryError` (the pinned host pool of ``checkpointing=offload``)
   -> ``host_oom``, ``HostMemoryError: <first line>``;
8. out of device memory (:func:`is_oom`: torch's ``OutOfMemoryError``, ``MemoryError``, a ``RuntimeError``
   saying "out of memory") -> ``oom``, ``<type>: <first line>``;
9. anything else -> ``error``, ``<type>: <message>``, *unexpected*.

An *unexpected* failure is a bug or a crash: the caller keeps where it happened (the trial its traceback in
``meta.traceback``, the sweeper the last frames in the reason). A sweep point whose combination of values
the rules refuse is raised as ``UnsupportedError`` where the sweep composes it
(:func:`vramsweep.config.rules.refused_point`): recorded ``unsupported``, a result and not a failure.

Torch-free, and like all of ``record/`` it imports no other part of vramsweep (the sweeper process never
imports torch, and ``record/`` is the floor): the classes of other parts and torch's are told by the names
in their class's MRO, :class:`HostMemoryError` (defined here in ``record/``) by ``isinstance``.
"""

from __future__ import annotations

from typing import NamedTuple

from vramsweep.record.diskfull import disk_full_reason
from vramsweep.record.hostmem import HostMemoryError
from vramsweep.record.status import Status

#: Reason lengths: the device OOM's first line is long enough for torch's "Tried to allocate ..." part.
OOM_CHARS, MESSAGE_CHARS = 300, 500


class Failure(NamedTuple):
    """How a trial that raised ended."""

    status: Status
    reason: str
    unexpected: bool = False  # a bug or a crash (not one of the named failures): keep where it happened


def _names(exc: BaseException) -> set[str]:
    """The class names of ``exc``'s type and its bases (``torch.OutOfMemoryError`` ->
    ``OutOfMemoryError``)."""
    return {cls.__name__ for cls in type(exc).__mro__}


def is_oom(exc: BaseException) -> bool:
    """Out of device memory: torch's ``OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class),
    ``MemoryError``, or a ``RuntimeError`` saying "out of memory" (``CUDA error: out of memory`` raised by a
    kernel launch, bitsandbytes' allocations)."""
    if "OutOfMemoryError" in _names(exc) or isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def classify_exception(exc: BaseException) -> Failure:
    """The status and reason of a trial that ended with ``exc`` (the table in this module's docstring)."""
    names = _names(exc)
    name = type(exc).__name__
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if "UnsupportedError" in names:
        return Failure(Status.UNSUPPORTED, text or name)
    if "ConfigError" in names:
        return Failure(Status.ERROR, f"config: {text}")
    if "Diverged" in names or isinstance(exc, FloatingPointError):
        return Failure(Status.DIVERGED, text if "Diverged" in names else f"{name}: {text}")
    if "Pruned" in names:
        return Failure(Status.PRUNED, text)
    if "Preempted" in names:
        return Failure(Status.ERROR, f"preempted: {text}")
    if (full := disk_full_reason(exc)) is not None:
        return Failure(Status.ERROR, full)  # one line, no traceback: the disk, not the config
    if isinstance(exc, HostMemoryError):
        return Failure(Status.HOST_OOM, f"{name}: {first[:MESSAGE_CHARS]}")
    if is_oom(exc):
        return Failure(Status.OOM, f"{name}: {first[:OOM_CHARS]}" if first else name)
    return Failure(Status.ERROR, f"{name}: {text[:MESSAGE_CHARS]}" if text else name, unexpected=True)


__all__ = ["Failure", "classify_exception", "is_oom"]
