"""Real trials over data.train_on score one held-out set (issue 50, bug 4): the same ``meta.eval_set`` and,
before any training step, the same eval loss."""

from __future__ import annotations

import pytest

from conftest import FAST
from vramsweep.config import compose
from vramsweep.trial import run_trial

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _trial(tmp_path, name, *overrides):
    over = [*FAST, "train.steps=2", "train.measure_warmup_steps=1", f"results_dir={tmp_path}", *overrides]
    return run_trial(compose(over), result_path=tmp_path / f"{name}.json", overrides=over)


def test_trials_over_train_on_score_the_same_held_out_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    runs = {t: _trial(tmp_path, t, "data=grant_chat", f"data.train_on={t}") for t in ("assistant", "all")}
    assert [r["status"] for r in runs.values()] == ["ok", "ok"]
    sets = [r["meta"]["eval_set"] for r in runs.values()]
    assert sets[0] == sets[1] and sets[0]["train_on"] == "assistant" and sets[0]["scored_tokens"] > 0
    assert len(sets[0]["fingerprint"]) == 16 and sets[0]["examples"] == 1
    # the same initial weights over the same tokens: the same loss before training (before the fix, `all`
    # scored the prompts too and its initial eval loss differed)
    losses = [r["metrics"]["initial_eval_loss"] for r in runs.values()]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    trained = [r["meta"]["data"]["train"]["trained_tokens"] for r in runs.values()]
    assert trained[0] < trained[1]  # the knob still changes what is trained
