"""The benches that compare arms: the order rotates every round, threads are pinned in every child, a ratio
is the median of per-round paired ratios with its min-max, and the thread bench's verdict can fail."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the benches import their helpers as scripts do

import _arms  # noqa: E402


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.torchfree
@given(n=st.integers(1, 6))
def test_every_arm_runs_in_every_position_equally_often(n):
    arms = [f"a{i}" for i in range(n)]
    positions = Counter((arm, i) for rnd in range(n) for i, arm in enumerate(_arms.order(arms, rnd)))
    assert all(positions[(arm, i)] == 1 for arm in arms for i in range(n))
    assert _arms.order(["A", "B"], 0) == ["A", "B"] and _arms.order(["A", "B"], 1) == ["B", "A"]


@pytest.mark.torchfree
def test_ratios_are_paired_by_round_and_printed_with_their_spread():
    assert _arms.paired_ratios([2.0, None, 3.0, 4.0], [1.0, 1.0, None, 2.0]) == [2.0, 2.0]
    assert _arms.spread([1.2, 0.9, 1.0]) == "1.000 [0.900-1.200] (3 rounds)"
    assert _arms.spread([]).startswith("n/a")
    assert _arms.spread([0.1], "seed") == "0.100 [0.100-0.100] (1 seed)"


@pytest.mark.torchfree
def test_children_get_pinned_thread_pools():
    env = _arms.child_env(1)
    assert all(env[k] == "1" for k in _arms.THREAD_ENV)


@pytest.mark.torchfree
def test_thread_bench_compares_auto_with_the_best_fixed_arm_and_can_fail():
    threads = _bench("threads")
    walls = {"auto": [10.0, 12.0], "1": [10.0, 11.0], "2": [40.0, 52.0]}
    assert threads.best_fixed(walls, ["1", "2"]) == "1"
    assert threads.verdict(_arms.paired_ratios(walls["auto"], walls["1"]), 1.30) == "PASS"
    assert threads.verdict(_arms.paired_ratios(walls["2"], walls["1"]), 1.30) == "FAIL"
    assert threads.verdict([], 1.3) == "n/a"
    assert threads.TARGETS == {"busy": 1.30, "idle": 1.10}


@pytest.mark.torchfree
def test_overhead_bench_pins_threads_and_rotates_its_arms():
    text = (ROOT / "bench" / "overhead.py").read_text()
    assert "order(engines, rnd)" in text and "child_env(a.threads)" in text and "pin_torch(a.threads)" in text


@pytest.mark.torchfree
@pytest.mark.parametrize("shape, best_rank", [("rank_helps", "64"), ("rank_hurts", "4"), ("unrelated", None)])
def test_fake_landscapes_put_the_best_config_where_they_say(monkeypatch, shape, best_rank):
    """The sweep-efficiency bench's landscapes: on rank_helps the best config is the highest rank (the
    highest memory), on rank_hurts the lowest, on unrelated rank and precision do not move the loss
    beyond the per-config draw."""
    import json

    sys.path.insert(0, str(ROOT / "tests"))
    import fakes

    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"landscape": shape}))
    loss = {
        (q, r): fakes.landscape({"quant": q, "adapter.r": r, "train.lr": "1e-3"})["eval_loss"]
        for q in ("none", "nf4")
        for r in ("4", "16", "64")
    }
    if best_rank is None:
        assert max(loss.values()) - min(loss.values()) <= 2 * 0.05  # the draw's range only
    else:
        assert min(loss, key=loss.get) == ("none", best_rank)
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"landscape": "nope"}))
    with pytest.raises(ValueError, match="rank_hurts"):
        fakes.landscape({"adapter.r": "4"})


def test_packing_bench_arms_train_the_same_examples_per_step():
    """bench/packing.py compares at equal optimizer steps and tokens: each step of every arm holds the
    examples of the same packed rows; grouped sorts them by length, padded does not, packed is one
    micro-batch of rows."""
    packing = _bench("packing")
    examples = packing.chat_like(40, 3, 500, hi=256)
    plan = packing.step_plan(examples, 256, 2, seed=0)
    flat = sorted(e.input_ids for step in plan for e in step)
    assert flat == sorted(e.input_ids for e in examples)  # every example once
    for k, step in enumerate(plan):
        per_arm = {
            arm: packing.arm_micro_batches(arm, step, 2, 256, k) for arm in ("padded", "grouped", "packed")
        }
        tokens = {
            arm: sorted(len(e.input_ids) for m in ms for e in m)
            for arm, ms in per_arm.items()
            if arm != "packed"
        }
        assert tokens["padded"] == tokens["grouped"] == sorted(len(e.input_ids) for e in step)
        assert len(per_arm["packed"]) == 1 and sum(len(r.input_ids) for r in per_arm["packed"][0]) == sum(
            len(e.input_ids) for e in step
        )
        slots = {
            arm: sum(max(len(e.input_ids) for e in m) * len(m) for m in per_arm[arm])
            for arm in ("padded", "grouped")
        }
        assert slots["grouped"] <= slots["padded"]  # length grouping never pads more
        widths = [max(len(e.input_ids) for e in m) for m in per_arm["grouped"]]
        assert widths == sorted(widths, reverse=True)  # the widest micro-batch first


@pytest.mark.torchfree
def test_sweep_efficiency_reports_the_screen_and_the_start_as_separate_arms():
    arms = _bench("sweep_efficiency").ARMS
    assert {"+sweep.edge_screen=false", "+sweep.edge_start=false"} <= set(arms["preflight"])
    assert {"+sweep.edge_screen=true", "+sweep.edge_start=false"} <= set(arms["screen"])
    assert {"+sweep.edge_screen=true", "+sweep.edge_start=true"} <= set(arms["edge"])
    assert all("+sweep.preflight=true" in arms[a] for a in ("preflight", "screen", "edge"))


@pytest.mark.torchfree
def test_eval_share_bench_runs_the_demo_trial_and_the_old_defaults_beside_it():
    bench = _bench("eval_share")
    demo = bench.demo_overrides()
    assert "train.eval_batches=1" in demo and "train.steps=8" in demo and "quant=none" in demo
    assert bench.arm_overrides("shipped", 2) == []
    assert bench.arm_overrides("before", 2) == ["train.threads=2", "train.dtype=bf16"]
    with pytest.raises(SystemExit, match="unknown arm"):
        bench.arm_overrides("nope", 2)
