"""One owner per run folder (docs/RUNS.md "Who owns a run folder"): a second start while a run holds the
folder exits 2 naming the holder; a finished or stopped run is never overwritten by ``train.resume=never``;
``train.resume=auto`` on a finished run says it is complete and changes nothing (the folder hashed before and
after)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _run_folders import folder_hash
from conftest import FAST
from vramsweep.cli import main
from vramsweep.production.owner import LOCK_FILE, RunFolderError, claim

SRC = str(Path(__file__).parents[2] / "src")


def _without_data_line(err: str) -> list[str]:
    """stderr's lines but the pre-flight's one ``data:`` summary line: the pre-flight passed (it says the line
    then), and the run folder's refusal comes after it."""
    lines = err.strip().splitlines()
    assert sum(ln.startswith("data: ") for ln in lines) == 1, lines
    return [ln for ln in lines if not ln.startswith("data: ")]


def _args(run: Path, *extra: str) -> list[str]:
    return ["train", *FAST, f"results_dir={run.parent}", f"train.output_dir={run}", *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, embedded_model_dir) -> Path:
    run = tmp_path_factory.mktemp("owner") / "run"
    assert main(_args(run, "train.save_every=2")) == 0
    return run


def test_a_finished_run_with_resume_never_is_refused_and_nothing_changes(finished, capsys):
    """Before: the re-run truncated losses.jsonl, rewrote config.yaml and result.json and died."""
    before = folder_hash(finished)
    capsys.readouterr()
    assert main(_args(finished, "train.save_every=2")) == 2
    err = _without_data_line(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("vramsweep train: error:"), err
    assert (
        "holds a finished run" in err[0]
        and "train.resume=auto" in err[0]
        and "new train.output_dir" in err[0]
    )
    assert folder_hash(finished) == before


def test_resume_auto_on_a_finished_run_says_complete_and_changes_nothing(finished, capsys):
    """Before: it trained again for minutes and rewrote result.json with null throughput."""
    before = folder_hash(finished)
    capsys.readouterr()
    assert main(_args(finished, "train.save_every=2", "train.resume=auto")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "holds a complete run" in out[0] and "nothing changed" in out[0], out
    assert str(finished / "result.json") in out[0]
    assert folder_hash(finished) == before


def test_a_stopped_run_with_resume_never_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("step 2\n")
    before = folder_hash(run)
    assert main(_args(run)) == 2
    err = _without_data_line(capsys.readouterr().err)
    assert len(err) == 1 and "holds a stopped run" in err[0] and str(ckpt) in err[0], err
    assert "train.resume=auto continues it" in err[0]
    assert folder_hash(run) == before


def test_a_second_start_while_a_run_holds_the_folder_exits_2_naming_the_holder(tmp_path, capsys):
    """Before: two runs started into one folder both trained (losses.jsonl steps 1,1,2,3,2,...)."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from vramsweep.production.owner import claim; "
            f"c = claim({str(run)!r}, 'never'); print('held', flush=True); sys.stdin.read()",
        ],
        env={**os.environ, "PYTHONPATH": SRC},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = folder_hash(run)
        for resume in ("never", "auto"):
            assert main(_args(run, f"train.resume={resume}")) == 2
            err = _without_data_line(capsys.readouterr().err)
            assert len(err) == 1 and "is in use" in err[0], err
            assert f"pid {holder.pid} on host {socket.gethostname()} since " in err[0]
        assert folder_hash(run) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # the holder ended (its lock went with it): the folder can be claimed
    claim(run, "never").release()


def test_the_lock_is_held_for_the_whole_run_and_records_the_holder(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    seen = {}

    def fake_run_trial(cfg, *, result_path, overrides):
        seen["holder"] = json.loads((run / LOCK_FILE).read_text())
        with pytest.raises(RunFolderError, match="is in use"):
            claim(run, "never")  # a second start during the run
        return {"status": "error", "reason": "fake", "metrics": {}, "meta": {}}

    monkeypatch.setattr("vramsweep.trial.run_trial", fake_run_trial)
    assert main(_args(run)) == 1
    assert seen["holder"]["pid"] == os.getpid() and seen["holder"]["host"] == socket.gethostname()
    assert seen["holder"]["started"]
    claim(run, "never").release()  # released when the run ended
