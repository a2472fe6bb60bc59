"""Offloaded activation checkpoints: each decoder layer keeps only its input, in host memory.

Plain gradient checkpointing keeps every decoder layer's input on the GPU (``layers x tokens x hidden x
dtype``: Qwen3-8B at 65,536 tokens, 36 x 65,536 x 4,096 x 2 B = 18 GiB) and recomputes the layer in
backward. Here each layer's input is copied to **pinned host memory on a side stream** during forward
(the GPU copy is released once the copy is done), and in backward copied back — the next layer's input
is **prefetched** on the side stream while the current layer recomputes — so the GPU holds about two
layer inputs plus one layer's recompute. Unsloth's ``use_gradient_checkpointing="unsloth"`` and Arctic
Long Sequence Training (arXiv 2506.13996) do the same.

It plugs into Hugging Face's checkpointing hook: after ``model.gradient_checkpointing_enable()``,
:func:`enable_offload` replaces each ``GradientCheckpointingLayer``'s ``_gradient_checkpointing_func``.
Dropout in the layer (LoRA dropout) replays the same random numbers in the recompute, so gradients equal
``checkpointing=on``'s. Trainable parameters of the layer are passed to the autograd Function so the
first layer's adapters get gradients although its input (frozen embeddings) does not require grad.

Host memory: the layer inputs of one pass live in **one exact-size host pool** (:class:`HostPool`), not
in per-layer blocks of PyTorch's caching host allocator, which rounds every block up to a power of two
(Qwen3-8B at 83k tokens: 681 MB per layer -> 1 GiB, 36 GiB for 36 layers instead of 24 GiB). On CUDA the
pool is ordinary host memory page-locked with ``cudaHostRegister`` (what ``pin_memory`` does without the
rounding); it grows to the largest pass seen and is reused by every step. A pool that cannot be allocated
or pinned raises :class:`HostMemoryError` naming the bytes asked for (the trial records status
``host_oom``, not a GPU OOM); a failed ``cudaHostRegister`` leaves CUDA's per-thread last error set, which
the next kernel launch of the process would raise as "CUDA error: out of memory", so it is cleared
(``cudaGetLastError``) before the error is raised. While the pool grows the process writes a marker
(:mod:`vramsweep.record.hostmem`): when the kernel's OOM killer ends it there (SIGKILL, no result), the
sweeper records ``host_oom``, not ``error``. ``peak_host_bytes`` / ``pool_bytes`` go to the result
(``meta.host_memory``).

On a CPU device there is no separate device memory: the "offloaded" copy lives in the same RAM, so it
saves nothing; it runs (for tests of equality) and the trial says so (``meta.build.offload``).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import torch

from vramsweep.record.hostmem import FAILED, GROWING, HELD, HostMemoryError, write_marker

GIB = 2**30


def _pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf``'s storage in place for async copies (``cudaHostRegister``, exact size). On failure
    CUDA's last error is cleared first, so the process's next kernel launch does not raise it."""
    rt = torch.cuda.cudart()
    err = int(rt.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0))
    if err != 0:
        cleared = clear_last_cuda_error(rt)
        note = "last error cleared" if cleared is not None else "CUDA's last error could not be cleared"
        raise HostMemoryError(
            f"cudaHostRegister of {buf.numel() * buf.element_size() / GIB:.2f} GiB failed (cudaError {err}; "
            f"{note})"
        )


def libcudart_path(maps: str) -> str | None:
    """The ``libcudart`` this process has mapped, from the text of ``/proc/self/maps`` (None if none)."""
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if "/libcudart" in path and ".so" in path:
            return path.strip()
    return None


@functools.cache
def _libcudart_get_last_error() -> Any:
    """``cudaGetLastError`` of the libcudart torch loaded (torch does not bind it); None when none is mapped
    (a statically linked runtime) or it cannot be opened."""
    try:
        with open("/proc/self/maps") as fh:
            path = libcudart_path(fh.read())
        fn = ctypes.CDLL(path).cudaGetLastError if path else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


def clear_last_cuda_error(rt: Any = None) -> int | None:
    """Reset this thread's CUDA last error (``cudaGetLastError``); the error it held, or None when the
    runtime's ``cudaGetLastError`` could not be reached. A failed ``cudaHostRegister`` sets it, and torch's
    check after every kernel launch reads it: left set, the next launch raises "CUDA error: out of memory"."""
    get = getattr(rt, "cudaGetLastError", None) or _libcudart_get_last_error()
    if get is None:
        return None
    return int(get())


