"""``vramsweep estimate --suggest``: change sets that fit, re-estimated through a fresh compose of their overrides."""

from __future__ import annotations

import json

import pytest

from vramsweep.cli import main
from vramsweep.config import compose
from vramsweep.estimate import estimate
from vramsweep.estimate import max_context as exact_max_context
from vramsweep.estimate.suggest import COSTS, CostModel, fit_costs, suggest

pytestmark = pytest.mark.torchfree

Q8 = ["model=qwen3_8b", "quant=nf4_dq", "hardware=rtx4080_16gb"]


def q8(tokens: int) -> list[str]:
    rope = ["rope=yarn", "rope.factor=2"] if tokens > 40960 else []  # beyond Qwen3-8B's 40,960 positions
    return [*Q8, f"context.max_tokens={tokens}", *rope]


def refit(base: list[str], sug: dict) -> dict:
    """The suggestion as a user gets it: compose the pasted overrides and estimate from scratch."""
    return estimate(compose([*base, *sug["overrides"]], rules="config"), calibration=False)


@pytest.mark.parametrize("tokens", [8192, 32768, 65536])
@pytest.mark.parametrize("any_install", [False, True])
def test_qwen3_8b_on_16gb_every_suggestion_fits_when_re_estimated(tokens, any_install):
    ov = q8(tokens)
    res = suggest(compose(ov, rules="none"), calibration=False, any_install=any_install)
    assert res["fits"] is False and res["required_bytes"] > res["budget_bytes"]
    sugs = res["suggestions"]
    for s in sugs:
        est = refit(ov, s)
        assert est["fits"], s["overrides"]
        assert est["required_bytes"] == s["required_bytes"]  # the in-place swap = what compose gives
        assert s["headroom_bytes"] == res["budget_bytes"] - s["required_bytes"] >= 0
        assert s["reason"] and s["speed_factor"] > 0
    costs = [s["speed_factor"] for s in sugs]
    assert costs == sorted(costs)  # cheapest first
    # no suggestion is another plus more changes (that would be dearer and no better)
    sets = [set(s["overrides"]) for s in sugs]
    assert not any(a < b for a in sets for b in sets)
    if tokens == 65536 and not any_install:
        assert sugs == []  # without Liger nothing fits at 65k on 15 GiB (docs/LONG_CONTEXT.md needs it)
        assert any("kernels=liger" in x for x in res["left_out"])
    else:
        assert sugs, res
    if tokens == 65536 and any_install:  # the docs/LONG_CONTEXT.md recipe, found by the search
        assert {"checkpointing=offload", "kernels=liger"} <= sets[0]
    if tokens == 8192 and any_install:
        assert "kernels=liger" in sets[0]  # Liger is the one change that costs nothing (x0.83)
        assert costs[0] < min(s["speed_factor"] for s in sugs if "kernels=liger" not in s["overrides"])


def test_tiny_model_on_a_small_budget():
    ov = ["hardware.budget_gib=0.05", "context.max_tokens=512", "train.micro_batch=4"]
    cfg = compose(ov, rules="none")
    assert not estimate(cfg, calibration=False)["fits"]
    res = suggest(cfg, calibration=False, with_max_context=True)
    assert res["suggestions"]
    assert any("needs a CUDA hardware profile" in x for x in res["left_out"])  # hardware=cpu: no Liger
    for s in res["suggestions"]:
        assert refit(ov, s)["fits"]
        assert "kernels=liger" not in s["overrides"]
        exact = exact_max_context(compose([*ov, *s["overrides"]], rules="none"), calibration=False)
        assert exact["max_tokens"] - 256 < s["max_tokens"] <= exact["max_tokens"]


