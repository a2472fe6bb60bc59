"""Data fingerprints (docs/RUNS.md "Changed data"): the sha256 of every file a run reads its records from.

:func:`data_fingerprints` hashes ``data.path``, ``data.eval_path`` (user sources) and a ``data.chat_template``
file, by absolute path. A production run records them in ``result.json`` (``meta.data_sources``) and in every
checkpoint's ``state.json`` (``data``); :func:`changed_data` compares a checkpoint's with the files now, and
:func:`check_resume_data` refuses a resume on changed data (exit 2 naming the file and both hashes) unless
``train.resume_on_changed_data=true`` (then the change is recorded in ``meta.data_changed_on_resume``). A
checkpoint written before fingerprints has nothing to compare: the resume continues, says so in one line
(:func:`unverified_line`) and records the files' hashes now (``unverified`` entries of the same list).
:func:`check_pinned` checks the hashes ``vramsweep pick`` pinned beside the paths (``data.path_sha256``,
``data.eval_path_sha256``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vramsweep.config.errors import ConfigError
from vramsweep.data.sources import source_sha256

#: the config keys whose files a run's records come from (``data.chat_template``: only when a file)
DATA_FILE_KEYS = ("data.path", "data.eval_path", "data.chat_template")
USER_SOURCES = ("jsonl", "file")
#: the key that allows a resume on changed data (recorded in the result when used)
OPT_IN = "train.resume_on_changed_data"


def _files(cfg: Any) -> dict[str, str]:
    d = cfg.data
    out: dict[str, str] = {}
    if str(d.source) in USER_SOURCES:
        for key in ("path", "eval_path"):
            if d.get(key):
                out[f"data.{key}"] = str(d.get(key))
    tpl = d.get("chat_template")
    if tpl and os.path.isfile(os.path.expanduser(str(tpl))):
        out["data.chat_template"] = os.path.expanduser(str(tpl))
    return out


def file_sha256(path: str) -> str | None:
    """sha256 of a file or folder (:func:`vramsweep.data.sources.source_sha256`); None when it is missing."""
    if not os.path.exists(path):
        return None
    return source_sha256(path)


def data_fingerprints(cfg: Any) -> dict[str, dict[str, Any]]:
    """``{config key: {"path": absolute path, "sha256": hex or None (missing)}}`` of the run's data files."""
    return {key: {"path": os.path.abspath(p), "sha256": file_sha256(p)} for key, p in _files(cfg).items()}


def changed_data(recorded: dict[str, Any] | None, now: dict[str, Any]) -> list[dict[str, Any]]:
    """The files whose hash differs between ``recorded`` and ``now`` (a key only in one of them counts)."""
    recorded = recorded or {}
    out = []
    for key in sorted(set(recorded) | set(now)):
        was, is_ = recorded.get(key) or {}, now.get(key) or {}
        if was.get("sha256") != is_.get("sha256"):
            path = is_.get("path") or was.get("path")
            out.append({"key": key, "path": path, "was": was.get("sha256"), "now": is_.get("sha256")})
    return out


def _short(h: str | None) -> str:
    return "missing" if h is None else f"sha256 {h[:16]}"


def describe(change: dict[str, Any]) -> str:
    return f"{change['key']}={change['path']} ({_short(change['was'])} then, {_short(change['now'])} now)"