def _unpin(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class HostPool:
    """One exact-size host buffer for the layer inputs of a pass, carved in order (``take``) and rewound
    at the start of each pass (``reset``). It grows (reallocated, never rounded up) when a pass needs
    more than it holds. ``pin``: page-lock it (CUDA); otherwise plain host memory (CPU device, tests)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self.offset = 0
        #: the pool's pages are still being faulted in (plain host memory, before its first full pass)
        self.growing = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def reserve(self, nbytes: int) -> None:
        """Hold at least ``nbytes`` (only between passes: the old buffer's views must be consumed)."""
        if nbytes <= self.nbytes:
            return
        self.release()
        write_marker(GROWING, nbytes, pinned=self.pin)  # an OOM kill from here on is host memory
        try:
            buf = torch.empty(int(nbytes), dtype=torch.uint8, device="cpu")
            if self.pin:
                _pin(buf)  # faults every page in and locks it
        except (HostMemoryError, RuntimeError, MemoryError) as exc:
            write_marker(FAILED, nbytes, pinned=self.pin, error=type(exc).__name__)
            self._raise(nbytes, exc)
        self.buf = buf
        self.growing = not self.pin  # plain host memory: its pages fault in as the first pass fills it
        if self.pin:
            write_marker(HELD, nbytes, pinned=True)

    @staticmethod
    def _raise(nbytes: int, exc: BaseException) -> None:
        if isinstance(exc, HostMemoryError):
            raise HostMemoryError(
                f"host memory for checkpointing=offload: {nbytes / GIB:.2f} GiB of pinned memory "
                f"for the layer inputs could not be page-locked ({exc}); use a shorter "
                "context.max_tokens, or checkpointing=on on a machine with less RAM than that"
            ) from None
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise HostMemoryError(
            f"host memory for checkpointing=offload: {nbytes / GIB:.2f} GiB for the layer inputs "
            f"could not be allocated ({type(exc).__name__}: {first})"
        ) from None

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.offset + n > self.nbytes:
            raise HostMemoryError(
                f"host pool of {self.nbytes} B holds {self.offset} B; {n} B more were asked for in this pass"
            )
        view = self.buf[self.offset : self.offset + n].view(dtype).view(shape)
        self.offset += n
        return view

    def reset(self) -> None:
        if self.growing and self.offset == self.nbytes:  # the last pass's copies touched every page
            self.growing = False
            write_marker(HELD, self.nbytes, pinned=False)
        self.offset = 0

    def release(self) -> None:
        if self.buf is not None and self.pin:
            _unpin(self.buf)
        self.buf = None
        self.offset = 0
        self.growing = False


class OffloadManager:
    """Host copies of the layer inputs of one forward pass, in forward order; backward consumes them in
    reverse and prefetches the one before. ``layers``: how many checkpointed layers a pass saves (the
    pool is sized ``layers x`` the first input of a pass; a pass that saves more raises)."""

    def __init__(self, device: torch.device, layers: int = 1):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.layers = max(1, int(layers))
        self.pool = HostPool(pin=self.cuda)
        self.slots: list[list[Any] | None] = []
        self.bytes_offloaded = 0
        self.peak_host_bytes = 0
        self._live_host = 0

    @property
    def pool_bytes(self) -> int:
        """Host bytes held for the layer inputs (pinned on CUDA): the exact size of the largest pass."""
        return self.pool.nbytes

    def begin_pass(self, t: torch.Tensor) -> None:
        """The first checkpointed layer of a forward pass: rewind the pool (sized for ``layers`` inputs like
        ``t``). Copies left by a pass whose backward never ran (an exception between) are dropped."""
        self.slots.clear()
        self._live_host = 0
        need = self.layers * t.numel() * t.element_size()
        if need > self.pool.nbytes and self.cuda:
            self.stream.synchronize()  # no copy may still read the buffer that is about to be freed
        self.pool.reset()
        self.pool.reserve(need)

    def save(self, t: torch.Tensor) -> int:
        if self.pool.buf is None or (not self.slots and self.pool.offset):
            self.begin_pass(t)  # (the model's first checkpointed layer calls begin_pass itself)
        # (on CUDA, the side stream orders this pass's D2H copies after the last pass's H2D reads)
        buf = self.pool.take(t.shape, t.dtype)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                buf.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the GPU copy is not reused before the side stream read it
            done = torch.cuda.Event()
            done.record(self.stream)
        else:
            buf.copy_(t.detach())
            done = None
        nbytes = t.numel() * t.element_size()
        self.bytes_offloaded += nbytes
        self._live_host += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self._live_host)
        self.slots.append([buf, done, None, None])  # host copy, D2H event, prefetched tensor, H2D event
        return len(self.slots) - 1

    def _prefetch(self, i: int) -> None:
        if not self.cuda or i < 0 or i >= len(self.slots):
            return
        slot = self.slots[i]
        if slot is None or slot[2] is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(slot[1])
            slot[2] = slot[0].to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            slot[3] = ev

    def load(self, i: int) -> torch.Tensor:
        slot = self.slots[i]
        assert slot is not None, f"offloaded activation {i} was already consumed"
        if self.cuda:
            self._prefetch(i)
            torch.cuda.current_stream(self.device).wait_event(slot[3])
            out = slot[2]
            out.record_stream(torch.cuda.current_stream(self.device))
        else:
            out = slot[0]
        self._live_host -= slot[0].numel() * slot[0].element_size()
        self.slots[i] = None
        self._prefetch(i - 1)  # the layer before runs next in backward
        if all(s is None for s in self.slots):
            self.slots.clear()
        return out


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, manager: OffloadManager, hidden: torch.Tensor, n_args: int, *rest):
        args, _params = rest[:n_args], rest[n_args:]
        ctx.run, ctx.manager, ctx.args, ctx.n_rest = run, manager, args, len(rest)
        ctx.rng = _rng_state(hidden.device)
        ctx.slot = manager.save(hidden.detach())
        with torch.no_grad():
            out = run(hidden, *args)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"checkpointing=offload expects a decoder layer returning a tensor, got {type(out)}"
            )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden = ctx.manager.load(ctx.slot).detach()
        want_input_grad = ctx.needs_input_grad[2]
        hidden.requires_grad_(want_input_grad)
        dev = hidden.device
        with torch.enable_grad(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], dev)
            out = ctx.run(hidden, *ctx.args)
        # Parameter gradients accumulate in .grad here; the Function returns None for the params.
        torch.autograd.backward(out, grad)
        return (None, None, hidden.grad if want_input_grad else None, None, *([None] * ctx.n_rest))


