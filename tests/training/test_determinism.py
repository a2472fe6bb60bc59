"""``train.deterministic`` (issue 49.5 / brief item 4): on CUDA it reaches ``torch.use_deterministic_algorithms``,
``CUBLAS_WORKSPACE_CONFIG`` (before anything touches CUDA) and FlashAttention's deterministic backward, and the
result records it; off (the default) and on CPU nothing changes. Tested on CPU by dispatch: the GPU's bits
are for the next GPU run (docs/RUNS.md)."""

from __future__ import annotations

import pytest
import torch

from vramsweep import determinism
from vramsweep.config import compose

CUDA = ["hardware=h100_80gb", "train.deterministic=true"]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    yield
    torch.use_deterministic_algorithms(False)


def test_off_by_default_and_nothing_to_set_on_cpu(clean_env):
    import os

    assert determinism.apply(compose([])).meta == {"enabled": False}
    on_cpu = determinism.apply(compose(["train.deterministic=true"]))
    assert on_cpu.meta["enabled"] and on_cpu.meta["device"] == "cpu"
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_on_cuda_it_reaches_torch_cublas_and_flash_attention_then_restores(clean_env, monkeypatch):
    import os

    calls = []
    real = torch.use_deterministic_algorithms
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **kw: (calls.append(on), real(on)))
    det = determinism.apply(compose(CUDA, rules="config"))
    assert calls == [True] and torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
    assert det.meta == {
        "enabled": True,
        "device": "cuda",
        "use_deterministic_algorithms": True,
        "cublas_workspace_config": ":4096:8",
        "flash_attention_deterministic": True,
        "set_before_cuda_init": True,
    }
    det.restore()
    assert calls == [True, False] and not torch.are_deterministic_algorithms_enabled()
    assert "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # the workspace it sized stays


@pytest.mark.parametrize(("user", "kept"), [(":16:8", ":16:8"), (":4096:2", ":4096:8"), ("", ":4096:8")])
def test_a_users_deterministic_cublas_setting_is_kept_any_other_replaced(clean_env, monkeypatch, user, kept):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", user)
    det = determinism.apply(compose(CUDA, rules="config"))
    det.restore()
    assert det.meta["cublas_workspace_config"] == kept


def test_cuda_used_before_in_the_process_is_recorded(clean_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    det = determinism.apply(compose(CUDA, rules="config"))
    det.restore()
    assert det.meta["set_before_cuda_init"] is False


def test_a_trial_sets_it_before_anything_touches_cuda_records_it_and_restores(clean_env, monkeypatch):
    """run_trial applies it before collect_meta (which names the CUDA device, initialising CUDA) and puts
    PyTorch's flag back at the end; the h100 profile on this CPU machine ends 'unsupported' before a build."""
    import os

    from vramsweep import trial

    seen = {}
    real_meta = trial.collect_meta

    def spy(cfg, key):
        seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        seen["flag"] = torch.are_deterministic_algorithms_enabled()
        return real_meta(cfg, key)

    monkeypatch.setattr(trial, "collect_meta", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # collect_meta: no device to name
    res = trial.run_trial(compose(CUDA, rules="config"))
    assert seen == {"cublas": ":4096:8", "flag": True}
    assert res["meta"]["deterministic"]["use_deterministic_algorithms"] is True
    assert res["status"] != "ok" and not torch.are_deterministic_algorithms_enabled()
    off = trial.run_trial(compose(["hardware=h100_80gb"], rules="config"))
    assert off["meta"]["deterministic"] == {"enabled": False}


def test_the_knob_is_typed():
    from vramsweep.config.errors import ConfigError

    with pytest.raises(ConfigError, match="train.deterministic"):
        compose(["train.deterministic=maybe"])
