"""The initial (pre-training) eval is computed once per sweep for trials that score the same base model on
the same held-out tokens, and read by the others (``meta.initial_eval.shared``); its value is what the trial
would have computed itself."""

from __future__ import annotations

import pytest
import torch

from conftest import FAST
from vramsweep.config import compose
from vramsweep.measure import initial_eval as ie


def _batches(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    return [{"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}]


def _key(*overrides: str, batches=None) -> str:
    return ie.key_of(ie.key_parts(compose(list(overrides), rules="config"), batches or _batches()))


@pytest.mark.parametrize(
    "same",
    [
        ["optimizer=adamw_8bit"],
        ["adapter=rslora"],
        ["adapter=dora"],
        ["checkpointing=on"],
        ["train.seed=1"],
        ["train.lr=1e-4"],
        ["adapter.r=64"],
    ],
)
def test_what_does_not_change_the_base_model_shares_the_key(same):
    assert _key(*same) == _key()


@pytest.mark.parametrize(
    "other",
    [["train.dtype=fp32"], ["quant=int8"], ["vocab=sliced"], ["attention=eager"], ["tiling=loss"]],
)
def test_what_changes_the_base_models_figure_changes_the_key(other):
    assert _key(*other) != _key()


def test_another_held_out_set_changes_the_key():
    assert _key(batches=_batches(1)) != _key(batches=_batches(0))


def test_4bit_on_cpu_is_shared_and_keyed_by_its_quantisation():
    """The build keeps bitsandbytes' 4-bit layers in their trainable layout, so an eval forward changes nothing
    that follows (tests/knobs/test_quant_grads.py) and a 4-bit base's initial eval is shared like any other,
    under its own key."""
    assert ie.not_shared(compose(["quant=nf4"], rules="config")) is None
    assert ie.not_shared(compose([], rules="config")) is None
    assert _key("quant=nf4") != _key()


def test_one_initial_eval_per_sweep_counted(tmp_path, monkeypatch):
    import vramsweep.trial as trial_mod

    calls = []
    real = trial_mod.evaluate

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(trial_mod, "evaluate", counting)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    monkeypatch.setenv(ie.SWEEP_DIR_ENV, str(sweep))

    def run(n: int, *over: str, sweep_name: str | None = "s") -> dict:
        o = [*FAST, "train.steps=2", "train.measure_warmup_steps=1", f"results_dir={tmp_path}", *over]
        kw = {"sweep": sweep_name, "trial": n} if sweep_name else {}
        res = trial_mod.run_trial(compose(o), overrides=o, **kw)
        assert res["status"] == "ok", res.get("reason")
        return res

    first = run(0)
    assert len(calls) == 2 and first["meta"]["initial_eval"]["shared"] is False  # initial + final
    second = run(1, "adapter=rslora", "train.seed=1", "optimizer=adamw_8bit")
    assert len(calls) == 3, "the second trial computed its own initial eval"
    assert second["meta"]["initial_eval"]["shared"] is True
    assert second["meta"]["initial_eval"]["computed_by_trial"] == 0
    assert second["metrics"]["initial_eval_loss"] == first["metrics"]["initial_eval_loss"]
    assert len(list((sweep / ie.FOLDER).glob("*.json"))) == 1
    own = run(
        2, "adapter=rslora", "train.seed=1", "optimizer=adamw_8bit", sweep_name=None
    )  # not a sweep trial
    assert own["meta"]["initial_eval"]["shared"] is False
    assert own["metrics"]["initial_eval_loss"] == pytest.approx(
        first["metrics"]["initial_eval_loss"], abs=1e-6
    )
    fp32 = run(3, "train.dtype=fp32")  # another base-model figure: computed, stored beside the first
    assert fp32["meta"]["initial_eval"]["shared"] is False
    assert len(list((sweep / ie.FOLDER).glob("*.json"))) == 2
