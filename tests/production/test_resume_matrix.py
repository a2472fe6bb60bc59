"""Exact resume on every stack users train (issue 49, items 2 and 3): adapter dtype (fp32 / compute with
fp32 masters) x optimizer (adamw / adamw_8bit / paged_adamw_8bit) x base (none / nf4), with dropout (the RNG
state matters) and an evaluation before and after the checkpoint. A run that dies before step 3 and resumes
from its step-2 checkpoint ends with the adapter bitwise equal to the uninterrupted run's and the same
per-step losses (CPU). Before: compute adapters lost the training before the checkpoint (the fp32 masters
were rebuilt from the fresh adapter), and an nf4 base was repacked by the uninterrupted run's initial eval
only. One representative stack (compute + adamw_8bit + nf4) runs in the fast suite, the whole matrix under ``slow``."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import FAST
from vramsweep.config import compose
from vramsweep.production.checkpoint import checkpoint_dirs
from vramsweep.trial import run_trial

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

# train.threads pinned: threads=auto picks the count from the load at trial start, and a different count can
# change float reduction order (the uninterrupted and the resumed run then differ in the last bits)
RUN = [
    "train.threads=1",
    "train.steps=4",
    "train.warmup_steps=1",
    "adapter.dropout=0.1",
    "train.eval_every=2",
    "adapter.r=4",
]
FAST_STACKS = {("compute", "adamw_8bit", "nf4")}  # both fixes at once; ~1 min of CPU per stack
STACKS = [
    pytest.param(*s, marks=() if s in FAST_STACKS else pytest.mark.slow, id="-".join(s))
    for s in itertools.product(
        ["fp32", "compute"], ["adamw", "adamw_8bit", "paged_adamw_8bit"], ["none", "nf4"]
    )
]


def _run(out, stack, *extra):
    over = [*FAST, *RUN, *stack, f"results_dir={out.parent}", f"train.output_dir={out}", *extra]
    return run_trial(compose(over), result_path=out / "result.json", overrides=over)


def _adapter(run):
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _losses(run):
    import json

    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("dtype", "optimizer", "quant"), STACKS)
def test_stopped_and_resumed_run_is_bitwise_the_uninterrupted_one(
    tmp_path, monkeypatch, dtype, optimizer, quant
):
    stack = [f"adapter.dtype={dtype}", f"optimizer={optimizer}", f"quant={quant}"]
    whole = _run(tmp_path / "whole", stack)
    assert whole["status"] == "ok", whole["reason"]
    ckpt = ["train.save_every=2", "train.keep_checkpoints=1"]
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@3")  # dies before step 3's first micro-batch
    cut = _run(tmp_path / "cut", stack, *ckpt)
    assert cut["status"] == "error" and [p.name for p in checkpoint_dirs(tmp_path / "cut")] == [
        "step-00000002"
    ]
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    res = _run(tmp_path / "cut", stack, *ckpt, "train.resume=auto")
    assert res["status"] == "ok", res["reason"]
    assert res["meta"]["resumed_from"]["next_step"] == 2
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    a, b = _adapter(tmp_path / "cut"), _adapter(tmp_path / "whole")
    assert a.keys() == b.keys()
    off = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not off, f"{len(off)}/{len(a)} adapter tensors differ, e.g. {sorted(off.items())[:3]}"
    assert res["metrics"]["eval_loss"] == whole["metrics"]["eval_loss"]
    assert res["metrics"]["intermediate_eval"] == whole["metrics"]["intermediate_eval"]
