"""``rope``: RoPE scaling applied to the transformers config before the model is built.

transformers 5 reads ``config.rope_parameters`` (``rope_type``, ``rope_theta``, ``factor``,
``original_max_position_embeddings``) when it creates the rotary embedding: its ``inv_freq`` and
``attention_scaling`` (YaRN's 0.1·ln(factor) + 1 on cos/sin) follow from them. :func:`apply_rope` sets them
the way ``RotaryEmbeddingConfigMixin.validate_rope`` checks them, and sets ``max_position_embeddings`` to the
extended length (yarn, linear) or keeps the original length (dynamic NTK, which reads it as the original).
The numbers come from :func:`vramsweep.config.rope.plan`, which the rules use too. The ``rope`` provider
(:mod:`vramsweep.knobs.registry`) hands the scaled config to ``from_pretrained`` and records
:func:`built_notes` (``meta.build.rope``).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from vramsweep.config.rope import plan
from vramsweep.knobs.registry import KnobHooks, register


def apply_rope(config: Any, cfg: DictConfig) -> dict[str, Any] | None:
    """Set ``cfg.rope`` on a transformers config in place; None for ``rope=none`` (config untouched)."""
    p = plan(cfg)
    if p["type"] == "none":
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.standardize_rope_params()
    old = dict(text.rope_parameters or {})
    params: dict[str, Any] = {"rope_type": p["type"], "rope_theta": old.get("rope_theta")}
    if params["rope_theta"] is None:
        params["rope_theta"] = getattr(text, "rope_theta", None) or text.default_theta
    if "partial_rotary_factor" in old:
        params["partial_rotary_factor"] = old["partial_rotary_factor"]
    params["factor"] = float(p["factor"])
    if p["type"] == "yarn":
        params["original_max_position_embeddings"] = int(p["original_max_position_embeddings"])
    text.rope_parameters = params
    text.max_position_embeddings = int(p["max_position_embeddings"])
    text.validate_rope()  # transformers' own check: a missing key raises
    return rope_notes(config)


def rope_notes(config: Any) -> dict[str, Any]:
    """What the built model's config says about RoPE (recorded in ``meta.build.rope``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = dict(getattr(text, "rope_parameters", None) or {})
    return {
        "rope_parameters": {k: v for k, v in params.items() if isinstance(v, int | float | str | bool)},
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 0),
    }


def built_notes(model: Any, cfg: DictConfig) -> dict[str, Any]:
    """``meta.build.rope``: the knob, the positions it allows, and the built model's rotary config and
    attention scaling (read back from the model, so a knob that did not reach the model shows here)."""
    p = plan(cfg)
    notes = {
        "knob": p["type"],
        "factor": p["factor"],
        "original_max_position_embeddings": p["original_max_position_embeddings"],
        "positions": p["positions"],
        **rope_notes(model.config),
    }
    for mod in model.modules():
        if hasattr(mod, "attention_scaling") and hasattr(mod, "inv_freq"):
            notes["attention_scaling"] = float(mod.attention_scaling)
            break
    return notes


# --- the rope provider (vramsweep.knobs.registry): the scaled config at load, read back after it


def _load(cfg: DictConfig, b: Any) -> dict[str, Any]:
    if b.path is not None and cfg.get("rope") is not None and cfg.rope.type != "none":
        from transformers import AutoConfig  # the checkpoint's config with rope_parameters set

        b.load_kwargs["config"] = AutoConfig.from_pretrained(str(b.path))
        apply_rope(b.load_kwargs["config"], cfg)
    return {}  # source=arch: the skeleton is built from a rope-scaled config (knobs/arch.py)


register(
    KnobHooks(
        name="rope",
        load=_load,
        build=lambda cfg, b: {"rope": built_notes(b.model, cfg)},
        groups=("rope",),
        notes_in="build",
    )
)
