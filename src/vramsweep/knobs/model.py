"""``model``: the model loaded from its source, as a provider (:mod:`vramsweep.knobs.registry`); the
pipeline that runs the providers, :func:`vramsweep.knobs.build.build_model`, finds that source
(:func:`vramsweep.knobs.build.model_source`).

The last hook of the load stage: ``from_pretrained`` on the weights folder (embedded model,
``model.path``) with the keywords the earlier providers set (``quantization_config``,
``attn_implementation``, a rope-scaled ``config``), placed on the device; or, for an architecture-only
model (``source=arch``, no weights folder), a meta skeleton initialised at random and quantised in place
on the device (:func:`vramsweep.knobs.arch.build_arch_model`, ``meta.build.arch_build``). A loader that
replaces this one (``kernels=unsloth``) runs earlier in the stage and ends it. The estimator takes the
model's dims (:func:`vramsweep.estimate.dims.model_dims`) as its input, so this provider has no estimate
hook.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import KnobHooks, register


def _load(cfg: Any, b: Any) -> dict[str, Any]:
    notes: dict[str, Any] = {}
    if b.path is None:  # source=arch: meta skeleton -> random init + quantisation in place on the device
        from vramsweep.knobs.arch import build_arch_model

        b.model, notes["arch_build"] = build_arch_model(cfg, b.device)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        kw = dict(dtype=b.dtype, **b.load_kwargs)
        if b.device.type == "cuda":
            kw["device_map"] = {"": torch.cuda.current_device()}
        b.model = AutoModelForCausalLM.from_pretrained(str(b.path), **kw)
        if b.device.type == "cuda" and "quantization_config" not in kw:
            b.model.to(b.device)
    b.model.config.use_cache = False
    return notes


register(KnobHooks(name="model", load=_load, groups=("model",), notes_in="build"))
