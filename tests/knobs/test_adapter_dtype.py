"""adapter.dtype=compute: 16-bit LoRA weights keep learning.

bf16 holds 8 significant bits, so an AdamW update smaller than half a bf16 ulp of a weight (|w| * 2**-8 for
the update to round away) is lost when the weight itself is bf16. ``adapter.fp32_master=true`` (the default)
makes the optimizer step fp32 master copies (``vramsweep.knobs.optim.Fp32Master``) while the model computes
with the bf16 weights. Measured quality gap: docs/LONG_CONTEXT.md, "Adapter dtype" (bench/adapter_dtype.py).
"""

from __future__ import annotations

import pytest
import torch

from vramsweep.config import compose
from vramsweep.knobs import build_model, build_optimizer
from vramsweep.knobs.optim import build_scheduler

LR = 1e-4  # Adam's first steps move each weight by ~lr: far below half a bf16 ulp of 1.0 (2**-8 = 0.0039)


def _steps(overrides: list[str], steps: int = 40) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """A bf16 weight of ones stepped ``steps`` times with a constant gradient by the configured optimizer."""
    cfg = compose(["adapter.dtype=compute", f"train.lr={LR}", "train.schedule=constant", *overrides])
    w = torch.nn.Parameter(torch.ones(32, 32, dtype=torch.bfloat16))
    opt, _ = build_optimizer(cfg, [w])
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return w, opt


def test_plain_bf16_adamw_loses_updates_below_half_an_ulp():
    """The mechanism: torch AdamW on a bf16 weight rounds each ~1e-4 step back to 1.0."""
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=LR, weight_decay=0.0)
    for _ in range(40):
        w.grad = torch.ones_like(w)
        opt.step()
    assert torch.all(w == 1.0)  # 40 steps x 1e-4 = 0.004 of movement, all of it lost


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_32bit", "adafactor"])
def test_compute_adapters_keep_sub_ulp_updates_with_fp32_master(optimizer):
    """Default adapter.dtype=compute: the fp32 master accumulates the tiny updates, and the bf16 weight
    follows once they add up to more than half an ulp; adapter.fp32_master=false loses them (AdamW and
    bitsandbytes step a bf16 param in fp32 and round it back to nearest)."""
    w, opt = _steps([f"optimizer={optimizer}"])
    assert float(w.max()) < 1.0  # the bf16 weight moved
    master = opt.fp32_master.pairs[0][1]
    assert master.dtype == torch.float32
    assert float(master.max()) < 1.0 - 30 * LR  # ~40 steps of ~lr kept (Adafactor's first steps are smaller)
    assert torch.equal(w.data, master.to(torch.bfloat16))  # the model's weight is the master, rounded
    if optimizer in ("adamw", "adamw_8bit", "paged_adamw_32bit"):
        plain, plain_opt = _steps([f"optimizer={optimizer}", "adapter.fp32_master=false"])
        assert not hasattr(plain_opt, "fp32_master")
        assert torch.all(plain == 1.0)


def test_knob_built_optimizer_steps_fp32_masters_of_bf16_adapters():
    """build_model + build_optimizer for adapter.dtype=compute: the model's LoRA weights stay bf16 (the
    activation saving), the optimizer holds fp32 copies + fp32 state, a step moves the model's weights,
    and the 16-bit grads are released by the step. adapter.dtype=fp32 and fp32_master=false: no copies."""
    cfg = compose(["adapter.dtype=compute", "context.max_tokens=32", "train.warmup_steps=0"])
    model = build_model(cfg).model
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and {p.dtype for p in params} == {torch.bfloat16}
    opt, notes = build_optimizer(cfg, params)
    sched = build_scheduler(cfg, opt)
    assert notes["fp32_master"]["params"] == len(params)
    assert notes["fp32_master"]["bytes"] == 4 * sum(p.numel() for p in params)
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert {p.dtype for p in stepped} == {torch.float32}
    before = [p.detach().clone() for p in params]
    ids = torch.randint(3, int(cfg.model.vocab_size), (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    assert all(p.grad is None for p in params)
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
    for m in stepped:
        st = opt.state[m]
        assert st["fp32_master"] is m
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    for over in (["adapter.dtype=fp32"], ["adapter.dtype=compute", "adapter.fp32_master=false"]):
        c = compose(over)
        ps = [p for p in build_model(c).model.parameters() if p.requires_grad]
        o, n = build_optimizer(c, ps)
        assert "fp32_master" not in n
        assert [p for g in o.param_groups for p in g["params"]] == ps


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
@pytest.mark.parametrize("master", [True, False])
def test_estimator_optimizer_bytes_match_fp32_master_state(optimizer, master):
    """The estimate's optimizer state (masters counted) equals the real ``optimizer.state`` bytes, and the
    total peak stays within 5 % of the CPU tracker's."""
    from _estimates import SMALL, _cfg, _tracked_peak
    from vramsweep.estimate import estimate
    from vramsweep.measure.cpu import optimizer_state_tensors, tensor_bytes

    over = SMALL + [
        "adapter.dtype=compute",
        f"adapter.fp32_master={str(master).lower()}",
        f"optimizer={optimizer}",
        "context.max_tokens=64",
        "train.micro_batch=2",
    ]
    cfg = _cfg(over)
    model = build_model(cfg).model
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    est = estimate(cfg, calibration=False)
    assert est["components_bytes"]["optimizer"] == tensor_bytes(optimizer_state_tensors(opt))
    real = _tracked_peak(cfg)["peak"]
    assert abs(est["peak_memory_bytes"] - real) <= 0.05 * real, (est["peak_memory_bytes"], real)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_resume_puts_saved_fp32_masters_into_the_masters_the_optimizer_steps(optimizer):
    """A checkpoint of a compute-dtype adapter applied to a freshly built model + optimizer (Resume.apply):
    the masters the optimizer steps hold the saved ones, no second fp32 copy is left in its state, and the
    next step is bitwise the uninterrupted run's. Before (issue 49.2): the masters kept the fresh adapter's
    values, the saved ones sat beside them as a loaded copy, and the next step wrote initial + update back."""
    from vramsweep.production.checkpoint import Resume

    over = [f"optimizer={optimizer}"]  # min_8bit_size 0: 8-bit state on a 32 x 32 weight
    w, opt = _steps(over)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    saved = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    fresh = torch.nn.Module()
    fresh.w = torch.nn.Parameter(torch.ones(32, 32, dtype=torch.bfloat16))
    cfg = compose(["adapter.dtype=compute", f"train.lr={LR}", "train.schedule=constant", *over])
    opt2, _ = build_optimizer(cfg, [fresh.w])
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    Resume(None, 40, {}, {"w": w.detach().clone()}, saved).apply(fresh, opt2, sched2)
    (_, m), (_, m2) = opt.fp32_master.pairs[0], opt2.fp32_master.pairs[0]
    assert torch.equal(m2, m) and not torch.equal(m2, torch.ones_like(m2))
    assert opt2.state[m2]["fp32_master"] is m2  # the stepped tensor itself: no extra fp32 adapter kept
    for o, p in ((opt, w), (opt2, fresh.w)):
        p.grad = torch.ones_like(p)
        o.step()
    assert torch.equal(m2, m) and torch.equal(fresh.w, w)
