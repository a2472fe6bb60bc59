"""Sequence-tiled MLP: run a position-wise block tile by tile, recompute it tile by tile in backward.

A decoder layer's MLP has no cross-token dependency, so ``mlp(x)`` over ``[batch, seq, hidden]`` equals
the concatenation of ``mlp`` over sequence tiles. :class:`TiledMLP` runs the tiles under ``no_grad`` in
forward (keeping only its input) and, in backward, recomputes each tile with grad enabled and
back-propagates it at once, accumulating the parameters' gradients (LoRA adapters inside the MLP
included) tile by tile. The SwiGLU intermediates (gate, up, activation, product: ~4 x tokens x
intermediate x dtype bytes; Qwen3-8B at 65,536 tokens: 6 GiB in bf16) exist for one tile at a time.
As in DeepSpeed's ``TiledMLP`` (Arctic Long Sequence Training, arXiv 2506.13996).

The block runs in tiles whether or not grad is enabled: under ``no_grad`` (evaluation, and the forward of
``checkpointing=offload`` or reentrant checkpointing, which run each layer without grad and recompute it
in backward) it runs tile by tile straight into one preallocated output, so the full intermediate never
exists in any pass.

Dropout inside the block (LoRA dropout) draws its mask tile by tile (a different, equally distributed
mask than one draw over the whole sequence). Every pass over a layer — a grad-free forward, the tiled
autograd forward, the recompute in backward — draws the tiles' masks in the same order from the same RNG
state, and the backward recompute replays each tile's saved RNG state: the gradients are those of the
loss that was computed (tests/knobs/test_longctx.py replays the forward's masks in an untiled model). Without
dropout, values and gradients equal the untiled block's.
"""

from __future__ import annotations

import torch


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _TiledForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tiles: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.fn, ctx.tiles = fn, tiles
        states: list[tuple] = []
        with torch.no_grad():
            out = _run_tiles(fn, tiles, x, states)
        ctx.states = states
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        sizes = [c.shape[-2] for c in x.chunk(ctx.tiles, dim=-2)]
        start = 0
        # Parameter gradients accumulate in .grad through torch.autograd.backward (as DeepSpeed's TiledMLP
        # does); the Function returns None for them.
        for size, state in zip(sizes, ctx.states, strict=True):
            sl = slice(start, start + size)
            xc = x[..., sl, :].detach().requires_grad_(x_grad is not None)
            with (
                torch.enable_grad(),
                torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []),
            ):
                _set_rng_state(x.device, state)
                out = ctx.fn(xc)
            torch.autograd.backward(out, grad[..., sl, :])
            if x_grad is not None:
                x_grad[..., sl, :] = xc.grad
            start += size
        return (None, None, x_grad, *([None] * (len(ctx.needs_input_grad) - 3)))


def _run_tiles(fn, tiles: int, x: torch.Tensor, states: list[tuple] | None = None) -> torch.Tensor:
    """``fn`` over ``tiles`` sequence tiles of ``x``, written into one preallocated output (no list of tile
    outputs and no concatenation: the output exists once). ``states`` collects each tile's RNG state."""
    out = None
    start = 0
    for c in x.chunk(tiles, dim=-2):
        if states is not None:
            states.append(_rng_state(x.device))
        o = fn(c)
        if out is None:
            out = o.new_empty((*o.shape[:-2], x.shape[-2], o.shape[-1]))
        size = c.shape[-2]
        out[..., start : start + size, :] = o
        start += size
        del o
    return out


def tiled_call(fn, params: list[torch.Tensor], tile_tokens: int, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` over sequence tiles of at most ``tile_tokens`` positions, in every pass: with grad through
    :class:`_TiledForward` (recomputed tile by tile in backward), without grad (evaluation, the grad-free
    forward of offloaded or reentrant checkpointing) tile by tile into one output. A plain call only when
    the sequence fits in one tile."""
    tiles = -(-x.shape[-2] // tile_tokens)
    if tiles <= 1:
        return fn(x)
    if not torch.is_grad_enabled():
        return _run_tiles(fn, tiles, x)
    return _TiledForward.apply(fn, tiles, x, *params)


class TiledMLP(torch.nn.Module):
    """Wraps a position-wise module (``[..., seq, hidden] -> [..., seq, hidden]``) to run in sequence tiles
    of at most ``tile_tokens`` positions (no tiling when the sequence is shorter)."""

    def __init__(self, mlp: torch.nn.Module, tile_tokens: int):
        super().__init__()
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
        self.mlp = mlp
        self.tile_tokens = int(tile_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return tiled_call(self.mlp, params, self.tile_tokens, x)


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """Make every decoder layer's ``mlp`` (HF Llama/Qwen layout: a ``layer.mlp`` beside ``layer.self_attn``)
    run in sequence tiles, by patching the instance's ``forward`` (module names, and so PEFT adapter
    names, stay as they are). Returns how many were patched. Idempotent."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    n = 0
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if not isinstance(mlp, torch.nn.Module) or not hasattr(module, "self_attn"):
            continue
        if getattr(mlp, "_vramsweep_tile_tokens", None) is None:
            original = mlp.forward

            def forward(x, _mlp=mlp, _fn=original):
                params = [p for p in _mlp.parameters() if p.requires_grad]
                return tiled_call(_fn, params, _mlp._vramsweep_tile_tokens, x)

            mlp.forward = forward
        mlp._vramsweep_tile_tokens = int(tile_tokens)
        n += 1
    return n
