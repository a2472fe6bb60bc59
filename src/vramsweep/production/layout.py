"""File names of a run folder (docs/RUNS.md), importable without torch (the CLI's parser reads them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUN_MANIFEST = "run.json"
CONFIG_FILE = "config.yaml"
LOSS_LOG = "losses.jsonl"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``run.json`` of a finished run folder; ``FileNotFoundError`` naming the file when it is missing."""
    path = Path(run_dir) / RUN_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a finished vramsweep train run folder")
    return json.loads(path.read_text())
