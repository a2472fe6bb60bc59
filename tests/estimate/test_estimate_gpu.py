"""Memory estimator against the first real GPU run.

Fixtures: ``tests/fixtures/gpu_2026-12-01/fixtures.json`` -- one NVIDIA H200 capped at 15 GiB (the
``rtx4080_16gb`` profile's budget, ``torch.cuda.set_per_process_memory_fraction``), torch 2.11.0+cu130,
transformers 5.17.0, peft 0.21.0, bitsandbytes 0.50.2, liger-kernel 0.8.5, unsloth 2026.10.9. The measured
number is the caching allocator's reserved peak (``torch.cuda.max_memory_reserved``), which is what the cap
limits; the CUDA context is outside it. Pure arithmetic: no torch, no GPU, no weights.

* ok fixtures: the estimate is within +-5 % of the measured reserved peak;
* fixtures whose reserved peak equals the cap ran into it (the allocator frees its cache and retries before
  it raises OOM), so their true demand is at least the cap: the estimate must not be more than 5 % below
  the cap (a lower bound), and its allocated part must fit under the cap (the trial did not OOM);
* OOM fixtures: the estimate is above the cap.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vramsweep.estimate import estimate, max_context

pytestmark = pytest.mark.torchfree

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gpu_2026-12-01" / "fixtures.json"
DATA = json.loads(FIXTURES.read_text())
CAP = int(DATA["cap_bytes"])
TOL = 0.05


def fixture_cfg(fx: dict, folder: Path):
    """The composed config of one fixture: the smoke baseline with the fixture's values set."""
    cfg = copy.deepcopy(DATA["base_config"])
    for key, value in fx["set"].items():
        if key == "model.folder":
            d = folder / value
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(json.dumps(DATA["models"][value]))
            cfg["model"]["path"] = str(d)
            continue
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return OmegaConf.create(cfg)


def _est(fx: dict, folder: Path) -> dict:
    return estimate(fixture_cfg(fx, folder), seq_len=int(fx["seq_len"]), calibration=False)


OK = [f for f in DATA["fixtures"] if f["status"] == "ok" and f["peak_reserved_bytes"] < CAP]
AT_CAP = [f for f in DATA["fixtures"] if f["status"] == "ok" and f["peak_reserved_bytes"] >= CAP]
OOM = [f for f in DATA["fixtures"] if f["status"] == "oom"]


def test_fixture_file_is_complete():
    assert len(OK) + len(AT_CAP) + len(OOM) == 16
    assert len(AT_CAP) == 2 and len(OOM) == 3  # int8 and kernels=none at 4,096 tokens sit at the cap


@pytest.mark.parametrize("fx", OK, ids=[f["name"] for f in OK])
def test_ok_fixture_within_5_percent_of_reserved_peak(fx, tmp_path):
    est = _est(fx, tmp_path)
    measured = fx["peak_reserved_bytes"]
    err = (est["peak_memory_bytes"] - measured) / measured
    print(
        f"\n{fx['name']}: measured {measured / 2**20:,.0f} MiB, estimate {est['peak_memory_bytes'] / 2**20:,.0f} MiB ({100 * err:+.1f} %)"
    )
    assert abs(err) <= TOL, (fx["name"], est["breakdown_bytes"])


@pytest.mark.parametrize("fx", AT_CAP, ids=[f["name"] for f in AT_CAP])
def test_fixture_at_the_cap_is_a_lower_bound(fx, tmp_path):
    est = _est(fx, tmp_path)
    assert est["peak_memory_bytes"] >= (1 - TOL) * CAP, est["breakdown_bytes"]
    # it did not OOM: what the tensors themselves need (the allocated peak) fits under the cap
    assert est["components_bytes"]["allocated_peak"] <= (1 + TOL) * fx["peak_allocated_bytes"]
    assert est["components_bytes"]["allocated_peak"] <= CAP
    assert est["fits"] is True and est["required_bytes"] <= CAP  # it ran: the cached reserve was released


@pytest.mark.parametrize("fx", OOM, ids=[f["name"] for f in OOM])
def test_oom_fixture_estimated_above_the_cap(fx, tmp_path):
    est = _est(fx, tmp_path)
    assert est["peak_memory_bytes"] > CAP
    assert est["required_bytes"] > CAP and est["fits"] is False


# --------------------------------------------------------------------------------------------------
# predicted max context

MAX_CTX = [
    "model=qwen3_8b",
    "quant=nf4_dq",
    "kernels=liger",
    "checkpointing=on",
    "train.micro_batch=1",
    "hardware=rtx4080_16gb",
]


def test_max_context_lands_between_measured_fit_and_oom():
    """Measured (fixtures): 12,288 tokens ran (14,996 MiB reserved), 16,384 tokens ran out of memory."""
    from vramsweep.config import compose

    res = max_context(compose(MAX_CTX, rules="none"), calibration=False)
    assert 12_288 <= res["max_tokens"] < 16_384
    assert res["estimate"]["fits"] and res["estimate"]["required_bytes"] <= res["budget_bytes"]
    assert not res["next_estimate"]["fits"]
    assert res["next_estimate"]["required_bytes"] > res["budget_bytes"]


