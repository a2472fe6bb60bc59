"""Build the trial model: a short pipeline over the providers (:mod:`vramsweep.knobs.registry`).

Every config group that changes what is built registers its hooks beside its code, and :func:`build_model`
runs them stage by stage (:attr:`Built.notes` records what each applied, ``meta.build``):

* patch: ``kernels`` (Liger's class patches, before any model class is instantiated);
* load: ``attention`` (``attn_implementation``), ``rope`` (``rope_parameters`` on the config,
  ``knobs/rope.py``), ``quant`` (a ``BitsAndBytesConfig``), ``kernels`` (Unsloth's ``FastLanguageModel``,
  which builds the whole trial model and ends the pipeline), ``model`` (``from_pretrained`` or the
  ``source=arch`` skeleton);
* build: read-back notes (``attn_implementation``, ``rope``, ``quantised_layers``), ``vocab`` (slicing),
  ``checkpointing``, ``adapter`` (PEFT LoRA / RS-LoRA / DoRA, or full), ``kernels`` (Liger's instance check),
  then the knobs on the finished model (``offload``, ``mlp_tiles``, ``loss_chunks``: ``meta.build.knobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from vramsweep.config.model_folder import check_tokenizer
from vramsweep.config.weights import arch_path, say_random_weights
from vramsweep.embedded import ensure_embedded
from vramsweep.hfmodel import cache_root, hf_config  # noqa: F401 - re-exported (knobs.build.hf_config)
from vramsweep.knobs import registry
from vramsweep.knobs.common import DTYPE_MAP, bnb_config, torch_dtype  # noqa: F401 - re-exported
from vramsweep.knobs.quant import count_quantised_layers  # noqa: F401 - re-exported


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
        path = ensure_embedded(cfg.model)
    elif src == "path":
        path = Path(str(cfg.model.path))
    else:  # a named architecture: its weights from model.path (checked), else random
        path = arch_path(cfg.model)
        say_random_weights(cfg.model)
    if path is not None and src != "embedded":  # the pre-flight's check, again where the trial needs it
        check_tokenizer(path, data_source=str(cfg.data.source))
    tokenizer = None
    if path is not None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from vramsweep.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path, embedded=src == "embedded")
    return path, tokenizer


def logical_numel(p: torch.Tensor) -> int:
    """Weights a parameter stands for: a packed 4-bit ``Params4bit`` holds two per uint8 element."""
    if type(p).__name__ == "Params4bit":
        return int(p.numel() * p.element_size() * 2)  # 4 bits per weight in quant_storage elements
    return int(p.numel())


def build_model(
    cfg: DictConfig,
    *,
    keep_ids: list[int] | None = None,
    source: tuple[Path | None, Any] | None = None,
    corpus: list | None = None,
) -> Built:
    """Build the model for one trial. ``keep_ids``: vocabulary rows to keep when ``vocab`` slices (else
    chosen from ``corpus``, the examples the model will see: every train and eval example as built);
    ``source``: :func:`model_source`'s (weights dir, tokenizer) when the caller has it already (the
    tokenizer is then loaded once per trial)."""
    device = torch.device("cuda" if cfg.hardware.device == "cuda" else "cpu")
    path, tokenizer = source if source is not None else model_source(cfg)
    b = registry.Build(
        cfg=cfg,
        device=device,
        dtype=torch_dtype(cfg.train.dtype),
        path=path,
        tokenizer=tokenizer,
        keep_ids=keep_ids,
        corpus=corpus,
        notes={"device": str(device), "dtype": cfg.train.dtype},
    )
    registry.run_build(cfg, b)  # patch -> load -> build, each active provider's hooks in order
    params = list(b.model.parameters())
    b.notes["trainable_params"] = int(sum(logical_numel(p) for p in params if p.requires_grad))
    b.notes["total_params"] = int(sum(logical_numel(p) for p in params))  # 4-bit counted unpacked
    return Built(model=b.model, tokenizer=b.tokenizer, device=device, notes=b.notes, id_map=b.id_map)
