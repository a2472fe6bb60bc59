"""bench/step_time.py's host vs device split (issue 25.4): what the GPU run reads the fixed per-step cost
from (goal: step(1,024) <= 0.35 x step(4,096))."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_time", ROOT / "bench" / "step_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_vs_device_split(bench):
    # a host-bound CUDA step: the host issues for 0.62 s and waits 0.03 s for the device
    phases = {"h2d": 0.01, "forward": 0.25, "backward": 0.3, "optimizer": 0.05, "sync_wait": 0.03,
              "other": 0.01, "step": 0.65, "host_bound": True}  # fmt: skip
    split = bench.host_device_split(phases)
    assert split["host_s"] == pytest.approx(0.62) and split["wait_s"] == pytest.approx(0.03)
    assert split["host_share"] == pytest.approx(0.62 / 0.65)
    assert "host 0.6200 s + device wait 0.0300 s of 0.6500 s/step (host 95%)" == bench._split_text(split)
    assert bench.host_device_split({}) is None and bench._split_text(None) == "host vs device: n/a"
