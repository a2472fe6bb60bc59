"""``quant``: bitsandbytes quantisation of the base weights, as a provider (:mod:`vramsweep.knobs.registry`).

Load: a ``BitsAndBytesConfig`` (:func:`vramsweep.knobs.common.bnb_config`) passed to ``from_pretrained``
-> ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` layers (lm_head and embeddings stay in the compute dtype;
``source=arch`` quantises in place, :mod:`vramsweep.knobs.arch`). Build: the quantised layers counted
(``meta.build.quantised_layers``). Estimate: bits, 4-bit type, double quantisation, block size, skipped
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
        build=lambda cfg, b: {"quantised_layers": count_quantised_layers(b.model)},
        estimate=_estimate,
        groups=("quant",),
        notes_in="build",
    )
)
