"""``run_trial`` builds a typed :class:`TrialResult` (``Status`` members), hands it to ``write_result`` and
returns its dict form; the file it writes round-trips through the schema. Training is stubbed: what is
tested is the record, not the measurement (tests/training/test_trial.py runs real trials)."""

from __future__ import annotations

import json

import pytest

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.schema import TrialResult, check_result
from vramsweep.record.status import Status


def _cfg(tmp_path):
    from vramsweep.config import compose

    return compose([f"results_dir={tmp_path}"], rules="all")


@pytest.fixture
def written(monkeypatch):
    """What ``run_trial`` hands to ``write_result`` (still written for real)."""
    import vramsweep.trial as trial_mod

    seen: list = []
    real = trial_mod.write_result

    def spy(path, result):
        seen.append(result)
        return real(path, result)

    monkeypatch.setattr(trial_mod, "write_result", spy)
    return seen


def _train_with(metrics: dict, exc: BaseException | None = None):
    def train(cfg, result, reporter, logger, run=None):
        result["metrics"].update(metrics)
        result["meta"]["stub"] = True
        if exc is not None:
            raise exc

    return train


def test_run_trial_writes_a_typed_result_that_round_trips(tmp_path, monkeypatch, written):
    from vramsweep.trial import run_trial

    monkeypatch.setattr("vramsweep.trial._train", _train_with({M.TOKENS_PER_S: 123.0, M.EVAL_LOSS: 2.5}))
    path = tmp_path / "r.json"
    res = run_trial(_cfg(tmp_path), result_path=path, sweep="s", trial=3, overrides=["train.seed=1"])

    (record,) = written
    assert isinstance(record, TrialResult) and record.status is Status.OK
    data = json.loads(path.read_text())
    typed = check_result(data)  # the file follows the contract and round-trips exactly
    assert typed.status is Status.OK and typed.trial == 3 and typed.overrides == ["train.seed=1"]
    assert typed.metrics.number(M.TOKENS_PER_S) == 123.0 and typed.meta.get("stub") is True
    # callers get the dict form: the file plus where it was written
    assert type(res["status"]) is str and res["status"] == Status.OK
    assert res["meta"].pop("result_path") == str(path)
    assert res == data


def test_run_trial_failure_is_a_status_member(tmp_path, monkeypatch, written):
    from vramsweep.loop import Diverged
    from vramsweep.trial import run_trial

    train = _train_with({M.TRAIN_LOSS: float("nan")}, Diverged("loss is nan at step 1"))
    monkeypatch.setattr("vramsweep.trial._train", train)
    path = tmp_path / "r.json"
    res = run_trial(_cfg(tmp_path), result_path=path)

    assert written[0].status is Status.DIVERGED
    assert (res["status"], res["reason"]) == (Status.DIVERGED, "loss is nan at step 1")
    data = json.loads(path.read_text())
    assert data["status"] == "diverged" and data["metrics"][M.TRAIN_LOSS] is None  # NaN: null in JSON
    assert check_result(data).status is Status.DIVERGED


def test_a_measurement_that_breaks_the_contract_is_an_error_not_a_crash(tmp_path, monkeypatch):
    from vramsweep.trial import run_trial

    monkeypatch.setattr("vramsweep.trial._train", _train_with({M.TOKENS_PER_S: "fast"}))
    path = tmp_path / "r.json"
    res = run_trial(_cfg(tmp_path), result_path=path, sweep="s", trial=1)

    assert res["status"] == Status.ERROR
    assert "metrics.tokens_per_s='fast'" in res["reason"] and "the trial ended ok" in res["reason"]
    data = check_result(json.loads(path.read_text()))
    assert data.status is Status.ERROR and data.metrics.get(M.TOKENS_PER_S) is None
    assert data.meta.get("stub") is True and data.meta.started  # provenance kept
    assert data.sweep == "s" and data.trial == 1