def offloaded_checkpoint(manager: OffloadManager, layer: torch.nn.Module, first: bool = False):
    """A ``_gradient_checkpointing_func`` for ``layer``: ``fn(function, *args)`` as transformers calls it.
    ``first``: the model's first checkpointed layer (a new forward pass starts there)."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def checkpoint_fn(function, hidden, *args):
        if not torch.is_grad_enabled():  # no backward will consume a copy: run the layer as it is
            return function(hidden, *args)
        if first:
            manager.begin_pass(hidden)
        return _OffloadedCheckpoint.apply(function, manager, hidden, len(args), *args, *params)

    return checkpoint_fn


def enable_offload(model: torch.nn.Module, device: torch.device) -> dict:
    """Switch every checkpointed layer of ``model`` (after ``gradient_checkpointing_enable``) to offloaded
    checkpoints; returns notes for ``meta.build``. Call after the adapter is attached (the Function
    needs each layer's trainable parameters)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer)
        and getattr(m, "gradient_checkpointing", False)
        and hasattr(m, "_gradient_checkpointing_func")
    ]
    if not layers:
        raise RuntimeError(
            "checkpointing=offload found no checkpointed layers (gradient_checkpointing_enable did not mark "
            "any GradientCheckpointingLayer)"
        )
    manager = OffloadManager(device, layers=len(layers))
    for i, layer in enumerate(layers):
        layer._gradient_checkpointing_func = offloaded_checkpoint(manager, layer, first=i == 0)
    model._vramsweep_offload = manager
    return {
        "layers": len(layers),
        "target": "one exact-size pinned host pool (cudaHostRegister), side-stream copies, prefetch"
        if manager.cuda
        else "one exact-size host pool",
        "saves_device_memory": manager.cuda,
        "note": None
        if manager.cuda
        else "CPU device: the offloaded copies live in the same RAM; this runs and is exact, but saves "
        "nothing",
    }
