"""A sweep re-run on changed data (docs/RUNS.md "Changed data"): the study records the sha256 of its data
files when it starts; a re-run after the file changed exits 2 naming the file and both hashes and writes
nothing; ``train.resume_on_changed_data=true`` continues and the change is recorded in the study."""

from __future__ import annotations

import hashlib
import json
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
    study = optuna.load_study(study_name="dat", storage=f"sqlite:///{folder / 'study.db'}")
    assert study.user_attrs["vramsweep:data"]["data.path"]["sha256"] == old

    new = _write(data, "b")
    before = folder_hash(folder)
    capsys.readouterr()
    assert run_multirun(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"data.path={data}" in err and old[:16] in err and new[:16] in err, err
    assert "train.resume_on_changed_data=true" in err
    assert folder_hash(folder) == before

    assert run_multirun([*args, "train.resume_on_changed_data=true"]) == 0
    study = optuna.load_study(study_name="dat", storage=f"sqlite:///{folder / 'study.db'}")
    assert len([t for t in study.trials if t.state.is_finished()]) == 2
    [change] = study.user_attrs["vramsweep:data_changes"]
    assert (change["was"], change["now"]) == (old, new)
    assert study.user_attrs["vramsweep:data"]["data.path"]["sha256"] == new
