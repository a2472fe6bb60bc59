"""The two things every model source needs, below ``knobs/`` and ``embedded`` (no import cycle):
the local artefact cache and a transformers config from the ``model`` group's dims (through
``config.weights.SIZE_KEYS``, the table of size names that ``estimate.dims`` reads too)."""

from __future__ import annotations

from omegaconf import DictConfig

from vramsweep.config.weights import SIZE_KEYS
from vramsweep.data.cache import CACHE_ENV, cache_path, cache_root  # noqa: F401 - re-exported


def group_sizes(mcfg: DictConfig) -> dict[str, int]:
    """The model group's sizes (the keys of ``config.weights.SIZE_KEYS``) as integers."""
    return {name: int(getattr(mcfg, name)) for name in SIZE_KEYS}


def hf_config(mcfg: DictConfig):
    """A transformers config from the model group's dims (source=embedded|arch)."""
    common = dict(
        **{SIZE_KEYS[name]: v for name, v in group_sizes(mcfg).items()},
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
