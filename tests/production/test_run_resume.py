"""Checkpoints and exact resume of a production run (docs/RUNS.md): a run stopped part-way and resumed with
``train.resume=auto`` ends with the adapter bitwise equal to the uninterrupted run's and the same per-step
losses; a torn checkpoint is skipped; a changed config refuses, naming the keys."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST
from vramsweep.cli import main
from vramsweep.config import compose
from vramsweep.production.checkpoint import COMPLETE, checkpoint_dirs, latest_checkpoint
from vramsweep.trial import run_trial

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

# dropout: the RNG state matters. train.threads pinned: threads=auto picks the count from the load at each
# run's start, and the uninterrupted run and the stopped one are separate starts (a different count sums the
# matmuls differently: the losses differed from the first resumed step under the CI's parallel suites)
STEPS = ["train.steps=6", "train.warmup_steps=1", "adapter.dropout=0.1", "train.threads=1"]
EVALS = ["train.eval_every=2"]  # an evaluation before the step-2 checkpoint, two after it


def _without_data_line(err: str) -> list[str]:
    """stderr's lines but the pre-flight's one ``data:`` summary line: the pre-flight passed (it says the line
    then), and the run folder's refusal comes after it."""
    lines = err.strip().splitlines()
    assert sum(ln.startswith("data: ") for ln in lines) == 1, lines
    return [ln for ln in lines if not ln.startswith("data: ")]


def _run(out: Path, *extra: str) -> dict:
    over = [*FAST, *STEPS, f"results_dir={out.parent}", f"train.output_dir={out}", *extra]
    return run_trial(compose(over), result_path=out / "result.json", overrides=over)


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _losses(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]


