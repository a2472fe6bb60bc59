"""Real trials over data.train_on score one held-out set (issue 50, bug 4): the same ``meta.eval_set`` and,
before any training step, the same eval loss."""

from __future__ import annotations

import json

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


def test_trials_of_a_sweep_score_the_baselines_reference(tmp_path, monkeypatch):
    """Trials of a sweep (VRAMSWEEP_SWEEP_DIR, sweep.json's eval_reference: the baseline's context of 512)
    over data.train_on and context.max_tokens: last_assistant at 1024 tokens scores the baseline's held-out
    tokens (one fingerprint, the same count, the same loss before training); a 128-token trial cannot (the
    reference's held-out example has 96 tokens) and its result says comparable: false and why."""
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "sweep"
    folder.mkdir()
    ref = {"data.chat_template": None, "data.enable_thinking": False, "context.max_tokens": 512}
    (folder / "sweep.json").write_text(json.dumps({"name": "s", "eval_reference": ref}))
    monkeypatch.setenv("VRAMSWEEP_SWEEP_DIR", str(folder))
    base = ["data=grant_chat", "context.max_tokens=512"]
    runs = {
        "baseline": _trial(tmp_path, "baseline", *base),
        "last_assistant": _trial(
            tmp_path, "last", *base, "data.train_on=last_assistant", "context.max_tokens=1024"
        ),
        "short": _trial(tmp_path, "short", *base, "context.max_tokens=64"),
    }
    assert [r["status"] for r in runs.values()] == ["ok"] * 3
    sets = {k: r["meta"]["eval_set"] for k, r in runs.items()}
    assert sets["baseline"]["fingerprint"] == sets["last_assistant"]["fingerprint"]
    assert sets["baseline"]["scored_tokens"] == sets["last_assistant"]["scored_tokens"] > 0
    assert sets["baseline"]["comparable"] and sets["last_assistant"]["comparable"]
    assert sets["last_assistant"]["reference"]["max_tokens"] == 512
    losses = [runs[k]["metrics"]["initial_eval_loss"] for k in ("baseline", "last_assistant")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert (
        sets["short"]["comparable"] is False
        and sets["short"]["fingerprint"] != sets["baseline"]["fingerprint"]
    )
    assert sets["short"]["not_comparable"].startswith("context.max_tokens=64 is shorter than the reference's")
