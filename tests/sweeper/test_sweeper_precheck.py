"""``sweep.check=true``: ``vramsweep check`` on the sweep's baseline is the sweep's pre-flight. It runs
before the study, the folder or any trial; it is recorded in ``sweep.json``; a FAIL (a deliberately broken
resume, injected here) stops the sweep with one line and exit 2 before trial 0, and an existing study is
left as it was. The trials are the in-process fake (milliseconds); the check itself is the real one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest

from _resume import restore_without_optimizer_state
from vramsweep.sweeper import run_multirun

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

FAKE = ["hydra.sweeper.trial_fn=fakes:fake_trial", "hydra.sweeper.isolation=inprocess"]
LINES = {"accumulation", "eval_then_train", "packing", "resume", "stop_token"}


def _sweep(tmp_path: Path, *args: str) -> int:
    return run_multirun([f"results_dir={tmp_path}", *FAKE, *args])


def test_the_check_runs_on_the_baseline_before_trial_0_and_is_recorded(tmp_path, capsys):
    assert _sweep(tmp_path, "sweep.name=c1", "+sweep.check=true", "adapter.r=4,8") == 0
    out = capsys.readouterr().out
    info = json.loads((tmp_path / "sweeps" / "c1" / "sweep.json").read_text())
    assert info["check"] is True
    result = info["check_result"]
    assert {x["name"] for x in result["lines"]} == LINES and all(x["ok"] for x in result["lines"])
    resume = next(x for x in result["lines"] if x["name"] == "resume")
    assert resume["tolerance"] == "bitwise" and "0/" in resume["figure"]
    assert f"results_dir={tmp_path}" in result["overrides"]
    first_trial = re.search(r"trial 0000", out)
    assert first_trial and out.index("vramsweep: sweep.check: PASS resume: ") < first_trial.start()


def test_without_sweep_check_nothing_is_checked(tmp_path, capsys):
    assert _sweep(tmp_path, "sweep.name=c0", "adapter.r=4,8") == 0
    info = json.loads((tmp_path / "sweeps" / "c0" / "sweep.json").read_text())
    assert "check" not in info and "check_result" not in info
    assert "sweep.check" not in capsys.readouterr().out


def _files(folder: Path) -> dict[str, bytes]:
    """The folder's files but the SQLite database and its write-ahead log (SQLite folds the log in when the
    first run's last connection closes: the study's content is compared through Optuna instead)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith("study.db")
    }


def _trials(folder: Path, name: str) -> list[tuple]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/study.db")
    return [(t.number, t.state, t.params, t.values, t.datetime_complete) for t in study.trials]


def test_a_failing_check_stops_the_sweep_before_any_trial_and_leaves_the_study(tmp_path, capsys, monkeypatch):
    """An unfinished study (1 of 2 search trials) re-run with ``sweep.check=true`` on a broken resume:
    exit 2, one line naming the FAIL and its figure, no new trial, the folder byte for byte as it was."""
    search = ["sweep.name=c2", "hydra.sweeper.sampler=random", "adapter.r=choice(4,8,16)"]
    assert _sweep(tmp_path, *search, "hydra.sweeper.n_trials=1") == 0
    folder = tmp_path / "sweeps" / "c2"
    before, trials = _files(folder), _trials(folder, "c2")
    assert len(trials) == 1 and "sweep.json" in before
    capsys.readouterr()
    restore_without_optimizer_state(monkeypatch)
    assert _sweep(tmp_path, *search, "hydra.sweeper.n_trials=2", "+sweep.check=true") == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("vramsweep train: error: sweep.check: the baseline (the base config) fails")
    assert re.search(
        r"FAIL resume: .* [1-9]\d*/\d+ adapter tensors differ \(max \|diff\| \d\.\de-\d+\)", err[0]
    )
    assert "no trial ran" in err[0] and "trial 0001" not in out.out
    assert _files(folder) == before
    assert _trials(folder, "c2") == trials
