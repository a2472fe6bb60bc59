"""A trial's ``prepare`` runs in one direction, data -> build -> batches, and packs its examples once."""

from __future__ import annotations

import sys

import pytest

from conftest import FAST
from vramsweep.config import compose
from vramsweep.data import packing
from vramsweep.knobs import registry
from vramsweep.production.length import steps_for_epochs

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _spy(monkeypatch, events: list[str], module, name: str, event: str) -> None:
    """Record ``event`` at each call of ``module.name``, in that module and in every loaded vramsweep module
    that imported the same function (a ``from ... import`` keeps its own reference)."""
    real = getattr(module, name)

    def spy(*a, **kw):
        events.append(event)
        return real(*a, **kw)

    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "") or "").startswith("vramsweep") and getattr(mod, name, None) is real:
            monkeypatch.setattr(mod, name, spy)


def test_prepare_reads_data_then_builds_then_packs_once(tmp_path, monkeypatch):
    """``data.packing`` with ``train.epochs`` (the run's length from the packed rows) and a sliced vocabulary
    (its kept ids from the examples, the rows in its ids): the examples are read, the model built, then the
    rows packed once (before this refactor: packed before the build for the epoch count and again after)."""
    from vramsweep import trial
    from vramsweep.data import prep
    from vramsweep.knobs import build

    registry.registered()  # every provider module loaded: their imports are spied too
    events: list[str] = []
    _spy(monkeypatch, events, prep, "trial_data", "data")
    _spy(monkeypatch, events, build, "build_model", "build")
    _spy(monkeypatch, events, packing, "pack_examples", "pack")
    over = [
        *FAST,
        f"results_dir={tmp_path}",
        "data.packing=true",
        "train.epochs=1",
        "vocab=sliced",
        "context.max_tokens=512",
    ]
    cfg = compose(over)
    result = {"meta": {}, "estimate": None}

    prep_ = trial.prepare(cfg, result)

    assert events == ["data", "build", "pack"]
    meta = result["meta"]
    rows = meta["data"]["packing"]["rows"]
    t = cfg.train  # one epoch over the packed rows, not over the examples
    assert (
        meta["steps_from_epochs"]["steps"]
        == t.steps
        == steps_for_epochs(rows, 1, t.micro_batch, t.grad_accum)
    )
    assert len(prep_.batches) == cfg.train.steps * cfg.train.grad_accum
    kept = meta["build"]["vocab"]["kept"]
    assert kept < meta["build"]["vocab"]["original"]
    assert all(int(b["input_ids"].max()) < kept for b in prep_.batches)  # the packed rows are in the kept ids
    assert all(b["input_ids"].shape[1] == cfg.context.max_tokens for b in prep_.batches)  # padded to width
