"""``data.packing``: the packing provider (:mod:`vramsweep.knobs.registry`); the implementation is
:mod:`vramsweep.data.packing`.

Data (``data.packing=true``): the training examples, already in the ids the model reads, are packed once
into rows of at most ``context.max_tokens`` tokens (best-fit decreasing, seeded by ``train.seed``); the
batches pad every row to that width (``meta.data.packing``: rows, examples, padding). Evaluation stays
unpacked. The model side (per-document positions, the attention mask) is
:mod:`vramsweep.knobs.packed_attention`.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import Batching, KnobHooks, register


def _data(cfg: Any, d: Batching) -> dict[str, Any]:
    from vramsweep.data.packing import pack_examples, packing_stats  # imports torch (data.examples)

    width = int(cfg.context.max_tokens)
    d.train, d.width = pack_examples(d.train, width, int(cfg.train.seed)), width
    return packing_stats(d.train, width)


register(
    KnobHooks(
        name="packing",
        groups=("data",),
        active=lambda cfg: bool(cfg.data.get("packing", False)),
        data=_data,
    )
)
