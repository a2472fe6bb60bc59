"""``pick`` writes a recipe and refuses to rank eval losses of random weights (docs/RUNS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _reports import result, write_sweep
from vramsweep.report import run_pick

pytestmark = pytest.mark.torchfree


def _arch_config(overrides: list[str], path: str | None) -> dict:
    return {"model": {"name": "qwen3_8b", "source": "arch", "path": path}, "hardware": {"budget_gib": 16}}


def test_prefer_quality_refuses_random_weight_eval_losses(tmp_path: Path, capsys) -> None:
    res = [
        result(0, ["quant=nf4"], peak=9.0, tps=700, loss=11.9, config=_arch_config([], None)),
        result(1, ["quant=none"], peak=12.0, tps=900, loss=11.8, config=_arch_config([], None)),
    ]
    folder = write_sweep(tmp_path / "sw", res)
    conf = tmp_path / "conf"
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefer quality" in err[0] and "random weights" in err[0], err
    assert "model=qwen3_8b without model.path" in err[0]
    assert not (conf / "experiment").exists() or not any((conf / "experiment").iterdir())


def test_prefer_speed_still_ranks_random_weight_trials(tmp_path: Path, capsys) -> None:
    res = [result(0, ["quant=nf4"], peak=9.0, tps=700, loss=11.9, config=_arch_config([], None))]
    folder = write_sweep(tmp_path / "sw", res)
    run_pick(str(folder), budget_gib=16, prefer="speed", conf_dir=str(tmp_path / "conf"))
    assert "random weights" not in capsys.readouterr().err  # speed and memory are real figures
