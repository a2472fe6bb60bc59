"""Progress a log can show (docs/RUNS.md "Length"): a production run whose output is not a terminal prints a
plain line on stderr at its first step, every ``train.progress_every_steps`` steps or
``train.progress_every_s`` seconds and at its last (step/total, loss, tokens/s, peak, ETA); a resumed run
says from which step and checkpoint; ``meta.mfu.reason`` names why a CPU run has no MFU."""

from __future__ import annotations

import io
import json
import re

import pytest

from conftest import FAST
from vramsweep.cli import main
from vramsweep.production.progress import ProgressLines, duration


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_lines_come_every_n_steps_or_m_seconds_with_step_loss_speed_peak_and_eta():
    clock, out = _Clock(), io.StringIO()
    p = ProgressLines(
        10,
        0,
        every_steps=4,
        every_s=25,
        tokens_per_s=lambda: 1234.5,
        peak_bytes=lambda: 3 * 2**20,
        clock=clock,
        out=out,
    )
    for step in range(10):
        clock.t += 10.0  # 10 s a step: the 25 s rule fires between the 4-step ones
        p.on_loss(step, 2.0 - step / 10)
    lines = out.getvalue().splitlines()
    steps = [int(re.search(r"step (\d+)/10", line).group(1)) for line in lines]
    assert steps == [1, 4, 7, 8, 10], lines
    assert lines[0] == "vramsweep train: step 1/10  loss 2.0000  tokens/s 1,234  peak 3.0 MiB  ETA 1m30s"
    assert lines[-1].endswith("done in 1m40s")
    assert duration(3725) == "1h02m" and duration(42) == "42s"


def test_no_rule_still_prints_the_first_and_last_step():
    clock, out = _Clock(), io.StringIO()
    p = ProgressLines(
        5,
        2,
        every_steps=0,
        every_s=0,
        tokens_per_s=lambda: None,
        peak_bytes=lambda: None,
        clock=clock,
        out=out,
    )
    for step in range(2, 5):
        clock.t += 1
        p.on_loss(step, 1.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[3] for line in lines] == ["3/5", "5/5"], lines
    assert "tokens/s n/a (warm-up)" in lines[0]


@pytest.mark.usefixtures("embedded_model_dir")
def test_a_run_into_a_log_prints_progress_and_says_it_resumed(tmp_path, monkeypatch, capsys):
    """Before: nothing from start to summary when the output is not a terminal; a resume said nothing."""
    monkeypatch.delenv("VRAMSWEEP_PROGRESS", raising=False)
    run = tmp_path / "run"
    args = [
        "train",
        *FAST,
        f"results_dir={tmp_path}",
        f"train.output_dir={run}",
        "train.save_every=2",
        "train.progress_every_steps=2",
        "train.progress_every_s=0",
    ]
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@3")
    assert main(args) == 1
    err = capsys.readouterr().err  # not a terminal under capsys
    assert re.findall(r"step (\d)/4", err) == ["1", "2"], err
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    assert main([*args, "train.resume=auto"]) == 0
    err = capsys.readouterr().err.splitlines()
    ckpt = run / "checkpoints" / "step-00000002"
    assert f"vramsweep train: resumed from step 2 of 4 (checkpoint {ckpt})" in err, err
    lines = [line for line in err if re.match(r"vramsweep train: step \d/4  loss ", line)]
    assert [line.split()[3] for line in lines] == ["3/4", "4/4"], err
    assert "tokens/s" in lines[-1] and "peak" in lines[-1] and "done in" in lines[-1]
    res = json.loads((run / "result.json").read_text())
    assert res["metrics"].get("mfu") is None and res["meta"]["mfu"]["reason"].startswith("no CUDA device")
