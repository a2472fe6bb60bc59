"""Shared fixtures: one cached embedded model per session, isolated results folders, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VRAMSWEEP_CACHE", str(ROOT / ".cache" / "vramsweep"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite composes from the packaged conf only (a developer's own conf dir must not change results).
os.environ.pop("VRAMSWEEP_CONFIG_DIR", None)
# Test doubles (tests/fakes.py, ...) are importable by the trial and sweeper processes tests start too.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)

# Small, fast trial settings shared by tests that run real trials on the embedded model.
FAST = [
    "train.steps=4",
    "train.measure_warmup_steps=2",
    "train.eval_batches=1",
    "train.warmup_steps=0",
    "data.num_docs=4",
    "data.num_eval_docs=1",
    "context.max_tokens=128",
]


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """Build (or reuse) the cached embedded model once per session."""
    from vramsweep.config import compose
    from vramsweep.embedded import ensure_embedded

    cfg = compose([])
    return ensure_embedded(cfg.model, progress=False)


@pytest.fixture()
def results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    return d


@pytest.fixture(autouse=True)
def _no_conf_dir_leaks():
    """``vramsweep train --config-dir`` (and ``./conf``) export ``VRAMSWEEP_CONFIG_DIR`` for the trial
    processes; a test that runs the CLI must not leave it to the next test."""
    yield
    os.environ.pop("VRAMSWEEP_CONFIG_DIR", None)
