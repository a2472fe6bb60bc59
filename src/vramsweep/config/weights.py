"""Weights from a folder for a named architecture: ``model=qwen3_8b model.path=/models/Qwen3-8B``.

A named architecture (``model.source=arch``) builds random weights unless ``model.path`` names a Hugging Face
folder; then that folder is loaded, after its ``config.json`` is checked against the architecture's dims (a
mismatch is a :class:`~vramsweep.config.compose.ConfigError` naming the keys). Without a path the run says
once that the weights are random.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError

#: model.<size> -> config.json key: the one table of the model group's sizes and their transformers names,
#: read both ways (``hfmodel.hf_config`` writes a config from them, ``estimate/dims.py`` reads one)
SIZE_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}
#: model.<key> -> config.json key: what a weights folder must match
ARCH_KEYS = {**SIZE_KEYS, "tie_word_embeddings": "tie_word_embeddings", "family": "model_type"}
_said_random = False


def arch_path(mcfg: Any) -> Path | None:
    """``model.path`` of a named architecture, checked against its dims; None when there is none."""
    if str(mcfg.source) != "arch" or not mcfg.get("path"):
        return None
    path = Path(str(mcfg.path))
    check_arch_matches(mcfg, path)
    return path


def check_arch_matches(mcfg: Any, path: Path) -> None:
    """Refuse a weights folder whose config.json is not the architecture ``model=<name>`` declares."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"model.path={path}: no config.json there (a Hugging Face model folder is needed)",
            key="model.path",
            allowed=["a local folder with config.json and weights"],
        )
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.path={path}: config.json does not parse ({exc})", key="model.path"
        ) from None
    hf.setdefault("head_dim", hf.get("hidden_size", 0) // max(int(hf.get("num_attention_heads", 1) or 1), 1))
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    hf.setdefault("tie_word_embeddings", False)
    diff = []
    for ours, theirs in ARCH_KEYS.items():
        want = mcfg.get(ours)
        have = hf.get(theirs)
        if ours == "family":
            same = str(have or "").startswith(str(want))
        else:
            same = have is not None and type(want)(have) == want
        if not same:
            diff.append(f"model.{ours}={want} vs {theirs}={have}")
    if diff:
        raise ConfigError(
            f"model.path={path} is not model={mcfg.name}: "
            + ", ".join(diff)
            + " (use model=local for any folder, or the model option of this architecture)",
            key="model.path",
            allowed=[f"a folder holding {mcfg.name}'s architecture", "model=local model.path=<folder>"],
        )


def say_random_weights(mcfg: Any) -> None:
    """Once per process: a named architecture without ``model.path`` trains random weights."""
    global _said_random
    if _said_random or str(mcfg.source) != "arch" or mcfg.get("path"):
        return
    _said_random = True
    print(
        f"vramsweep: note: model={mcfg.name} has no model.path: its weights are random (memory and speed are "
        "real, eval losses are not); set model.path=<Hugging Face folder> to fine-tune the real model",
        file=sys.stderr,
    )


def random_weights(config: dict) -> bool:
    """A trial's composed config trained random weights (a named architecture without ``model.path``)."""
    model = (config or {}).get("model") or {}
    return model.get("source") == "arch" and not model.get("path")
