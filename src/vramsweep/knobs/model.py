"""Build the trial model: source -> quantisation -> attention -> kernels -> vocab -> checkpointing -> adapter.

Every knob changes what is built (and :attr:`Built.notes` records what was applied):

* ``quant``: a ``BitsAndBytesConfig`` passed to ``from_pretrained`` -> ``bnb.nn.Linear4bit`` /
  ``Linear8bitLt`` layers (lm_head and embeddings stay in the compute dtype).
* ``attention``: ``attn_implementation``.
* ``rope``: ``rope_parameters`` on the config the model is built from (``knobs/rope.py``).
* ``kernels``: Liger patches before loading, or Unsloth's ``FastLanguageModel`` (see ``kernels.py``).
* ``checkpointing``: ``gradient_checkpointing_enable`` (non-reentrant by default).
* ``adapter``: PEFT ``LoraConfig`` (``use_rslora``, ``use_dora``) or every weight trainable (full).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from vramsweep.hfmodel import cache_root, hf_config  # noqa: F401 - re-exported (build.model.hf_config)
from vramsweep.knobs.common import DTYPE_MAP, bnb_config, torch_dtype  # noqa: F401 - re-exported


@dataclass
class Built:
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    notes: dict = field(default_factory=dict)
    id_map: Any = None  # vocab slicing IdMap when vocab.mode != full


def model_source(cfg: DictConfig) -> tuple[Path | None, Any]:
    """(weights dir, tokenizer) for the configured source; the embedded model is built/cached on demand."""
    src = cfg.model.source
    if src == "embedded":
        from vramsweep.embedded import ensure_embedded

        path = ensure_embedded(cfg.model)
    elif src == "path":
        path = Path(str(cfg.model.path))
    else:
        path = None
    tokenizer = None
    if path is not None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return path, tokenizer


def logical_numel(p: torch.Tensor) -> int:
    """Weights a parameter stands for: a packed 4-bit ``Params4bit`` holds two per uint8 element."""
    if type(p).__name__ == "Params4bit":
        return int(p.numel() * p.element_size() * 2)  # 4 bits per weight in quant_storage elements
    return int(p.numel())


def count_quantised_layers(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for mod in model.modules():
        name = type(mod).__name__
        if name in ("Linear4bit", "Linear8bitLt"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def build_model(
    cfg: DictConfig, *, keep_ids: list[int] | None = None, source: tuple[Path | None, Any] | None = None
) -> Built:
    """Build the model for one trial. ``keep_ids``: vocabulary rows to keep when ``vocab`` slices;
    ``source``: :func:`model_source`'s (weights dir, tokenizer) when the caller has it already (the
    tokenizer is then loaded once per trial)."""
    from vramsweep.knobs import kernels

    device = torch.device("cuda" if cfg.hardware.device == "cuda" else "cpu")
    dtype = torch_dtype(cfg.train.dtype)
    notes: dict[str, Any] = {"device": str(device), "dtype": cfg.train.dtype}
    path, tokenizer = source if source is not None else model_source(cfg)

    if cfg.kernels.unsloth:
        if path is None and cfg.model.source == "arch":  # Unsloth loads from disk: random weights, cached
            from vramsweep.knobs.arch_weights import ensure_arch_weights

            path, notes["arch_weights"] = ensure_arch_weights(cfg)
        model, tok = kernels.load_with_unsloth(cfg, path)
        notes["kernels"] = "unsloth.FastLanguageModel"
        notes["unsloth"] = kernels.unsloth_notes(cfg)
        notes["trainable_params"] = int(sum(logical_numel(p) for p in model.parameters() if p.requires_grad))
        notes["total_params"] = int(sum(logical_numel(p) for p in model.parameters()))
        notes["quantised_layers"] = count_quantised_layers(model)
        return Built(model=model, tokenizer=tok or tokenizer, device=device, notes=notes)

    if cfg.kernels.liger:
        notes["kernels"] = kernels.apply_liger(cfg)
    else:
        notes["kernels"] = "none"

    from transformers import AutoModelForCausalLM

    load_kw: dict[str, Any] = dict(dtype=dtype, attn_implementation=cfg.attention.implementation)
    qconf = bnb_config(cfg)
    if path is None:  # source=arch: meta skeleton -> random init + quantisation in place on the device
        from vramsweep.knobs.arch import build_arch_model

        model, notes["arch_build"] = build_arch_model(cfg, device)
    else:
        if qconf is not None:
            load_kw["quantization_config"] = qconf
        if device.type == "cuda":
            load_kw["device_map"] = {"": torch.cuda.current_device()}
        if cfg.get("rope") is not None and cfg.rope.type != "none":
            # rope scaling: the checkpoint's config with rope_parameters set
            from transformers import AutoConfig

            from vramsweep.knobs.rope import apply_rope

            load_kw["config"] = AutoConfig.from_pretrained(str(path))
            apply_rope(load_kw["config"], cfg)
        model = AutoModelForCausalLM.from_pretrained(str(path), **load_kw)
    if device.type == "cuda" and qconf is None and path is not None:
        model.to(device)
    model.config.use_cache = False
    notes["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    from vramsweep.knobs.rope import built_notes as rope_built_notes

    notes["rope"] = rope_built_notes(model, cfg)
    notes["quantised_layers"] = count_quantised_layers(model)

    id_map = None
    if cfg.vocab.mode != "full":
        from vramsweep.knobs.vocab import slice_model_and_tokenizer

        if keep_ids is None:
            raise ValueError("vocab slicing needs keep_ids from the training corpus")
        old_v = model.get_input_embeddings().weight.shape[0]
        model, tokenizer, id_map = slice_model_and_tokenizer(model, tokenizer, keep_ids)
        notes["vocab"] = {"original": int(old_v), "kept": int(model.get_input_embeddings().weight.shape[0])}

    if cfg.checkpointing.enabled:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": bool(cfg.checkpointing.use_reentrant)}
        )
        if cfg.checkpointing.use_reentrant:
            model.enable_input_require_grads()
        notes["gradient_checkpointing"] = True
    else:
        notes["gradient_checkpointing"] = False

    a = cfg.adapter
    if a.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = a.targets if isinstance(a.targets, str) else list(a.targets)
        lcfg = LoraConfig(
            r=int(a.r),
            lora_alpha=float(a.alpha),
            lora_dropout=float(a.dropout),
            target_modules=targets,
            use_rslora=bool(a.use_rslora),
            use_dora=bool(a.use_dora),
            task_type="CAUSAL_LM",
        )
        # adapter.dtype=compute: adapters in the compute dtype, so PEFT keeps no fp32 copy of each adapted
        # projection's input for backward (autocast_adapter_dtype=True upcasts adapters to fp32)
        fp32_adapters = str(a.get("dtype", "fp32")) == "fp32"
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=fp32_adapters)
        if not fp32_adapters:
            for n, p in model.named_parameters():
                if p.requires_grad and "lora_" in n:
                    p.data = p.data.to(dtype)
        if device.type == "cuda":
            model.to(device)
        notes["adapter"] = {
            "type": "lora",
            "rslora": bool(a.use_rslora),
            "dora": bool(a.use_dora),
            "dtype": "float32" if fp32_adapters else str(dtype).replace("torch.", ""),
        }
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        notes["adapter"] = {"type": "full"}
    if cfg.kernels.liger:
        notes["kernels_instance"] = kernels.apply_liger_to_instance(cfg, model)
    from vramsweep.knobs import registry

    notes["knobs"] = registry.apply_build(cfg, model, device)  # each active knob's build hook
    trainable = sum(logical_numel(p) for p in model.parameters() if p.requires_grad)
    notes["trainable_params"] = int(trainable)
    notes["total_params"] = int(sum(logical_numel(p) for p in model.parameters()))  # 4-bit counted unpacked
    return Built(model=model, tokenizer=tokenizer, device=device, notes=notes, id_map=id_map)
