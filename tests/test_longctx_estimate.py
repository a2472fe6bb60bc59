"""Issue 24: the estimator's long-context terms (attention backward workspace, the layer at its attention
backward, the offload prefetch), host memory beside the device, the pre-flight and trial checks of host
memory, and the terms an estimate extrapolates beyond the GPU measurements."""

from __future__ import annotations

import pytest

from vramsweep.config import ConfigError, compose
from vramsweep.estimate import estimate, knobs_from_cfg
from vramsweep.estimate.analytic import attention_backward_bytes_per_token
from vramsweep.record.units import GIB

QWEN_16GB = [
    "model=qwen3_8b",
    "hardware=rtx4080_16gb",
    "quant=nf4_dq",
    "train.micro_batch=1",
    "rope=yarn",
    "rope.factor=4",
    "rope.original_max_position_embeddings=32768",
]
STACK = ["kernels=liger", "checkpointing=offload", "tiling=mlp", "adapter.dtype=compute"]


def _cfg(*over):
    return compose([*QWEN_16GB, *over], rules="none")


def test_flash_backward_workspace_by_hand():
    """FlashAttention-2 mha_bwd for Qwen3-8B (32 heads, 8 kv heads, head_dim 128, bf16), per token:
    dq_accum fp32 4096*4 + dq 4096*2 + dk/dv expanded to the query heads 2*4096*2 + dk/dv 2*1024*2
    + softmax_d 32*4 = 45,184 B."""
    k = knobs_from_cfg(_cfg())
    assert attention_backward_bytes_per_token(k) == 4096 * 4 + 4096 * 2 + 2 * 4096 * 2 + 2 * 1024 * 2 + 32 * 4
    assert attention_backward_bytes_per_token(knobs_from_cfg(_cfg("attention=eager"))) == 0
    assert attention_backward_bytes_per_token(knobs_from_cfg(compose(["attention=sdpa"]))) == 0  # CPU


@pytest.mark.torchfree
def test_qwen3_8b_65k_prediction_with_host_bytes_and_extrapolated_terms():
    """The 16 GB target at 65,536 tokens: the attention workspace is in the peak (the layer's backward at
    its attention is the largest moment), device and host bytes are reported, the unmeasured terms named.
    Before: no workspace, no host figure, 83k tokens predicted to fit in 15 GiB."""
    est = estimate(_cfg(*STACK, "context.max_tokens=65536"), calibration=False)
    assert est["peak_phase"] == "recompute"
    assert 14.0 * GIB < est["required_bytes"] < 15.0 * GIB
    assert est["host_bytes"] == 36 * 65536 * 4096 * 2 == 18 * GIB
    assert est["host_breakdown_bytes"] == {"pinned_layer_inputs": 18 * GIB}
    terms = " ".join(est["extrapolated_terms"])
    assert "attention backward" in terms and "offload" in terms and "65,536 tokens" in terms
    assert any("host memory: pinned_layer_inputs 18.00 GiB" in a for a in est["assumptions"])
    at_83k = estimate(_cfg(*STACK, "context.max_tokens=83169"), calibration=False)
    assert at_83k["fits"] is False and at_83k["required_bytes"] > 16 * GIB
    no_ws = estimate(_cfg(*STACK, "context.max_tokens=65536", "attention=eager"), calibration=False)
    assert no_ws["extrapolated_terms"] != est["extrapolated_terms"]


def test_cpu_estimates_have_no_host_or_extrapolated_terms():
    est = estimate(compose(["checkpointing=offload"]), calibration=False)
    assert est["host_bytes"] == 0 and est["extrapolated_terms"] == []


@pytest.mark.torchfree
def test_preflight_refuses_a_pool_larger_than_the_available_ram():
    from vramsweep.preflight import check_host_memory

    cfg = _cfg(*STACK, "context.max_tokens=65536")
    with pytest.raises(ConfigError) as err:
        check_host_memory(cfg, available=16 * GIB)
    msg = str(err.value)
    assert err.value.key == "checkpointing"
    assert "18.00 GiB of pinned host memory" in msg and "16.00 GiB of RAM available" in msg
    assert "context.max_tokens<=50972" in msg and "checkpointing=on" in msg  # 14 GiB left beside the process
    check_host_memory(cfg, available=20 * GIB)  # fits: 18 GiB pool + 2 GiB for the process (issue 37.7)
    check_host_memory(_cfg("checkpointing=on", "context.max_tokens=65536"), available=1 * GIB)  # no pool


def test_trial_records_host_oom_before_building(tmp_path, monkeypatch):
    """A config whose pinned pool cannot fit the RAM here ends as host_oom, not run (nothing built)."""
    from vramsweep import preflight
    from vramsweep.trial import run_trial

    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 4 * GIB)
    built = []
    monkeypatch.setattr(
        "vramsweep.trial.build_model", lambda *a, **k: built.append(1)
    )  # where the trial calls it
    cfg = _cfg(*STACK, "context.max_tokens=32768", f"results_dir={tmp_path}")
    res = run_trial(cfg, overrides=[], result_path=tmp_path / "r.json")
    assert res["status"] == "host_oom", res["reason"]
    assert "9.00 GiB of pinned host memory" in res["reason"] and "4.00 GiB of RAM available" in res["reason"]
    assert not built