def test_max_context_cli(capsys):
    from vramsweep.cli import main

    assert main(["estimate", *MAX_CTX, "--max-context", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 12_288 <= out["max_tokens"] < 16_384
    assert main(["estimate", *MAX_CTX, "--max-context"]) == 0
    text = capsys.readouterr().out
    assert f"max context: {out['max_tokens']:,} tokens" in text and "does not fit" in text
    # no budget: a one-line error naming the key, exit 2
    assert main(["estimate", "model=qwen3_8b", "hardware=cpu", "--max-context"]) == 2
    err = capsys.readouterr().err
    assert "hardware.budget_gib" in err and err.count("\n") == 1


def test_max_context_is_shorter_without_fused_loss():
    """kernels=none materialises fp32 logits: measured 4,096 tokens ran at the cap, so the answer is ~4k."""
    from vramsweep.config import compose

    ov = [o if o != "kernels=liger" else "kernels=none" for o in MAX_CTX]
    res = max_context(compose(ov, rules="none"), calibration=False)
    assert 3_072 <= res["max_tokens"] < 6_144


# --------------------------------------------------------------------------------------------------
# Liger's per-kernel flags are honoured (the build honours them)


def test_liger_per_kernel_flags_change_the_estimate(tmp_path):
    base = next(f for f in DATA["fixtures"] if f["name"].startswith("smoke9"))  # liger, 4,096 tokens
    fx = dict(base, set={**base["set"], "checkpointing.enabled": False, "checkpointing.name": "off"})
    on = _est(fx, tmp_path)
    rms_off = _est(dict(fx, set={**fx["set"], "kernels.liger_rms_norm": False}), tmp_path)
    swiglu_off = _est(dict(fx, set={**fx["set"], "kernels.liger_swiglu": False}), tmp_path)
    flce_off = _est(dict(fx, set={**fx["set"], "kernels.liger_fused_linear_cross_entropy": False}), tmp_path)
    gib = 2**30
    d_rms = rms_off["components_bytes"]["allocated_peak"] - on["components_bytes"]["allocated_peak"]
    d_swiglu = swiglu_off["components_bytes"]["allocated_peak"] - on["components_bytes"]["allocated_peak"]
    print(
        f"\nQwen3-8B, 4,096 tokens, no checkpointing: rms_norm off +{d_rms / gib:.2f} GiB, swiglu off +{d_swiglu / gib:.2f} GiB"
    )
    # HF RMSNorm keeps an fp32 copy of its input where Liger's keeps the bf16 input (layer norms, q/k norms)
    assert 2 * gib < d_rms < 6 * gib
    assert d_swiglu == 36 * 4096 * 12288 * 2  # HF SwiGLU also keeps silu(gate): 36 x 4,096 x 12,288 x 2 B
    assert d_rms + d_swiglu > 6 * gib  # the ~7 GiB an earlier estimate left out
    # without fused linear cross-entropy the HF loss materialises the fp32 logits: 12 B x 4,096 x 151,936
    assert flce_off["breakdown_bytes"]["logits"] == 12 * 4096 * 151936 > 30 * on["breakdown_bytes"]["logits"]
    assert any("off (HF modules): RMSNorm" in a for a in rms_off["assumptions"])


# --------------------------------------------------------------------------------------------------
# pieces of the GPU model


def test_unsloth_chunk_count_follows_unsloth_zoo(tmp_path):
    """unsloth_zoo ``get_chunk_size``: n = 4 * ceil(T*V*16 B / target / 4), target = min(4 GiB, half free)
    less grad_inputs; the Qwen3-1.7B fixture (3,625 tokens, V = 151,936) needs 8.2 GiB -> 4 chunks."""
    from vramsweep.estimate import knobs_from_cfg
    from vramsweep.estimate.analytic import unsloth_ce_chunk_tokens

    fx = next(f for f in DATA["fixtures"] if f["name"] == "single Qwen3-1.7B folder unsloth")
    k = knobs_from_cfg(fixture_cfg(fx, tmp_path), seq_len=3625)
    assert unsloth_ce_chunk_tokens(k, static=1.5 * 2**30) == -(-3625 // 4)
    # a small budget leaves less free memory: more chunks
    assert unsloth_ce_chunk_tokens(k, static=13 * 2**30) < 3625 // 4
    est = _est(fx, tmp_path)
    assert est["breakdown_bytes"]["logits"] < 0.25 * 3625 * 151936 * 12  # never the full fp32 logits


def test_cpu_has_no_allocator_reserve(tmp_path):
    fx = next(f for f in DATA["fixtures"] if f["name"] == "smoke0 baseline")
    est = _est(dict(fx, set={**fx["set"], "hardware.device": "cpu", "hardware.name": "cpu"}), tmp_path)
    assert est["breakdown_bytes"]["overhead"] == 0
    assert est["required_bytes"] == est["peak_memory_bytes"] == est["components_bytes"]["allocated_peak"]


def test_allocator_reserve_terms_sum_to_the_overhead_row(tmp_path):
    for fx in DATA["fixtures"]:
        est = _est(fx, tmp_path)
        comp = est["components_bytes"]
        terms = {n: v for n, v in comp.items() if n.startswith("reserve_")}
        assert set(terms) == {"reserve_idle_loss", "reserve_layer_cycle", "reserve_small_pool"}
        assert abs(sum(terms.values()) - est["breakdown_bytes"]["overhead"]) <= 2
        assert est["peak_memory_bytes"] == comp["allocated_peak"] + est["breakdown_bytes"]["overhead"]
        assert comp["cuda_context"] == 629145600  # reported, outside the allocator and the budget
        # fused losses keep no idle logits block
        if fx["set"].get("kernels.liger") or fx["set"].get("kernels.unsloth"):
            assert terms["reserve_idle_loss"] == 0
