"""What the ``rope`` knob does to the model's positions, as numbers (torch-free: the rules and the estimator
use it; :mod:`vramsweep.knobs.rope` applies it to the transformers config at build).

* ``rope=none``: the model's own positions (``model.max_position_embeddings``, or ``<model.path>/config.json``
  including any rope scaling that file already carries).
* ``rope=yarn|linear|dynamic``: positions = ``original_max_position_embeddings`` x ``factor``; the original
  length defaults to the model's positions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ROPE_TYPES = ("none", "yarn", "linear", "dynamic")


def path_rope(model_path: str) -> tuple[int | None, dict[str, Any] | None]:
    """``(max_position_embeddings, rope scaling dict or None)`` from a local ``config.json``.

    The scaling dict is ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x) when its type is not
    ``default``. ``(None, None)`` when the file cannot be read (the loader names the problem later).
    """
    try:
        with open(Path(model_path) / "config.json") as fh:
            raw = json.load(fh)
        text = raw.get("text_config") or raw
        pos = text.get("max_position_embeddings")
        pos = int(pos) if pos else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None, None
    for key in (
        "rope_scaling",
        "rope_parameters",
    ):  # transformers 5 takes rope_scaling first when both are set
        scaling = text.get(key)
        if isinstance(scaling, dict) and scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            return pos, (dict(scaling) if kind not in (None, "default") else None)
    return pos, None


def _scaled_positions(pos: int | None, scaling: dict[str, Any]) -> int | None:
    """Positions a config.json's own rope scaling reaches: max(positions, original x factor)."""
    factor = scaling.get("factor")
    orig = scaling.get("original_max_position_embeddings") or pos
    if not factor or not orig:
        return pos
    return max(int(pos or 0), int(float(orig) * float(factor)))


def plan(cfg: Any) -> dict[str, Any]:
    """The rope knob as numbers for a composed config.

    Returns ``{"type", "factor", "native_positions" (the model's own), "original_max_position_embeddings",
    "positions" (what context.max_tokens may reach), "max_position_embeddings" (what the built config gets),
    "existing" (rope scaling already in a local config.json, or None)}``. ``native_positions`` is None for a
    ``model.path`` whose config.json cannot be read.
    """
    r = cfg.get("rope") if hasattr(cfg, "get") else None
    kind = str(r.type) if r is not None else "none"
    factor = float(r.factor) if r is not None else 1.0
    existing = None
    if str(cfg.model.source) == "path":
        native, existing = path_rope(str(cfg.model.path))
    else:
        native = int(cfg.model.max_position_embeddings)
    if kind == "none":
        positions = _scaled_positions(native, existing) if existing else native
        return {
            "type": "none",
            "factor": 1.0,
            "native_positions": native,
            "original_max_position_embeddings": native,
            "positions": positions,
            "max_position_embeddings": native,
            "existing": existing,
        }
    orig = r.get("original_max_position_embeddings") if r is not None else None
    orig = int(orig) if orig is not None else native
    positions = int(orig * factor) if orig is not None else None
    # dynamic NTK reads config.max_position_embeddings as the original length; yarn/linear get the extended
    # one (transformers checks yarn's factor against max_position_embeddings / original)
    max_pos = orig if kind == "dynamic" else positions
    return {
        "type": kind,
        "factor": factor,
        "native_positions": native,
        "original_max_position_embeddings": orig,
        "positions": positions,
        "max_position_embeddings": max_pos,
        "existing": existing,
    }


#: Lengths a model family's documented RoPE-scaling recipe scales from, where it is below the positions its
#: config.json declares: Qwen3's model cards give YaRN over ``original_max_position_embeddings=32768``
#: although config.json says 40,960 (32,768 of context + 8,192 of output). Keyed by (family, positions),
#: kept in code and not as a ``model.*`` key: those key the embedded model's and the architectures' weights.
DOCUMENTED_ROPE_BASE = {("qwen3", 40960): 32768}


def documented_base(family: str, positions: int) -> int:
    """The length a needed RoPE scaling should scale from: the family's documented one, else ``positions``."""
    return DOCUMENTED_ROPE_BASE.get((str(family), int(positions)), int(positions))


def needed_factor(max_tokens: int, original: int) -> int:
    """Smallest whole ``rope.factor`` with original x factor >= max_tokens."""
    return max(2, math.ceil(int(max_tokens) / int(original)))
