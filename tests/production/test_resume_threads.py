"""A resumed run with ``train.threads=auto`` keeps the torch thread count it started with (CPU bitwise resume
holds only on the same count), and its checkpoints record that count."""

from __future__ import annotations

import torch

from vramsweep.config.compose import compose
from vramsweep.production.run import keep_run_threads


def _meta(threads: int) -> dict:
    return {"threads": {"setting": "auto", "threads": threads, "why": "load"}, "timing_conditions": {}}


def test_auto_resumes_on_the_checkpoints_thread_count():
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    try:
        meta = _meta(before)
        assert keep_run_threads(compose([], rules="config"), {"threads": other}, meta) == other
        assert torch.get_num_threads() == other
        assert meta["threads"]["threads"] == other
        assert meta["timing_conditions"]["torch_threads"] == other
        assert "resumed" in meta["threads"]["why"]
    finally:
        torch.set_num_threads(before)


def test_a_fixed_count_or_a_checkpoint_without_one_changes_nothing():
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    meta = _meta(before)
    assert keep_run_threads(compose(["train.threads=3"], rules="config"), {"threads": other}, meta) is None
    assert keep_run_threads(compose([], rules="config"), {}, meta) is None
    assert keep_run_threads(compose([], rules="config"), {"threads": before}, meta) is None
    assert torch.get_num_threads() == before and meta == _meta(before)
