"""A production run's length: ``train.epochs`` passes over the examples (docs/RUNS.md); the LR schedule,
the batches and the eval lines span the whole run."""

from __future__ import annotations

import json

import pytest

from conftest import FAST
from vramsweep.config import compose
from vramsweep.production.length import apply_epochs, steps_for_epochs
from vramsweep.trial import run_trial


def test_steps_for_epochs_counts_examples_per_optimizer_step():
    assert steps_for_epochs(10, 1, 2, 1) == 5
    assert steps_for_epochs(10, 2, 2, 2) == 5  # 4 examples per step
    assert steps_for_epochs(10, 0.5, 4, 1) == 2  # a partial last step counts whole
    assert steps_for_epochs(1, 1, 8, 8) == 1


def test_epochs_set_the_schedule_length():
    from vramsweep.knobs import build_scheduler

    cfg = compose(["train.epochs=3", "train.micro_batch=2", "train.grad_accum=1", "train.steps=5"])
    assert apply_epochs(cfg, 8) == 12 and cfg.train.steps == 12
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(cfg, opt)
    lrs = []
    for _ in range(12):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[-1] == pytest.approx(0.0, abs=1e-9) and lrs[5] > 0.3  # cosine over 12 steps, not 5
    assert apply_epochs(compose([]), 8) is None  # steps rule when epochs=0


@pytest.mark.usefixtures("embedded_model_dir")
def test_a_run_of_half_an_epoch_trains_half_the_examples(tmp_path, capsys):
    over = [*FAST, f"results_dir={tmp_path}", "data.num_docs=2", "train.micro_batch=4", "train.epochs=0.5"]
    over += ["train.eval_every=2"]
    res = run_trial(compose(over), result_path=tmp_path / "run" / "result.json", overrides=over)
    assert res["status"] == "ok", res["reason"]
    got = res["meta"]["steps_from_epochs"]
    n_train = res["meta"]["data"]["train"]["count"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "losses.jsonl").read_text().splitlines()]
    assert len(rows) == got["steps"] and got["epochs"] == 0.5
    assert (
        got["steps"] == steps_for_epochs(n_train, 0.5, 4, 1) and got["steps"] != 4
    )  # not FAST's train.steps
    err = capsys.readouterr().err
    assert f"step 2/{got['steps']}  eval_loss" in err
