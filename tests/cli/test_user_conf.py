"""A user's conf dir is layered over the packaged defaults: compose, option lists, the CLI (one trial and
``-m`` through Hydra's own app), and ``pick`` writes there; a sweep trial composes its config once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _user_conf import user_conf
from conftest import trial_spec
from vramsweep.cli import main
from vramsweep.config import ConfigError, compose, list_options, packaged_conf_dir


def test_compose_layers_the_user_conf_dir_over_the_packaged_one(tmp_path: Path, monkeypatch) -> None:
    mine = user_conf(tmp_path / "mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert compose(["hardware=mine"], conf_dir=mine, rules="none").hardware.budget_gib == 7
    assert compose([], conf_dir=mine, rules="none").hardware.budget_gib == 3.5  # the user's file wins
    assert compose([], rules="none").hardware.budget_gib == 0.0  # the packaged cpu.yaml
    assert (packaged_conf_dir() / "hardware" / "cpu.yaml").is_file()
    assert "mine" not in list_options("hardware") and "mine" in list_options("hardware", mine)
    with pytest.raises(ConfigError, match="unknown option hardware=nope") as info:
        compose(["hardware=nope"], conf_dir=mine)
    assert {"mine", "cpu", "rtx4080_16gb"} <= set(info.value.allowed)
    # without the argument: $VRAMSWEEP_CONFIG_DIR, else ./conf of the current folder
    monkeypatch.setenv("VRAMSWEEP_CONFIG_DIR", str(mine))
    assert compose(["hardware=mine"], rules="none").hardware.budget_gib == 7
    monkeypatch.setenv("VRAMSWEEP_CONFIG_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="VRAMSWEEP_CONFIG_DIR=.*missing: no such folder"):
        compose([])
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR")
    project = tmp_path / "project"
    user_conf(project / "conf")
    monkeypatch.chdir(project)
    assert compose(["hardware=mine"], rules="none").hardware.budget_gib == 7
    # the CLI pins ./conf for the trial processes and workers it starts, whatever their working folder
    assert main(["train", "--cfg", "job", "hardware=mine"]) == 0
    assert os.environ["VRAMSWEEP_CONFIG_DIR"] == str((project / "conf").resolve())


def test_cli_config_dir_for_one_trial_and_for_a_sweep(tmp_path: Path, monkeypatch, capsys) -> None:
    mine = user_conf(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR", raising=False)
    assert main(["train", "--config-dir", str(mine), "--cfg", "job", "hardware=mine"]) == 0
    out = capsys.readouterr().out
    assert "name: mine" in out and "budget_gib: 7" in out
    # Hydra's own app (train -m) gets the same search path (the search-path plugin)
    assert main(["train", "--config-dir", str(mine), "-m", "--info", "searchpath"]) == 0
    out = capsys.readouterr().out
    assert f"file://{mine}" in out and out.index(f"file://{mine}") < out.index(
        f"file://{packaged_conf_dir()}"
    )
    results = tmp_path / "results"
    code = main(
        [
            "train",
            "--config-dir",
            str(mine),
            "-m",
            "sweep=mine",
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.isolation=inprocess",
            f"results_dir={results}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    info = json.loads((results / "sweeps" / "mine" / "sweep.json").read_text())
    assert info["baseline"] == ["hardware=mine"]
    assert len(list((results / "sweeps" / "mine" / "trials").glob("*.json"))) == 2
    capsys.readouterr()
    assert main(["train", "--config-dir", str(tmp_path / "missing"), "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vramsweep train: error: --config-dir {tmp_path / 'missing'}: no such folder"]


def test_a_sweep_trial_with_preflight_composes_its_config_once(tmp_path: Path, monkeypatch) -> None:
    """The pre-flight estimate and the trial share one composed config (it was composed twice)."""
    import hydra

    from vramsweep.record.result import new_result
    from vramsweep.sweeper.settings import Objective
    from vramsweep.sweeper.trialproc import execute

    composed: list[list[str]] = []
    real = hydra.compose

    def counting(*a, **kw):
        composed.append(list(kw.get("overrides") or []))
        return real(*a, **kw)

    seen = {}

    def fake_run_trial(cfg, **kw):
        seen["r"] = int(cfg.adapter.r)
        return new_result(status="ok", overrides=kw.get("overrides"))

    monkeypatch.setattr(hydra, "compose", counting)
    monkeypatch.setattr("vramsweep.trial.run_trial", fake_run_trial)
    spec = trial_spec(
        tmp_path,
        overrides=["adapter.r=4", "hardware.budget_gib=64"],
        objectives=[Objective("peak_memory_bytes", "minimize")],
        preflight=True,
    )
    result = execute(spec)
    assert result["status"] == "ok" and seen == {"r": 4}
    assert composed == [["adapter.r=4", "hardware.budget_gib=64"]]
    # the rules still run on the passed config: a bad combination is the trial's ConfigError
    spec.overrides = ["kernels=unsloth", "vocab=sliced"]
    spec.result_path = str(tmp_path / "0001.json")
    assert execute(spec)["status"] == "unsupported"


@pytest.mark.torchfree
def test_pick_writes_the_experiment_into_the_users_conf_dir(tmp_path: Path, monkeypatch, capsys) -> None:
    from _reports import result, write_sweep

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR", raising=False)
    folder = write_sweep(tmp_path / "sw", [result(0, ["adapter.r=8"], peak=1.0, tps=10, loss=2.0)])
    before = sorted(p.name for p in (packaged_conf_dir()).iterdir())
    assert main(["pick", str(folder), "--budget-gib", "4", "--name", "prod"]) == 0
    assert "train it: vramsweep train +experiment=prod" in capsys.readouterr().out
    assert (project / "conf" / "experiment" / "prod.yaml").is_file()
    assert sorted(p.name for p in packaged_conf_dir().iterdir()) == before  # never into the package
    assert compose(["+experiment=prod"], rules="none").adapter.r == 8
    other = tmp_path / "other conf"
    assert main(["pick", str(folder), "--budget-gib", "4", "--name", "p2", "--config-dir", str(other)]) == 0
    assert f"train it: vramsweep train --config-dir '{other}' +experiment=p2" in capsys.readouterr().out
    assert (other / "experiment" / "p2.yaml").is_file()


@pytest.mark.torchfree
def test_a_bad_conf_dir_is_one_line_and_pick_creates_nothing_on_bad_input(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VRAMSWEEP_CONFIG_DIR", str(tmp_path / "gone"))
    with pytest.raises(SystemExit) as done:  # the help still lists the (packaged) options
        main(["train", "--help"])
    assert done.value.code == 0 and "rtx4080_16gb" in capsys.readouterr().out
    assert main(["train", "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vramsweep train: error: VRAMSWEEP_CONFIG_DIR={tmp_path / 'gone'}: no such folder"]
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR")
    new = tmp_path / "new conf"
    assert main(["pick", str(tmp_path / "no sweep"), "--budget-gib", "4", "--config-dir", str(new)]) == 2
    assert not new.exists() and not (tmp_path / "conf").exists()
