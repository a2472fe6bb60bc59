"""A sweep re-run on changed data (docs/RUNS.md "Changed data"): the study records the sha256 of its data
files when it starts; a re-run after the file changed exits 2 naming the file and both hashes and writes
nothing; ``train.resume_on_changed_data=true`` continues and the change is recorded in the study."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import optuna

from _run_folders import folder_hash
from vramsweep.sweeper import run_multirun


def _args(tmp_path: Path, data: Path) -> list[str]:
    return [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.preload=[fakes]",
        "hydra.sweeper.isolation=inprocess",
        "adapter.r=4,8",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=dat",
        "data=jsonl",
        f"data.path={data}",
    ]


def _write(data: Path, word: str) -> str:
    chats = [
        {"messages": [{"role": "user", "content": f"{word} {i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return hashlib.sha256(data.read_bytes()).hexdigest()


def _study(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name="dat", storage=f"sqlite:///{folder / 'study.db'}")


def test_a_sweep_re_run_on_changed_data_exits_2_naming_the_file_and_both_hashes(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    data = tmp_path / "chats.jsonl"
    old = _write(data, "a")
    args = _args(tmp_path, data)
    assert (
        run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    )  # one of two points: the sweep goes on later
    folder = tmp_path / "sweeps" / "dat"
    study = _study(folder)
    assert study.user_attrs["vramsweep:data"]["data.path"]["sha256"] == old

    new = _write(data, "b")
    before = folder_hash(folder)
    capsys.readouterr()
    assert run_multirun(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"data.path={data}" in err and old[:16] in err and new[:16] in err, err
    assert "train.resume_on_changed_data=true" in err
    assert folder_hash(folder) == before, sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*"))

    assert run_multirun([*args, "train.resume_on_changed_data=true"]) == 0
    study = _study(folder)
    assert len([t for t in study.trials if t.state.is_finished()]) == 2
    [change] = study.user_attrs["vramsweep:data_changes"]
    assert (change["was"], change["now"]) == (old, new)
    assert study.user_attrs["vramsweep:data"]["data.path"]["sha256"] == new


def _as_before_hashes(folder: Path) -> None:
    """The study without its data hashes, as a sweep started before vramsweep recorded them left it."""
    db = sqlite3.connect(folder / "study.db")
    with db:
        db.execute("DELETE FROM study_user_attributes WHERE key = 'vramsweep:data'")
    db.close()


def _study_record(folder: Path) -> tuple:
    study = _study(folder)
    return study.user_attrs, [(t.number, t.state, t.params, t.values) for t in study.trials]


def test_a_study_from_before_data_hashes_says_it_cannot_verify_and_records_them_now(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    data = tmp_path / "chats.jsonl"
    sha = _write(data, "a")
    args = _args(tmp_path, data)
    assert run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    folder = tmp_path / "sweeps" / "dat"
    _as_before_hashes(folder)
    capsys.readouterr()
    assert run_multirun(args) == 0  # the fake trial records no hash: nothing to check against
    said = [
        ln for ln in capsys.readouterr().err.splitlines() if "before vramsweep recorded data hashes" in ln
    ]
    assert len(said) == 1 and f"cannot verify that data.path={data}" in said[0], said
    study = _study(folder)
    assert study.user_attrs["vramsweep:data"]["data.path"]["sha256"] == sha  # recorded now: checked later


def test_a_study_from_before_data_hashes_is_checked_against_its_trials_results(tmp_path, monkeypatch, capsys):
    """Older trial results name the data file's hash (``meta.data.source_sha256``): a re-run on another
    file is refused as for a study that recorded it."""
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    data = tmp_path / "chats.jsonl"
    old = _write(data, "a")
    args = _args(tmp_path, data)
    assert run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    folder = tmp_path / "sweeps" / "dat"
    _as_before_hashes(folder)
    [result] = (folder / "trials").glob("*.json")
    res = json.loads(result.read_text())
    res["meta"].setdefault("data", {})["source_sha256"] = old
    result.write_text(json.dumps(res))
    new = _write(data, "b")
    before = folder_hash(folder / "trials"), _study_record(folder)
    capsys.readouterr()
    assert run_multirun(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"data.path={data}" in err and old[:16] in err and new[:16] in err, err
    assert (folder_hash(folder / "trials"), _study_record(folder)) == before  # (SQLite's WAL files aside)
