"""The run folder of a ``vramsweep train`` run and what is saved in it at the end (docs/RUNS.md).

::

    <run>/config.yaml      the composed config, pinned (written before training; resume compares with it)
    <run>/result.json      the trial result (docs/CONTRACTS.md)
    <run>/losses.jsonl     one row per optimizer step: {"step", "loss", "lr"}
    <run>/adapter/         PEFT save_pretrained (adapter_config.json + adapter_model.safetensors) or, with
                           adapter=full, <run>/model/ (the whole model, save_pretrained)
    <run>/tokenizer/       the base tokenizer (save_pretrained: its chat template included)
    <run>/id_map.json      vocab=sliced only: the kept ids (new id -> base id)
    <run>/run.json         what generate/export need: the base weights folder, adapter kind, vocab, dtype,
    quant <run>/checkpoints/     see :mod:`vramsweep.production.checkpoint`

A sweep trial saves nothing by default (``train.save_adapter=auto``); ``train.save_adapter=always`` makes
every trial save its adapter beside its result (``<trial>.run/``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.loop import Callback
from vramsweep.production.layout import (
    ADAPTER_DIR,
    CONFIG_FILE,
    LOSS_LOG,
    MODEL_DIR,
    RUN_MANIFEST,
    TOKENIZER_DIR,
    read_manifest,
)
from vramsweep.record.atomic import atomic_write_text

__all__ = ["LossLog", "RunFolder", "read_manifest", "run_folder_for", "save_outputs", "write_config"]


@dataclass
class RunFolder:
    """Where a run keeps its outputs; ``production``: a ``train`` run (checkpoints, resume, progress lines),
    not a sweep trial."""

    path: Path
    save_adapter: bool
    production: bool


def run_folder_for(cfg: DictConfig, result_path: Any, *, sweep_trial: bool) -> RunFolder | None:
    """The run folder of a trial writing ``result_path``: its parent for a ``train`` run, ``<trial>.run/``
    beside a sweep trial's result when ``train.save_adapter=always``; None when nothing is kept."""
    if result_path is None:
        return None
    mode = str(cfg.train.get("save_adapter", "auto"))
    p = Path(result_path)
    if sweep_trial:
        return RunFolder(p.with_suffix(".run"), True, False) if mode == "always" else None
    return RunFolder(p.parent, mode != "never", True)


#: the data keys ``config.yaml`` holds as absolute resolved paths (user sources), the typed one in a comment
DATA_PATH_KEYS = ("path", "eval_path")


def travelling_config(config: dict) -> tuple[dict, list[str]]:
    """``config`` with the user data files (``data.path``, ``data.eval_path``) as absolute resolved paths, as
    ``run.json`` holds the base folder, so the run folder is read the same from any folder; and the
    comment lines that keep them as typed."""
    data = dict(config.get("data") or {})
    notes = []
    if str(data.get("source")) in ("jsonl", "file"):
        for key in DATA_PATH_KEYS:
            typed = data.get(key)
            if typed:
                data[key] = str(Path(os.path.expanduser(str(typed))).resolve())
                if data[key] != str(typed):
                    notes.append(f"# data.{key}: {data[key]} (absolute, resolved; typed {str(typed)!r})")
    return {**config, "data": data} if notes else config, notes


def write_config(run: RunFolder, config: dict) -> None:
    """``config.yaml``: the composed config of the run (before the epochs are turned into steps), its data
    files absolute (:func:`travelling_config`)."""
    run.path.mkdir(parents=True, exist_ok=True)
    config, notes = travelling_config(config)
    text = "".join(n + "\n" for n in notes) + OmegaConf.to_yaml(OmegaConf.create(config))
    atomic_write_text(run.path / CONFIG_FILE, text)


class LossLog(Callback):
    """``losses.jsonl``: a row per optimizer step once its loss is read (``step`` = updates done)."""

    def __init__(self, run: RunFolder, scheduler: Any, rows: list[dict] | None = None):
        self.path, self.scheduler = run.path / LOSS_LOG, scheduler
        self.rows: list[dict] = list(rows or [])
        run.path.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:  # a resumed run rewrites what its checkpoint had
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        self.lr_at: dict[int, float] = {}

    def on_step_end(self, step: int) -> None:
        self.lr_at[step] = float(self.scheduler.get_last_lr()[0])

    def on_loss(self, step: int, loss: float) -> None:
        row = {"step": step + 1, "loss": loss, "lr": self.lr_at.pop(step, None)}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


#: what run.json says of the embedded model (it is on no hub: the adapter's base folder is a local cache)
EMBEDDED_NOTE = (
    "vramsweep's embedded tiny model (src/vramsweep/embedded.py), built and cached on this machine; not on "
    "any hub: on another machine `vramsweep train` (same vramsweep version) builds it again"
)


def base_entry(cfg: DictConfig, base_path: Any) -> dict[str, Any]:
    """run.json's ``base``: the weights folder as an absolute, resolved path (``path``; what generate and
    export load, from any folder) and as typed (``path_typed``); for the embedded model, what it is."""
    typed = cfg.model.get("path")
    entry: dict[str, Any] = {
        "name": str(cfg.model.name),
        "source": str(cfg.model.source),
        "path": None if base_path is None else str(Path(os.path.expanduser(str(base_path))).resolve()),
        "path_typed": None if typed is None else str(typed),
    }
    if str(cfg.model.source) == "embedded":
        entry["what"] = EMBEDDED_NOTE
    return entry


def save_outputs(
    run: RunFolder, cfg: DictConfig, model: Any, tokenizer: Any, id_map: Any, base_path: Any
) -> dict[str, Any]:
    """Save the trained adapter (or the whole model with ``adapter=full``), the tokenizer, the id map
    (``vocab=sliced``) and ``run.json``; returns the manifest."""
    run.path.mkdir(parents=True, exist_ok=True)
    full = str(cfg.adapter.method) != "lora"
    weights = run.path / (MODEL_DIR if full else ADAPTER_DIR)
    base = base_entry(cfg, base_path)
    if full:
        model.save_pretrained(str(weights))
    else:  # the adapter only: the embeddings are the base's (a sliced vocab keeps rows, it trains none)
        for pc in getattr(model, "peft_config", {}).values():  # the folder as an absolute path, not as typed
            if base["path"] is not None:
                pc.base_model_name_or_path = base["path"]
        model.save_pretrained(str(weights), save_embedding_layers=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(run.path / TOKENIZER_DIR))
    if id_map is not None:
        id_map.save(run.path)
    manifest = {
        "schema": 1,
        "base": base,
        "adapter": str(cfg.adapter.method),
        "weights": weights.name,
        "vocab": str(cfg.vocab.mode),
        "id_map": "id_map.json" if id_map is not None else None,
        "dtype": str(cfg.train.dtype),
        "quant": {"bits": int(cfg.quant.bits), "name": str(cfg.quant.name)},
        "steps": int(cfg.train.steps),
    }
    atomic_write_text(run.path / RUN_MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest
