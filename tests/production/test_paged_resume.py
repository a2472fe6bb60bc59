"""Paged optimizer state after a resume (issue 53): bitsandbytes' ``load_state_dict`` moves the loaded
moments to the parameter's device with ``.to()``, so a resumed paged optimizer kept them in ordinary device
memory; ``Resume.apply`` now puts them back into paged buffers (``get_state_buffer``), values unchanged.

bitsandbytes pages nothing on CPU, so the CUDA branch is entered here by patching the device check and
marking the buffers ``get_state_buffer`` returns as paged (what ``F.get_paged`` does on CUDA)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from vramsweep.production import checkpoint as ckpt  # noqa: E402


def _trained(cls, shapes=((512, 256), (16, 16))):
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Paged optimizers are not supported on CPU": the point of the test
        opt = cls(params, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def _fake_cuda_paging(monkeypatch, opt):
    monkeypatch.setattr(ckpt, "_on_cuda", lambda t: True)
    real = opt.get_state_buffer
    made = []

    def paged(p, dtype=torch.float32):
        buf = real(p, dtype=dtype)
        buf.is_paged = True
        made.append(buf)
        return buf

    monkeypatch.setattr(opt, "get_state_buffer", paged)
    return made


def test_resume_repages_a_paged_optimizers_state(monkeypatch):
    params, opt = _trained(bnb.optim.PagedAdamW8bit)
    saved = opt.state_dict()
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = bnb.optim.PagedAdamW8bit(fresh_params, lr=1e-3)
    made = _fake_cuda_paging(monkeypatch, fresh)
    model = torch.nn.Module()
    model.w0, model.w1 = fresh_params
    sched = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1.0)
    resume = ckpt.Resume(
        path=None, next_step=1, state={}, tensors={},
        torch_state={"optimizer": saved, "scheduler": sched.state_dict()},
    )  # fmt: skip
    resume.apply(model, fresh, sched)
    big, small = fresh.state[fresh_params[0]], fresh.state[fresh_params[1]]
    assert resume.repaged == 2 and len(made) == 2  # state1 + state2 of the 131,072-element parameter
    assert big["state1"].is_paged and big["state2"].is_paged
    assert not getattr(small["state1"], "is_paged", False)  # < 100,000 elements: bitsandbytes never pages it
    for key in ("state1", "state2"):
        assert torch.equal(big[key], opt.state[params[0]][key])  # the loaded values, unchanged


def test_non_paged_optimizers_and_cpu_are_left_alone(monkeypatch):
    _, opt = _trained(bnb.optim.AdamW8bit)
    assert ckpt.repage_optimizer_state(opt) == 0  # not paged
    _, paged = _trained(bnb.optim.PagedAdamW8bit)
    assert ckpt.repage_optimizer_state(paged) == 0  # CPU: bitsandbytes pages nothing there
    _, torch_opt = _trained(torch.optim.AdamW)
    monkeypatch.setattr(ckpt, "_on_cuda", lambda t: True)
    assert ckpt.repage_optimizer_state(torch_opt) == 0
