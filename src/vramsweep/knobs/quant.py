"""``quant``: bitsandbytes quantisation of the base weights, as a provider (:mod:`vramsweep.knobs.registry`).

Load: a ``BitsAndBytesConfig`` (:func:`vramsweep.knobs.common.bnb_config`) passed to ``from_pretrained``
-> ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` layers (lm_head and embeddings stay in the compute dtype;
``source=arch`` quantises in place, :mod:`vramsweep.knobs.arch`). Build: the quantised layers counted
(``meta.build.quantised_layers``) and kept in the layout training differentiates through
(:func:`keep_trainable_4bit_layout`). Estimate: bits, 4-bit type, double quantisation, block size, skipped
modules.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import KnobHooks, register

QUANTISED_LINEARS = ("Linear4bit", "Linear8bitLt")


def count_quantised_layers(model: Any) -> dict[str, int]:
    """``{class name: count}`` of the bitsandbytes linear layers of ``model``."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        name = type(mod).__name__
        if name in QUANTISED_LINEARS:
            counts[name] = counts.get(name, 0) + 1
    return counts


def keep_trainable_4bit_layout(model: Any) -> int:
    """Stop bitsandbytes repacking 4-bit weights for CPU inference; returns how many layers it turned off.

    bitsandbytes 0.50 ``Linear4bit.forward``: on a CPU with AVX512-BF16 (``support_avx512bf16_for_cpu``,
    set from ``has_avx512bf16()`` at construction), the first forward in eval mode whose input needs no
    gradient (every eval, and layer 0 of any eval-mode forward) converts the weight in place to a
    CPU-packed layout (``_convert_weight_packed_for_cpu``: tiled nibbles, absmax cast to bf16, double
    quantisation undone) and sets ``quant_state.packing_format_for_cpu``. From then on ``matmul_4bit``
    calls ``F.gemv_4bit`` directly, outside the ``MatMul4Bit`` autograd Function ("only set for
    inference"), so no input gradient flows through the frozen 4-bit weight: every LoRA layer below it
    trains on truncated gradients (tiny model: relative difference 0.97 over all LoRA grads) while torch
    warns "an autograd kernel was not registered". Undoing the conversion when training resumes is no
    fix: the inverse is lossy (bf16 absmax, double quantisation redone), so the base would change under
    the adapter, and eval would score a slightly different function from the one trained. Every model
    :func:`vramsweep.knobs.build_model` builds is trained, so the conversion is turned off at build:
    eval and training run the same dequantise-then-matmul path. On CUDA the flag is never consulted
    (the conversion is CPU-only), so this changes nothing there. ``vramsweep generate`` loads through
    ``from_pretrained`` and keeps bitsandbytes' fast CPU inference path.
    """
    n = 0
    for mod in model.modules():
        if getattr(mod, "support_avx512bf16_for_cpu", False):
            mod.support_avx512bf16_for_cpu = False
            n += 1
    return n


def _build(cfg: Any, b: Any) -> dict[str, Any]:
    keep_trainable_4bit_layout(b.model)
    return {"quantised_layers": count_quantised_layers(b.model)}


def _load(cfg: Any, b: Any) -> dict[str, Any]:
    from vramsweep.knobs.common import bnb_config

    qconf = bnb_config(cfg)
    if qconf is not None and b.path is not None:
        b.load_kwargs["quantization_config"] = qconf
    return {}


def _estimate(cfg: Any, e: Any) -> dict[str, Any]:
    q = cfg.quant
    return {
        "quant_bits": int(q.bits),
        "quant_type": q.quant_type,
        "double_quant": bool(q.double_quant),
        "blocksize": int(q.blocksize),
        "skip": frozenset(str(x) for x in q.skip_modules),
    }


register(
    KnobHooks(
        name="quant",
        load=_load,
        # counted before the adapter: PEFT's LoRA wrappers of these layers carry the same class names
        build=_build,
        estimate=_estimate,
        groups=("quant",),
        notes_in="build",
    )
)