def _same_adapter(a: Path, b: Path) -> None:
    import torch

    ta, tb = _adapter(a), _adapter(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k  # bitwise


def test_a_run_stopped_and_resumed_ends_bitwise_equal(tmp_path, monkeypatch):
    whole = _run(tmp_path / "whole", *EVALS)
    assert whole["status"] == "ok", whole["reason"]
    assert not (tmp_path / "whole" / "checkpoints").exists()  # save_every=0: no periodic checkpoint

    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@3")  # the process "dies" before step 3's first micro-batch
    cut = _run(tmp_path / "cut", "train.save_every=2", "train.keep_checkpoints=1", *EVALS)
    assert cut["status"] == "error"
    ckpts = checkpoint_dirs(tmp_path / "cut")
    assert [p.name for p in ckpts] == ["step-00000002"]
    for name in ("trainable.safetensors", "train_state.pt", "state.json", COMPLETE):
        assert (ckpts[0] / name).is_file()
    # a torn newer checkpoint (killed before its marker) is skipped
    torn = ckpts[0].parent / "step-00000004"
    torn.mkdir()
    (torn / "trainable.safetensors").write_bytes(b"\0" * 10)
    assert latest_checkpoint(tmp_path / "cut") == ckpts[0]

    monkeypatch.delenv("VRAMSWEEP_FAULT")
    res = _run(
        tmp_path / "cut", "train.save_every=2", "train.keep_checkpoints=1", "train.resume=auto", *EVALS
    )
    assert res["status"] == "ok", res["reason"]
    assert res["meta"]["resumed_from"]["next_step"] == 2
    assert [r["loss"] for r in _losses(tmp_path / "cut")] == [r["loss"] for r in _losses(tmp_path / "whole")]
    assert [r["step"] for r in _losses(tmp_path / "cut")] == [1, 2, 3, 4, 5, 6]
    _same_adapter(tmp_path / "cut", tmp_path / "whole")
    assert res["metrics"]["initial_eval_loss"] == whole["metrics"]["initial_eval_loss"]
    assert res["metrics"]["eval_loss"] == whole["metrics"]["eval_loss"]
    # the evaluations before the checkpoint are the run's too (docs/RUNS.md): 2 and 4 as uncut (6: the final)
    assert [e["step"] for e in whole["metrics"]["intermediate_eval"]] == [2, 4]
    assert res["metrics"]["intermediate_eval"] == whole["metrics"]["intermediate_eval"]
    # the newest K=1 complete checkpoint kept
    assert [p.name for p in checkpoint_dirs(tmp_path / "cut")] == ["step-00000006"]
    # what checkpointing cost is recorded (bench/checkpoint_cost.py reads it): the resumed run wrote 2
    cost = res["meta"]["checkpoints"]
    assert cost["count"] == 2 and cost["seconds"] > 0
    final = checkpoint_dirs(tmp_path / "cut")[0]
    assert cost["bytes"] == sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    assert whole["meta"]["checkpoints"] == {"count": 0, "seconds": 0.0, "bytes": 0}


def test_a_resumed_run_reopens_its_wandb_run(tmp_path, monkeypatch):
    """The checkpoint keeps the W&B run id; ``train.resume=auto`` reopens that run (before: a second run)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    wb = ["logger=wandb", f"logger.dir={tmp_path / 'wb'}", "train.save_every=2", "train.keep_checkpoints=1"]
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@3")
    cut = _run(tmp_path / "run", *wb)
    assert cut["status"] == "error"
    first = cut["meta"]["wandb"]["run_id"]
    state = json.loads((latest_checkpoint(tmp_path / "run") / "state.json").read_text())
    assert state["wandb_run_id"] == first
    assert state["threads"] == cut["meta"]["threads"]["threads"]  # the count a threads=auto resume keeps
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    res = _run(tmp_path / "run", *wb, "train.resume=auto")
    assert res["status"] == "ok", res["reason"]
    assert res["meta"]["wandb"]["run_id"] == first and res["meta"]["wandb"]["resumed_run_id"] == first


def test_resume_with_a_changed_config_refuses_naming_the_keys(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    base = [*FAST, *STEPS, f"results_dir={tmp_path}", f"train.output_dir={run}"]
    from omegaconf import OmegaConf

    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(base)))
    code = main(["train", *base, "train.lr=0.001", "adapter.r=8", "train.resume=auto"])
    err = _without_data_line(capsys.readouterr().err)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("vramsweep train: error:") and "train.lr" in err[0] and "adapter.r" in err[0]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # nothing written


def _cli(out: Path, *extra: str) -> subprocess.Popen:
    over = [*FAST, *STEPS, "train.steps=10", f"results_dir={out.parent}", f"train.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src"), "VRAMSWEEP_PROGRESS": "0"}
    cmd = [sys.executable, "-m", "vramsweep.cli", "train", *over, "train.save_every=1", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_is_exact(tmp_path):
    """kill -9 at >= 5 random moments, each time resumed with train.resume=auto: the final adapter is bitwise
    the uninterrupted run's and the per-step losses are the same. A SIGTERM checkpoints and stops."""
    whole = _cli(tmp_path / "whole")
    assert whole.wait(timeout=900) == 0, whole.stderr.read().decode()[-2000:]
    rng = random.Random(1234)
    run, kills = tmp_path / "cut", 0
    while not (run / "run.json").is_file():
        p, killed = _cli(run, "train.resume=auto"), False
        if kills < 5:
            # the import and build take ~10-30 s on a busy machine: most kills land in training
            time.sleep(rng.uniform(12.0, 40.0))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills, killed = kills + 1, True
        p.wait(timeout=900)
        assert killed or p.returncode == 0, p.stderr.read().decode()[-2000:]
    assert [r["loss"] for r in _losses(run)] == [r["loss"] for r in _losses(tmp_path / "whole")]
    _same_adapter(run, tmp_path / "whole")

    term = tmp_path / "term"
    p = _cli(term, "train.steps=40")
    while latest_checkpoint(term) is None and p.poll() is None:
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1 and b"preempted: SIGTERM" in out, out.decode()[-1000:]
    assert latest_checkpoint(term) is not None
