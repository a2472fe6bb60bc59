"""``report`` and ``pick`` on a sweep whose trials trained on different data (a sweep resumed after its file
changed): both flag it, naming the trials of each hash; ``pick`` pins the winner's data by absolute path
with its sha256 beside it (``data.path_sha256``), warns when the file changed or went since the sweep, and
the pinned experiment composes to a config the production run checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _reports import _conf_copy, result, write_sweep
from vramsweep.config import compose
from vramsweep.report import run_pick, run_report

pytestmark = pytest.mark.torchfree


def _sweep(tmp_path: Path, data: Path, hashes: list[str]) -> Path:
    res = []
    for n, h in enumerate(hashes):
        over = ["quant=none", f"adapter.r={8 * (n + 1)}", "data=jsonl", "data.path=chats.jsonl"]
        r = result(n, over, peak=1.0, tps=100.0 + n, loss=2.0 - 0.1 * n)
        r["config"]["data"] = {"name": "jsonl", "source": "jsonl", "path": "chats.jsonl"}
        r["meta"]["data_sources"] = {"data.path": {"path": str(data), "sha256": h}}
        res.append(r)
    return write_sweep(tmp_path / "sw", res)


def test_report_and_pick_flag_trials_trained_on_different_data(tmp_path, monkeypatch, capsys):
    conf = _conf_copy(tmp_path, monkeypatch)
    data = tmp_path / "project" / "chats.jsonl"
    data.write_text('{"messages": []}\n')
    now = hashlib.sha256(data.read_bytes()).hexdigest()
    folder = _sweep(tmp_path, data, ["a" * 64, "a" * 64, now])
    assert run_report(str(folder)) == 0
    err = " ".join(capsys.readouterr().err.split())  # the terminal wraps lines
    assert (
        "trained on 2 different data files" in err and "(trials 0000, 0001)" in err and "(trials 0002)" in err
    )
    assert "2 different data files" in (folder / "ablation.md").read_text()

    assert run_pick(str(folder), budget_gib=2, name="p", conf_dir=str(conf)) == 0
    err = " ".join(capsys.readouterr().err.split())  # the terminal wraps lines
    assert "trained on 2 different data files" in err
    exp = OmegaConf.load(conf / "experiment" / "p.yaml")
    assert exp.data.path == str(data) and exp.data.path_sha256 == now  # trial 2 won (lowest loss)
    cfg = compose(["+experiment=p"], conf_dir=conf, rules="none")
    assert cfg.data.path == str(data) and cfg.data.path_sha256 == now


def test_pick_warns_when_the_winners_file_changed_and_pins_the_sweeps_hash(tmp_path, monkeypatch, capsys):
    conf = _conf_copy(tmp_path, monkeypatch)
    data = tmp_path / "project" / "chats.jsonl"
    data.write_text('{"messages": []}\n')
    folder = _sweep(tmp_path, data, ["b" * 64])
    assert run_pick(str(folder), budget_gib=2, name="p", conf_dir=str(conf)) == 0
    err = " ".join(capsys.readouterr().err.split())  # the terminal wraps lines
    assert f"data.path={data} changed since the sweep" in err and "bbbbbbbbbbbb" in err
    pinned = conf / "experiment" / "p.yaml"
    assert OmegaConf.load(pinned).data.path_sha256 == "b" * 64
    assert OmegaConf.load(pinned).data.path == str(data)  # absolute: composes the same from any folder
    assert f"# data.path: {data} (absolute, resolved; the sweep typed 'chats.jsonl')" in pinned.read_text()
    data.unlink()
    assert run_pick(str(folder), budget_gib=2, name="q", conf_dir=str(conf)) == 0
    assert f"data.path={data} is missing" in " ".join(capsys.readouterr().err.split())
    assert "data.path_sha256" in (folder / "production.md").read_text()
    assert json.loads((folder / "trials" / "0000.json").read_text())["trial"] == 0
