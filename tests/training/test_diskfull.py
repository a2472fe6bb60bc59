"""A disk that fills during a trial or a sweep: the trial ends with status ``error`` and the one
line ``no space left on device: <path>``, the sweep stops with that line (no chained tracebacks, no
``ABORTED: internal error``)."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from vramsweep.record.diskfull import disk_full_reason


def _enospc(path="/full/x.json"):
    return OSError(errno.ENOSPC, "No space left on device", path)


def test_reason_names_the_path():
    assert disk_full_reason(_enospc()) == "no space left on device: /full/x.json"
    assert disk_full_reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == "no space left on device"
    assert disk_full_reason(OSError(errno.ENOSPC, "full"), "/r") == "no space left on device: /r"
    try:  # raised from a full disk, then wrapped (as SQLAlchemy and json writers do)
        try:
            raise _enospc("/a")
        except OSError as inner:
            raise RuntimeError("could not save") from inner
    except RuntimeError as exc:
        assert disk_full_reason(exc) == "no space left on device: /a"
    full_db = sqlite3.OperationalError("database or disk is full")
    assert disk_full_reason(full_db, "/s/study.db") == "no space left on device: /s/study.db"
    assert disk_full_reason(OSError(errno.EACCES, "denied", "/x")) is None
    assert disk_full_reason(ValueError("x")) is None


@pytest.fixture
def no_training(monkeypatch):
    """The trial without training (build and data are not what this tests)."""
    monkeypatch.setattr("vramsweep.trial._train", lambda cfg, result, reporter, logger: None)


def test_trial_whose_result_cannot_be_written(tmp_path, monkeypatch, no_training):
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    def full(path, result):
        raise _enospc(str(path))

    monkeypatch.setattr("vramsweep.trial.write_result", full)
    path = tmp_path / "r" / "result.json"
    res = run_trial(compose([f"results_dir={tmp_path}"], rules="all"), result_path=path)
    assert res["status"] == "error"
    assert res["reason"] == f"no space left on device: {path}"
    assert res["meta"]["result_path"] is None


def test_trial_that_fills_the_disk_while_training(tmp_path, monkeypatch):
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    def train(cfg, result, reporter, logger, run=None):
        raise RuntimeError("checkpoint failed") from _enospc("/full/ckpt")

    monkeypatch.setattr("vramsweep.trial._train", train)
    path = tmp_path / "result.json"
    res = run_trial(compose([f"results_dir={tmp_path}"], rules="all"), result_path=path)
    assert (res["status"], res["reason"]) == ("error", "no space left on device: /full/ckpt")
    assert "traceback" not in res["meta"]
    assert path.exists()


def test_sweep_stops_with_one_line_when_the_disk_fills(tmp_path, monkeypatch, capsys):
    """In-process sweep with the fake trial: the first result JSON hits ENOSPC. The trial is told to
    Optuna as ``error`` with the reason, the sweep stops (exit 1) with that reason, no traceback."""
    import optuna

    import vramsweep.record.result as rr
    from vramsweep.cli import main

    real = rr.write_result
    trials_dir = tmp_path / "res" / "sweeps" / "full" / "trials"

    def write(path, result):
        if str(path).startswith(str(trials_dir)):
            raise _enospc(str(path))
        return real(path, result)

    import vramsweep.sweeper.trialproc as tp

    monkeypatch.setattr(rr, "write_result", write)
    monkeypatch.setattr(tp, "write_result", write)  # where the trial process writes its result
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "-m",
            "adapter.r=4,8,16,32",
            f"results_dir={tmp_path / 'res'}",
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.isolation=inprocess",
            "hydra.sweeper.study_name=full",
            "hydra.sweeper.n_jobs=1",
        ]
    )
    out, err = capsys.readouterr()
    text = out + err
    print(text)
    assert code == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    aborted = [ln for ln in text.splitlines() if "ABORTED" in ln]
    assert len(aborted) == 1 and "no space left on device: " + str(trials_dir) in aborted[0], text
    study = optuna.load_study(
        study_name="full", storage=f"sqlite:///{tmp_path / 'res' / 'sweeps' / 'full' / 'study.db'}"
    )
    done = [t for t in study.trials if t.user_attrs.get("status")]
    assert len(done) == 1, [t.user_attrs for t in study.trials]  # stopped after the first
    assert done[0].user_attrs["status"] == "error"
    assert str(done[0].user_attrs.get("reason", "")).startswith("no space left on device: ")


def test_sweep_whose_study_database_fills_stops_with_one_line(tmp_path, monkeypatch, capsys):
    """Telling Optuna fails with SQLite's full-disk error: the sweep stops naming the study file."""
    from vramsweep.cli import main
    from vramsweep.sweeper.study import StudyBook

    def tell(self, *a, **k):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(StudyBook, "tell", tell)
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "-m",
            "adapter.r=4,8",
            f"results_dir={tmp_path / 'res'}",
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.isolation=inprocess",
            "hydra.sweeper.study_name=fulldb",
        ]
    )
    out, err = capsys.readouterr()
    text = out + err
    assert code == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert (
        f"ABORTED: no space left on device: {tmp_path / 'res' / 'sweeps' / 'fulldb' / 'study.db'}" in text
    ), text
