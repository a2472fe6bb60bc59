"""The two things every model source needs, below ``knobs/`` and ``embedded`` (no import cycle):
the local artefact cache and a transformers config from the ``model`` group's dims."""

from __future__ import annotations

from omegaconf import DictConfig

from vramsweep.data.cache import CACHE_ENV, cache_path, cache_root  # noqa: F401 - re-exported


def hf_config(mcfg: DictConfig):
    """A transformers config from the model group's dims (source=embedded|arch)."""
    common = dict(
        vocab_size=int(mcfg.vocab_size),
        hidden_size=int(mcfg.hidden_size),
        intermediate_size=int(mcfg.intermediate_size),
        num_hidden_layers=int(mcfg.num_layers),
        num_attention_heads=int(mcfg.num_heads),
        num_key_value_heads=int(mcfg.num_kv_heads),
        head_dim=int(mcfg.head_dim),
        max_position_embeddings=int(mcfg.max_position_embeddings),
        tie_word_embeddings=bool(mcfg.tie_word_embeddings),
        rms_norm_eps=float(mcfg.rms_norm_eps),
        use_cache=False,
    )
    if mcfg.family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(rope_theta=float(mcfg.rope_theta), **common)
    from transformers import LlamaConfig

    return LlamaConfig(rope_theta=float(mcfg.rope_theta), **common)
