"""``checkpointing``: activation checkpointing, as a provider (:mod:`vramsweep.knobs.registry`).

Build: ``gradient_checkpointing_enable`` (non-reentrant by default; the reentrant variant needs inputs that
require grad), recorded as ``meta.build.gradient_checkpointing``. ``checkpointing=offload`` adds the
``offload`` knob on top (:mod:`vramsweep.knobs.offload_tiling`). Estimate: ``Knobs.checkpointing``.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import KnobHooks, register


def _build(cfg: Any, b: Any) -> dict[str, Any]:
    c = cfg.checkpointing
    if not c.enabled:
        return {"gradient_checkpointing": False}
    b.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": bool(c.use_reentrant)}
    )
    if c.use_reentrant:
        b.model.enable_input_require_grads()
    return {"gradient_checkpointing": True}


register(
    KnobHooks(
        name="checkpointing",
        build=_build,
        estimate=lambda cfg, e: {"checkpointing": bool(cfg.checkpointing.enabled)},
        groups=("checkpointing",),
        notes_in="build",
    )
)
