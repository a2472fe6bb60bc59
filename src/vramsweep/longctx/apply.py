"""Apply the long-context knobs to a built model (``checkpointing=offload``, ``tiling=…``): one place.

Called by the build after the adapter is attached; :func:`loss_fn` gives the training loop its loss
(the model's own, or the chunked one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig


def apply_longctx(cfg: DictConfig, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Offload checkpoints and tile the MLPs as the config says; returns notes for ``meta.build``."""
    notes: dict[str, Any] = {}
    if cfg.checkpointing.offload:
        from vramsweep.longctx.offload import enable_offload

        notes["offload"] = enable_offload(model, device)
    tile = int(cfg.tiling.mlp_tile_tokens)
    if tile > 0:
        from vramsweep.longctx.mlp import tile_mlps

        notes["mlp_tiles"] = {"tile_tokens": tile, "layers": tile_mlps(model, tile)}
    chunk = int(cfg.tiling.loss_chunk_tokens)
    if chunk > 0:
        from vramsweep.longctx.loss import causal_lm_of

        causal_lm_of(model)  # fails now (clear reason) rather than at the first step
        notes["loss_chunks"] = {"chunk_tokens": chunk}
    return notes


def loss_fn(cfg: DictConfig, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``fn(input_ids, attention_mask, labels) -> mean loss over target tokens``."""
    chunk = int(cfg.tiling.loss_chunk_tokens)
    if chunk > 0:
        from vramsweep.longctx.loss import causal_lm_loss

        return lambda ids, mask, labels: causal_lm_loss(model, ids, mask, labels, chunk_tokens=chunk)
    return lambda ids, mask, labels: model(input_ids=ids, attention_mask=mask, labels=labels).loss