def test_config_that_fits_reports_headroom_and_what_the_spare_buys():
    ov = [*Q8, "context.max_tokens=1024", "kernels=liger", "checkpointing=on", "train.micro_batch=1"]
    res = suggest(compose(ov, rules="none"), calibration=False)
    assert res["fits"] and res["headroom_bytes"] > 0 and "suggestions" not in res
    spare = res["spare"]
    assert spare["train.micro_batch"] > 1 and spare["adapter.r"] > 16 and spare["context.max_tokens"] > 1024
    for key, val in spare.items():
        assert estimate(compose([*ov, f"{key}={val}"], rules="none"), calibration=False)["fits"], key
    nxt = 2 * spare["train.micro_batch"]
    assert not estimate(compose([*ov, f"train.micro_batch={nxt}"], rules="none"), calibration=False)["fits"]


def test_offload_cost_follows_the_profiles_pcie_bandwidth():
    fast = compose([*q8(32768), "checkpointing=offload"], rules="none")
    slow = compose([*q8(32768), "checkpointing=offload", "hardware.pcie_bytes_per_s=1e8"], rules="none")
    f_fast = CostModel(fast, 32768).factor("checkpointing=offload")
    f_slow = CostModel(slow, 32768).factor("checkpointing=offload")
    assert f_fast == pytest.approx(COSTS["checkpointing=offload"].factor)  # hidden behind the compute
    assert f_slow > 2 * f_fast  # 0.1 GB/s: the transfers dominate the step


def _trial(ck: str, liger: bool, tps: float) -> dict:
    return {
        "status": "ok",
        "metrics": {"tokens_per_s": tps},
        "config": {"checkpointing": {"name": ck}, "kernels": {"liger": liger}, "train": {"micro_batch": 1}},
    }


def test_speed_factors_calibrated_from_a_sweep():
    # checkpointing=on halves tokens/s, liger gives x1.25: the fit recovers both, marked calibrated
    results = [
        _trial("off", False, 100.0),
        _trial("on", False, 50.0),
        _trial("off", True, 125.0),
        _trial("on", True, 62.5),
        _trial("off", False, 100.0),
        {"status": "oom", "metrics": {}, "config": {}},
    ]
    fitted, n = fit_costs(results)
    assert n == 5
    assert fitted["checkpointing=on"] == pytest.approx(2.0)
    assert fitted["kernels=liger"] == pytest.approx(0.8)
    model = CostModel(compose(q8(8192), rules="none"), 8192, fitted)
    lines = model.lines({"checkpointing=on", "tiling=loss"})
    assert any(ln.startswith("checkpointing=on: x2.00 calibrated") for ln in lines)
    assert any(ln.startswith("tiling=loss: x1.02 assumed") for ln in lines)


def test_cli_table_json_and_calibrate(tmp_path, capsys):
    assert main(["estimate", *q8(32768), "--suggest", "--max-context"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()[1:]) <= 100  # the title echoes the overrides
    assert "does NOT fit" in out and "speed model" in out and "assumed" in out and "max ctx" in out
    assert "checkpointing=offload" in out
    assert main(["estimate", *q8(8192), "--suggest", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["suggestions"] and all(s["required_bytes"] <= res["budget_bytes"] for s in res["suggestions"])
    # --calibrate: a sweep folder's trials; speed factors named as calibrated
    trials = tmp_path / "sweeps" / "s" / "trials"
    trials.mkdir(parents=True)
    for i, (ck, liger, tps) in enumerate(
        [("off", False, 100), ("on", False, 40), ("off", False, 100), ("on", False, 40)]
    ):
        (trials / f"{i}.json").write_text(json.dumps(_trial(ck, liger, tps)))
    assert main(["estimate", *q8(8192), "--suggest", "--calibrate", str(trials.parent)]) == 0
    out = capsys.readouterr().out
    assert "checkpointing=on: x2.50 calibrated" in out
    assert "speed factors checkpointing=on from 4 trials" in out


def test_cli_bad_input_one_line_exit_2(tmp_path, capsys):
    assert main(["estimate", "--suggest"]) == 2  # hardware=cpu: no budget
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vramsweep estimate: error: --suggest needs a memory budget")
    assert main(["estimate", *Q8, "--suggest", "--calibrate", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a folder" in err[0]
    assert not list(tmp_path.iterdir())
