"""Long-context knobs (``checkpointing=offload``, ``tiling=loss|mlp|on``, ``tiling.attention_heads``)
registered with their build, loss and estimate hooks (:mod:`vramsweep.knobs.registry`; they run last, on
the finished model, and ``tiling`` has no other provider); the implementations live in
:mod:`vramsweep.longctx`. Results name them ``meta.build.knobs.offload`` / ``mlp_tiles`` /
``loss_chunks`` / ``attention_heads`` (whose implementation the ``attention`` provider loads).
Their estimate hooks read what the ``kernels`` provider (earlier in the pipeline) set in ``e.fields``:
whether Unsloth runs, and whether the loss is already a fused, chunked cross-entropy.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import KnobHooks, register


def _fused_ce(e: Any) -> bool:
    """A fused, chunked cross-entropy already keeps one logits chunk (Liger FLCE or Unsloth's): the
    ``kernels`` provider's estimate fields."""
    return bool(e.fields["unsloth"] or e.fields["liger_flce"])


# --- checkpointing=offload: each checkpointed layer keeps only its input, in pinned host memory


def _offload_build(cfg: Any, b: Any) -> dict[str, Any]:
    from vramsweep.longctx.offload import enable_offload

    return enable_offload(b.model, b.device)


def _offload_measure(cfg: Any, m: Any) -> None:
    offload = getattr(m.model, "_vramsweep_offload", None)
    if m.phase == "train_end" and offload is not None:  # the host side of the memory (longctx/offload.py)
        m.meta["host_memory"] = {
            "pool_bytes": offload.pool_bytes,
            "peak_offloaded_bytes": offload.peak_host_bytes,
            "pinned": offload.cuda,
            "definition": "pool_bytes: the exact-size host pool for the layer inputs (page-locked with "
            "cudaHostRegister on CUDA); peak_offloaded_bytes: the most layer-input bytes held at once",
        }


register(
    KnobHooks(
        name="offload",
        groups=("checkpointing",),
        active=lambda cfg: cfg.checkpointing.name == "offload",  # the option is the knob
        build=_offload_build,
        measure=_offload_measure,
        # Unsloth offloads its own checkpoints (counted by the estimator's unsloth term)
        estimate=lambda cfg, e: {"offload": not e.fields["unsloth"]},
    )
)


# --- tiling.mlp_tile_tokens > 0: each decoder MLP runs over the sequence in tiles (no full intermediate)


def _mlp_build(cfg: Any, b: Any) -> dict[str, Any]:
    from vramsweep.longctx.mlp import tile_mlps

    tile = int(cfg.tiling.mlp_tile_tokens)
    return {"tile_tokens": tile, "layers": tile_mlps(b.model, tile)}


def _mlp_measure(cfg: Any, m: Any) -> None:
    if m.phase == "train_end":  # MFU's recompute term: the share of timed tokens whose sequence was tiled
        m.mfu["tiled_share"] = m.timing.share_longer_than(int(cfg.tiling.mlp_tile_tokens))


register(
    KnobHooks(
        name="mlp_tiles",
        groups=("tiling",),
        active=lambda cfg: int(cfg.get("tiling", {}).get("mlp_tile_tokens", 0) or 0) > 0,
        build=_mlp_build,
        measure=_mlp_measure,
        estimate=lambda cfg, e: {"mlp_tile": int(cfg.tiling.mlp_tile_tokens)},
    )
)


# --- tiling.loss_chunk_tokens > 0: chunked linear cross-entropy (the seq x vocab logits never exist)


def _loss_build(cfg: Any, b: Any) -> dict[str, Any]:
    from vramsweep.longctx.loss import causal_lm_of

    causal_lm_of(b.model)  # fails now (clear reason) rather than at the first step
    return {"chunk_tokens": int(cfg.tiling.loss_chunk_tokens)}


def _chunked_loss(cfg: Any, model: Any):
    from vramsweep.longctx.loss import causal_lm_loss

    chunk = int(cfg.tiling.loss_chunk_tokens)
    return lambda ids, mask, labels, **kw: causal_lm_loss(model, ids, mask, labels, chunk_tokens=chunk, **kw)


register(
    KnobHooks(
        name="loss_chunks",
        groups=("tiling",),
        active=lambda cfg: int(cfg.get("tiling", {}).get("loss_chunk_tokens", 0) or 0) > 0,
        build=_loss_build,
        loss=_chunked_loss,
        estimate=lambda cfg, e: {"loss_chunk": 0 if _fused_ce(e) else int(cfg.tiling.loss_chunk_tokens)},
    )
)


# --- tiling.attention_heads > 1: each layer's attention in GQA-aligned head groups (1/G of the backward's
# fp32 workspace); the attention provider loads the grouped implementation, this sets the group count


def _attention_groups(cfg: Any) -> int:
    return int(cfg.get("tiling", {}).get("attention_heads", 0) or 0)


def _heads_build(cfg: Any, b: Any) -> dict[str, Any]:
    from vramsweep.longctx.attention import GROUPED_PREFIX, group_attention

    impl = getattr(b.model.config, "_attn_implementation", None)
    if not str(impl).startswith(GROUPED_PREFIX):  # the attention provider loads it; anything else is a bug
        raise RuntimeError(f"tiling.attention_heads: the model runs {impl!r}, not a grouped implementation")
    return {**group_attention(b.model, _attention_groups(cfg)), "implementation": impl}


register(
    KnobHooks(
        name="attention_heads",
        groups=("tiling",),
        active=lambda cfg: _attention_groups(cfg) > 1,
        build=_heads_build,
        estimate=lambda cfg, e: {"attn_groups": _attention_groups(cfg)},
    )
)
