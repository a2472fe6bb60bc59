"""Model dimensions for the estimator: from the model config group, or ``<model.path>/config.json``.

Nothing is downloaded and no weights are read: ``model.source=embedded|arch`` carry their dims in the
config group; ``model.source=path`` reads the Hugging Face ``config.json`` of the local folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from vramsweep.config.compose import ConfigError
from vramsweep.config.weights import SIZE_KEYS
from vramsweep.hfmodel import group_sizes

#: Projection names of one decoder layer (Llama/Qwen3 naming), in forward order.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelDims:
    """Shapes of a Llama/Qwen-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head (head_dim weights each)
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    family: str = "qwen3"

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` for the seven projections of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def with_vocab(self, vocab_size: int) -> ModelDims:
        from dataclasses import replace

        return replace(self, vocab_size=int(vocab_size))


def _from_hf_json(d: dict[str, Any]) -> ModelDims:
    if "text_config" in d and isinstance(d["text_config"], dict):  # multimodal wrappers
        inner = dict(d["text_config"])
        inner.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        d = inner
    model_type = str(d.get("model_type", "llama"))
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    head_dim = d.get("head_dim") or hidden // heads
    optional = ("num_kv_heads", "head_dim")
    sizes = {name: int(d[hf]) for name, hf in SIZE_KEYS.items() if name not in optional}
    return ModelDims(
        **sizes,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        family=model_type,
    )


def model_dims(cfg: DictConfig) -> ModelDims:
    """Dims of ``cfg.model``; ``model.source=path`` reads ``<path>/config.json``."""
    m = cfg.model
    if m.source == "path":
        path = Path(str(m.path)) / "config.json"
        with open(path) as fh:
            return _from_hf_json(json.load(fh))
    return ModelDims(
        **group_sizes(m),
        tie_word_embeddings=bool(m.tie_word_embeddings),
        qk_norm=str(m.family) == "qwen3",
        attention_bias=False,
        family=str(m.family),
    )


#: ``config.json`` fields that are sizes: a positive integer each (the bounds of the ``model.*`` rules).
DIM_FIELDS = tuple(SIZE_KEYS.values())
MAX_DIM = 10**7


def _check_dims(data: dict[str, Any], cfg_file: Path, key: str) -> None:
    """Every size in a ``config.json`` is a whole number in ``[1, MAX_DIM]`` and the heads divide evenly:
    the same checks as the ``model.*`` values of the other sources (a zero or negative size would give an
    estimate with negative bytes and a model that cannot be built)."""

    inner = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    where = f"{key}: {cfg_file}" + (": text_config" if inner is not data else "")
    for name in DIM_FIELDS:
        if name not in inner or (inner[name] is None and name in ("num_key_value_heads", "head_dim")):
            continue  # a missing required size is named by the loader below
        v = inner[name]
        whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not whole:
            raise ConfigError(
                f"{where}: bad dimension value {name}={v!r} (must be a whole number)",
                key=key,
                allowed=[f"{name} in 1..{MAX_DIM}"],
            )
        if not 1 <= v <= MAX_DIM:
            raise ConfigError(
                f"{where}: {name}={v!r} is out of range [1, {MAX_DIM}]",
                key=key,
                allowed=[f"{name} in 1..{MAX_DIM}"],
            )
    heads, kv = inner.get("num_attention_heads"), inner.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(
            f"{where}: num_key_value_heads={kv} must divide num_attention_heads={heads}",
            key=key,
            allowed=[f"num_key_value_heads in {[d for d in range(1, heads + 1) if heads % d == 0][:12]}"],
        )


def check_model_config(path: str | os.PathLike, *, key: str = "model.path") -> None:
    """Raise unless ``<path>/config.json`` is readable JSON with the model's dimensions."""

    cfg_file = Path(str(path)) / "config.json"
    try:
        text = cfg_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        raise ConfigError(f"{key}: cannot read {cfg_file}: {why}", key=key) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{key}: {cfg_file}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})", key=key
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{key}: {cfg_file}: expected a JSON object, got {type(data).__name__}", key=key
        ) from None
    _check_dims(data, cfg_file, key)
    try:
        _from_hf_json(data)
    except KeyError as exc:
        raise ConfigError(
            f"{key}: {cfg_file}: missing {exc.args[0]!r} (a Hugging Face model config needs "
            "hidden_size, num_attention_heads, num_hidden_layers, intermediate_size, vocab_size)",
            key=key,
        ) from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"{key}: {cfg_file}: bad dimension value ({exc})", key=key) from None
