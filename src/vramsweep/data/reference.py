"""The eval reference: the one rendering every trial of a sweep scores its held-out records under.

A trial's ``eval_loss`` compares with another's only over the same held-out tokens. So the held-out records
are rendered and masked under one reference, whatever the trial trains on: the format's default
``data.train_on`` (:func:`vramsweep.data.render.default_train_on`) and the sweep baseline's
:data:`REFERENCE_KEYS` (chat template, thinking switch, context length). The sweeper computes the baseline's
values once (:func:`reference_of` over the sweep's fixed config and ``sweep.baseline``) and records them in
``<sweep dir>/sweep.json`` as ``eval_reference``; a trial of that sweep reads them there
(:func:`sweep_reference`; ``VRAMSWEEP_SWEEP_DIR`` names the folder). A run outside a sweep is its own
reference.

A trial whose context is shorter than the longest held-out example under the reference cannot score it:
its held-out records are rendered at its own ``context.max_tokens`` instead, and its ``meta.eval_set`` says
``comparable: false`` with the reason (``report`` and ``pick`` leave it out of their held-out rankings).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Config keys whose baseline value the held-out records are rendered under (``data.train_on`` is the
#: format's default, not the baseline's).
REFERENCE_KEYS = ("data.chat_template", "data.enable_thinking", "context.max_tokens")
#: The sweep folder of a sweep trial process (set by the sweeper for every trial).
SWEEP_DIR_ENV = "VRAMSWEEP_SWEEP_DIR"
#: The key of ``sweep.json`` that holds the reference.
SWEEP_JSON_KEY = "eval_reference"


def _select(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else None
    return node


def _typed(key: str, value: Any) -> Any:
    if key == "context.max_tokens":
        return int(value)
    if key == "data.enable_thinking":
        return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")
    return None if value in (None, "", "null", "None") else str(value)


def reference_of(cfg: Any, baseline: Iterable[str] = ()) -> dict[str, Any]:
    """``{key: value}`` of :data:`REFERENCE_KEYS` in ``cfg`` (a composed config or a nested dict), each
    replaced by its value in the ``baseline`` overrides (``key=value`` text) where they set it."""
    out = {k: _typed(k, _select(cfg, k)) for k in REFERENCE_KEYS}
    for ov in baseline:
        key, sep, value = str(ov).lstrip("+").partition("=")
        if sep and key in out:
            out[key] = _typed(key, value.strip().strip("'\""))
    return out


def sweep_reference(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The reference of the sweep this process is a trial of (``sweep.json``'s ``eval_reference``), None
    outside a sweep folder or when the sweep recorded none."""
    folder = (environ if environ is not None else os.environ).get(SWEEP_DIR_ENV)
    if not folder:
        return None
    try:
        with open(Path(folder) / "sweep.json", encoding="utf-8") as fh:
            ref = json.load(fh).get(SWEEP_JSON_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(ref, dict) or any(k not in ref for k in REFERENCE_KEYS):
        return None
    return {k: _typed(k, ref[k]) for k in REFERENCE_KEYS}


def not_comparable_reason(longest: int, max_tokens: int, ref_max_tokens: int) -> str | None:
    """Why a trial with context ``max_tokens`` cannot score the reference's held-out examples (the longest
    is ``longest`` tokens at the reference's ``ref_max_tokens``), None when it can."""
    if longest <= max_tokens:
        return None
    return (
        f"context.max_tokens={max_tokens} is shorter than the reference's held-out examples (up to {longest} "
        f"tokens at the sweep baseline's context.max_tokens={ref_max_tokens})"
    )