def checkpoint_data(ckpt: Path) -> dict[str, Any] | None:
    """The data fingerprints a checkpoint recorded (None: none recorded, or unreadable)."""
    try:
        state = json.loads((Path(ckpt) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    data = state.get("data") if isinstance(state, dict) else None
    return data if isinstance(data, dict) else None


def check_resume_data(ckpt: Path | None, cfg: Any) -> list[dict[str, Any]]:
    """Resuming from ``ckpt``: the data changes the opt-in allows ([] when none), or a ConfigError (exit 2)
    naming the file and both hashes."""
    if ckpt is None:
        return []
    recorded = checkpoint_data(ckpt)
    if recorded is None:  # written before fingerprints: continued, said and recorded (unverified_line)
        return [
            {"key": k, "path": v["path"], "was": None, "now": v["sha256"], "unverified": True}
            for k, v in data_fingerprints(cfg).items()
        ]
    changes = changed_data(recorded, data_fingerprints(cfg))
    if not changes or bool(cfg.train.get("resume_on_changed_data", False)):
        return changes
    raise ConfigError(
        f"train.resume=auto: the data changed since checkpoint {ckpt}: {describe(changes[0])}"
        f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}; the resumed steps would train on "
        f"other records than the first ones. Restore the file, or give a new train.output_dir, or pass "
        f"{OPT_IN}=true to continue on the new data (recorded in the result)",
        key=OPT_IN,
        allowed=["false (refuse)", "true (continue on the new data, recorded)"],
    )


def unverified_line(ckpt: Path, changes: list[dict[str, Any]]) -> str | None:
    """One line for a resume from a checkpoint written before data fingerprints (``changes`` from
    :func:`check_resume_data` marked ``unverified``): nothing to check the files against, so the run
    continues on them and records their hashes now; None when the checkpoint had fingerprints."""
    files = [c for c in changes if c.get("unverified")]
    if not files:
        return None
    shown = ", ".join(f"{c['key']}={c['path']} ({_short(c['now'])})" for c in files)
    return (
        f"checkpoint {ckpt} was written before vramsweep recorded data hashes: cannot verify that {shown} "
        "holds the records the earlier steps trained on; continuing on it and recording its hash now "
        "(meta.data_changed_on_resume, later checkpoints: a later resume checks it)"
    )


#: the data files a trial result names (``trial_hashes``)
KEYS = ("data.path", "data.eval_path")


def trial_hashes(meta: dict[str, Any] | None) -> dict[str, str]:
    """``{"data.path": sha256, "data.eval_path": sha256}`` as the trial recorded them ({}: embedded data)."""
    meta = meta or {}
    sources = meta.get("data_sources")
    if isinstance(sources, dict) and sources:
        return {k: str(v.get("sha256")) for k, v in sources.items() if isinstance(v, dict) and k in KEYS}
    old = (meta.get("data") or {}).get("source_sha256") if isinstance(meta.get("data"), dict) else None
    if isinstance(old, str):
        return {"data.path": old}
    if isinstance(old, dict):
        return {f"data.{k}": str(v) for k, v in old.items() if f"data.{k}" in KEYS}
    return {}


PIN_KEYS = {"data.path": "path_sha256", "data.eval_path": "eval_path_sha256"}


def check_pinned(cfg: Any) -> None:
    """``data.path_sha256`` / ``data.eval_path_sha256`` (``vramsweep pick`` pins them): the file's hash must
    match, else a ConfigError (exit 2) naming the file and both hashes."""
    d = cfg.data
    files = _files(cfg)
    for key, pin_name in PIN_KEYS.items():
        pinned = d.get(pin_name)
        if not pinned or key not in files:
            continue
        now = file_sha256(files[key])
        if now != str(pinned):
            raise ConfigError(
                f"data.{pin_name}: {key}={os.path.abspath(files[key])} is not the file the sweep measured "
                f"(sha256 {str(pinned)[:16]} pinned, {_short(now)} now); give the file the sweep trained "
                f"on, or drop data.{pin_name} to train on this one",
                key=f"data.{pin_name}",
            )


def check_data(cfg: Any, run_dir: Path) -> None:
    """Before a ``train`` run writes anything: the pinned hashes (:func:`check_pinned`) and, with
    ``train.resume=auto``, the data the newest complete checkpoint of ``run_dir`` recorded."""
    from vramsweep.production.checkpoint import latest_checkpoint

    check_pinned(cfg)
    if str(cfg.train.get("resume", "never")) == "auto":
        check_resume_data(latest_checkpoint(Path(run_dir)), cfg)
