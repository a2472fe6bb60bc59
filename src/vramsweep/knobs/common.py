"""What every model source shares, below ``build.model`` (so arch/arch_weights/kernels never import it back):
the torch dtype of ``train.dtype`` and transformers' bitsandbytes config for ``cfg.quant``."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

DTYPE_MAP = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPE_MAP[name]


def bnb_config(cfg: DictConfig):
    """``BitsAndBytesConfig`` for ``cfg.quant`` (None for 16-bit)."""
    q = cfg.quant
    if q.bits == 16:
        return None
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(q.skip_modules))
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=bool(q.double_quant),
        bnb_4bit_compute_dtype=torch_dtype(q.compute_dtype),
        llm_int8_skip_modules=list(q.skip_modules),
    )
