"""Which data each trial trained on (docs/RUNS.md "Changed data"): ``report`` and ``pick`` flag a sweep whose
trials trained on different data files (a sweep resumed after its file changed), and ``pick`` pins the hash
beside the path (``data.path_sha256``), so the production run refuses another file.

A trial's hashes come from ``meta.data_sources`` (``{key: {path, sha256}}``) or, in older results,
``meta.data.source_sha256`` (the ``data.path`` file's hash, or ``{"path": ..., "eval_path": ...}``).
Torch-free: reports import it.
"""

from __future__ import annotations

import os
from typing import Any

from vramsweep.production.fingerprint import KEYS, file_sha256, trial_hashes

__all__ = ["KEYS", "data_pins", "mixed_data_note", "trial_hashes"]


def mixed_data_note(trials: list[Any]) -> str | None:
    """One line when the trials trained on different data (by file hash), naming which trials had which."""
    groups: dict[tuple, list[int]] = {}
    for t in trials:
        h = trial_hashes(getattr(t, "meta", None))
        if h:
            groups.setdefault(tuple(sorted(h.items())), []).append(int(t.number))
    if len(groups) < 2:
        return None
    parts = []
    for sig, numbers in sorted(groups.items(), key=lambda kv: min(kv[1])):
        shown = ", ".join(f"{k} sha256 {v[:12]}" for k, v in sig)
        trials_txt = ", ".join(f"{n:04d}" for n in sorted(numbers)[:6]) + (" ..." if len(numbers) > 6 else "")
        parts.append(f"{shown} (trials {trials_txt})")
    return (
        f"the trials trained on {len(groups)} different data files: " + "; ".join(parts) + ". Their losses "
        "are not comparable across groups; re-run the sweep on one file (a new sweep folder)"
    )


def data_pins(trial: Any) -> tuple[dict[str, Any], list[str]]:
    """What ``pick`` pins for the winner's data: the absolute path (as the trial recorded it) and its hash
    (``data.path_sha256`` / ``data.eval_path_sha256``), with warnings for a file that changed or is missing
    since the sweep."""
    cfg_data = (getattr(trial, "config", None) or {}).get("data") or {}
    meta = getattr(trial, "meta", None) or {}
    sources = meta.get("data_sources") if isinstance(meta.get("data_sources"), dict) else {}
    hashes = trial_hashes(meta)
    pins: dict[str, Any] = {}
    warnings: list[str] = []
    for key in KEYS:
        leaf = key.split(".", 1)[1]
        typed = cfg_data.get(leaf)
        if not typed or key not in hashes:
            continue
        path = (sources.get(key) or {}).get("path") or os.path.abspath(os.path.expanduser(str(typed)))
        pins[leaf], pins[f"{leaf}_sha256"] = path, hashes[key]
        now = file_sha256(path)
        if now != hashes[key]:
            state = "is missing" if now is None else f"changed since the sweep (sha256 {now[:12]} now)"
            warnings.append(
                f"{key}={path} {state}: trial {int(trial.number):04d} trained on sha256 {hashes[key][:12]}; "
                f"the pinned data.{leaf}_sha256 makes the production run refuse another file"
            )
    return pins, warnings
