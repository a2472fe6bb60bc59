"""Attention backends: what the training step passes as the attention mask of an unpadded batch.

For an unpadded batch the loop passes no mask, and transformers (5.x ``masking_utils``) then looks for
packed sequences in the position ids (``find_packed_sequence_indices``: a ``.all()`` read on the host, i.e.
a device sync at the start of every forward on CUDA; with a 2-D mask, SDPA's mask check reads it too).
For SDPA and FlashAttention-2 the causal mask of an unpadded batch is "no mask, causal": transformers'
decoders accept a precomputed mask per layer type, so :func:`causal_mask_mapping` hands them
``{"full_attention": None}`` and the forward runs without the host read — same kernels, same values
(tests/training/test_loop.py). Eager attention needs a materialised causal mask (no fast path there), and
models with sliding-window layers keep transformers' own masks.

Packed rows (``data.packing``) under eager/sdpa load the segment-wise implementation of
:mod:`vramsweep.knobs.packed_attention` instead (:func:`implementation`): attention per packed example,
no T x T block mask.

The ``attention`` provider (:mod:`vramsweep.knobs.registry`): ``attn_implementation`` for loading, the
implementation the model reports after it (``meta.build.attn_implementation``), the fast path around the
training loss, and the estimator's ``attention`` field.
"""

from __future__ import annotations

from typing import Any

from vramsweep.config.packing import packed
from vramsweep.knobs.registry import KnobHooks, register

FAST_PATH_IMPLEMENTATIONS = ("sdpa", "flash_attention_2")


def causal_mask_mapping(model: Any) -> dict[str, None] | None:
    """``{"full_attention": None}`` when every decoder layer of ``model`` (a HF causal LM, or a PEFT
    wrapper of one) is full causal attention on SDPA / FlashAttention-2; otherwise None (use the model's
    own mask building)."""
    get = getattr(model, "get_base_model", None)
    lm = get() if callable(get) else model
    config = getattr(lm, "config", None)
    if config is None:
        return None
    from vramsweep.longctx.attention import base_name

    impl = base_name(getattr(config, "_attn_implementation", None))  # head groups: the base's mask
    if impl not in FAST_PATH_IMPLEMENTATIONS:
        return None
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return None
    return {"full_attention": None}


def with_causal_fast_path(fn, model: Any, cfg: Any = None):
    """Wrap a loss ``fn(ids, mask, labels)`` so an unpadded batch (``mask is None``) passes the causal
    mask mapping instead of None (no host read in the forward); unchanged when the model has no fast path
    or Unsloth runs the model (its own forward builds its masks)."""
    if cfg is not None and bool(cfg.get("kernels", {}).get("unsloth", False)):
        return fn
    mapping = causal_mask_mapping(model)
    if mapping is None:
        return fn

    def loss(ids, mask, labels, **kw):
        # packed rows (position_ids given) keep mask=None: the model builds the block mask from them
        return fn(ids, mapping if mask is None and not kw else mask, labels, **kw)

    loss.fast_path = True  # for tests and notes
    return loss


# --- the attention provider (vramsweep.knobs.registry): attn_implementation at load, read back after it


def implementation(cfg: Any) -> str:
    """The ``attn_implementation`` the model is built with: ``attention.implementation``, or its
    segment-wise variant (knobs/packed_attention.py) when ``data.packing`` packs rows under eager/sdpa, and
    either wrapped in head groups (longctx/attention.py) when ``tiling.attention_heads`` > 1."""

    impl = str(cfg.attention.implementation)
    if packed(cfg) and impl in ("sdpa", "eager"):
        from vramsweep.knobs.packed_attention import PACKED_NAMES, register

        register()
        impl = PACKED_NAMES[impl]
    if int(cfg.get("tiling", {}).get("attention_heads", 0) or 0) > 1:
        from vramsweep.longctx.attention import register as register_grouped

        impl = register_grouped(impl)
    return impl


def _load(cfg: Any, b: Any) -> dict[str, Any]:
    b.load_kwargs["attn_implementation"] = implementation(cfg)
    return {}


def _built(cfg: Any, b: Any) -> dict[str, Any]:
    want = implementation(cfg)
    config = b.model.config
    if want != str(cfg.attention.implementation) and getattr(config, "_attn_implementation", None) != want:
        b.model.set_attn_implementation(want)  # source=arch: the skeleton was built with the plain name
    return {"attn_implementation": getattr(b.model.config, "_attn_implementation", None)}


def _estimate(cfg: Any, e: Any) -> dict[str, Any]:
    impl = str(cfg.attention.implementation)
    if e.fields.get("padded_batches") and impl == "sdpa":
        e.note(
            "micro_batch > 1 on documents of different lengths: SDPA gets (b,1,s,s) bool + float "
            "padding masks and repeat_kv copies of k/v (no native GQA with a mask)"
        )
    if e.fields.get("packed") and impl in ("sdpa", "eager"):
        e.note(
            "data.packing: segment-wise attention per packed example (knobs/packed_attention.py), causal, "
            "no T x T mask; a row's attention costs the sum of its examples' squares"
        )
    if impl == "flash_attention_2":
        e.note("flash_attention_2 counted like SDPA's flash kernel (q, k, v, output, fp32 log-sum-exp)")
    return {"attention": impl}


register(
    KnobHooks(
        name="attention",
        load=_load,
        build=_built,
        wrap_loss=lambda cfg, model, fn: with_causal_fast_path(fn, model, cfg),
        estimate=_estimate,
        groups=("attention",),
        notes_in="build",
    )
)
