"""Fused-kernel dispatch: Liger (Triton patches) or Unsloth (its own loader). Never both (rules.py).

Both need CUDA for their kernels (Unsloth can train on CPU with its fallbacks); the rules module marks
them ``unsupported`` where they cannot run, so these functions are only reached on a capable machine.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

LIGER_PATCHES = {
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
}


def liger_patch_name(cfg: DictConfig) -> str:
    """Name of the ``liger_kernel.transformers`` function for the model family."""
    family = cfg.model.family
    if cfg.model.source == "path":
        import json
        from pathlib import Path

        mtype = json.loads((Path(str(cfg.model.path)) / "config.json").read_text()).get("model_type", "")
        family = "qwen3" if mtype.startswith("qwen3") else "llama" if mtype.startswith("llama") else mtype
    if family not in LIGER_PATCHES:
        from vramsweep.config.rules import UnsupportedError

        raise UnsupportedError(
            f"kernels=liger has no patch for model family {family!r}",
            key="kernels",
            allowed=sorted(LIGER_PATCHES),
        )
    return LIGER_PATCHES[family]


def liger_kwargs(cfg: DictConfig) -> dict[str, bool]:
    k = cfg.kernels
    return {
        "rope": bool(k.liger_rope),
        "rms_norm": bool(k.liger_rms_norm),
        "swiglu": bool(k.liger_swiglu),
        "cross_entropy": False,
        "fused_linear_cross_entropy": bool(k.liger_fused_linear_cross_entropy),
    }


def apply_liger(cfg: DictConfig) -> str:
    """Patch the transformers modeling classes before the model is instantiated."""
    import liger_kernel.transformers as lk

    name = liger_patch_name(cfg)
    getattr(lk, name)(**liger_kwargs(cfg))
    return f"liger_kernel.transformers.{name}({', '.join(f'{k}={v}' for k, v in liger_kwargs(cfg).items())})"


def apply_liger_to_instance(cfg: DictConfig, model: Any) -> str:
    """Class patches cover new instances; nothing more to do per instance (kept for the record)."""
    return "class-level patch"


def unsloth_kwargs(cfg: DictConfig) -> tuple[dict, dict]:
    """Translate our knobs into ``FastLanguageModel.from_pretrained`` and ``get_peft_model`` kwargs."""
    from vramsweep.build.model import torch_dtype

    q, a = cfg.quant, cfg.adapter
    load = {
        "max_seq_length": int(cfg.context.max_tokens),
        "dtype": torch_dtype(cfg.train.dtype),
        "load_in_4bit": q.bits == 4,
        "load_in_8bit": q.bits == 8,
        "full_finetuning": a.method == "full",
        "attn_implementation": cfg.attention.implementation,
    }
    targets = (
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if isinstance(a.targets, str) and a.targets == "all-linear"
        else list(a.targets)
    )
    peft = {
        "r": int(a.r),
        "lora_alpha": float(a.alpha),
        "lora_dropout": float(a.dropout),
        "target_modules": targets,
        "use_rslora": bool(a.use_rslora),
        "use_gradient_checkpointing": "unsloth" if cfg.checkpointing.enabled else False,
        "random_state": int(cfg.train.seed),
    }
    return load, peft


def load_with_unsloth(cfg: DictConfig, path) -> tuple[Any, Any]:
    """Load through ``unsloth.FastLanguageModel`` with our quant/adapter/checkpointing knobs."""
    if path is None:
        from vramsweep.config.rules import UnsupportedError

        raise UnsupportedError(
            "kernels=unsloth needs weights on disk (model=tiny or model.path)",
            key="kernels",
            allowed=["none", "liger"],
        )
    if cfg.quant.bits == 4 and cfg.quant.quant_type != "nf4":
        from vramsweep.config.rules import UnsupportedError

        raise UnsupportedError(
            "kernels=unsloth quantises with NF4 only", key="quant", allowed=["nf4", "nf4_dq", "none"]
        )
    from unsloth import FastLanguageModel

    load, peft = unsloth_kwargs(cfg)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(path), **load)
    if cfg.adapter.method == "lora":
        model = FastLanguageModel.get_peft_model(model, **peft)
    return model, tokenizer
