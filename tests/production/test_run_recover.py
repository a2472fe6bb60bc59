"""Checkpoints that recover (docs/RUNS.md "Checkpoints"): a checkpoint that fails to load is named in one
line, moved aside, and the newest older complete one is used; staging folders of dead writers are removed at
the next start; a checkpoint write that fails (disk full) leaves no staging folder holding the space."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from conftest import FAST
from vramsweep.cli import main
from vramsweep.production.checkpoint import BROKEN_PREFIX, checkpoint_dirs

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _args(run: Path, *extra: str) -> list[str]:
    return [
        "train",
        *FAST,
        "train.steps=6",
        f"results_dir={run.parent}",
        f"train.output_dir={run}",
        "train.save_every=2",
        "train.keep_checkpoints=2",
        *extra,
    ]


def _losses(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "losses.jsonl").read_text().splitlines()]


def test_a_truncated_newest_checkpoint_is_named_and_the_older_one_used(tmp_path, monkeypatch, capsys):
    """Before: a SafetensorError that named no file stopped the run; the older complete one was ignored."""
    run = tmp_path / "run"
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@5")
    assert main(_args(run)) == 1
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    newest, older = checkpoint_dirs(run)[-1], checkpoint_dirs(run)[-2]
    assert (newest.name, older.name) == ("step-00000004", "step-00000002")
    f = newest / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # torn by a crash of the storage, not by us
    # a dead writer's staging folder (kill -9 during a checkpoint write)
    staging = run / "checkpoints" / ".staging-step-00000006-999999"
    staging.mkdir()
    (staging / "trainable.safetensors").write_bytes(b"\0" * 4096)
    capsys.readouterr()

    assert main(_args(run, "train.resume=auto")) == 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "cannot be loaded" in line]
    assert len(said) == 1 and str(newest) in said[0] and f"resuming from {older}" in said[0], err
    assert any("removed 1 staging folder" in line and staging.name in line for line in err), err
    assert not staging.exists()
    res = json.loads((run / "result.json").read_text())
    assert res["status"] == "ok" and res["meta"]["resumed_from"]["next_step"] == 2
    assert res["meta"]["resumed_from"]["skipped"][0]["checkpoint"] == str(newest)
    assert _losses(run) == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / f"{BROKEN_PREFIX}step-00000004").is_dir()  # kept aside, never counted
    assert [p.name for p in checkpoint_dirs(run)] == ["step-00000004", "step-00000006"]  # the new ones


def test_a_checkpoint_write_that_fails_leaves_no_staging_folder(tmp_path, monkeypatch):
    """Before: a disk-full checkpoint left .staging-step-N-<pid>/ holding the space that ran out."""
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    monkeypatch.setattr("torch.save", full)
    run = tmp_path / "run"
    over = [o for o in _args(run)[1:]]
    res = run_trial(compose(over), result_path=run / "result.json", overrides=over)
    assert res["status"] == "error" and "no space left" in res["reason"].lower(), res["reason"]
    assert not [p for p in os.listdir(run / "checkpoints") if p.startswith(".staging")]
