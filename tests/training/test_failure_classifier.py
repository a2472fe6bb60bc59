"""One failure classifier (:mod:`vramsweep.record.failure`): the trial and the sweeper's safety net record
the same status and reason for the same exception; a sweep point the rules refuse stays ``unsupported``."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from conftest import FAST, trial_spec
from vramsweep.config import compose
from vramsweep.config.errors import ConfigError
from vramsweep.config.rules import UnsupportedError
from vramsweep.longctx.offload import HostMemoryError
from vramsweep.loop import Diverged, Pruned
from vramsweep.production.checkpoint import Preempted
from vramsweep.sweeper.outcome import result_from_exception

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

CASES = [
    ("unsupported", lambda: UnsupportedError("attention=flash_attention_2 needs CUDA", key="attention")),
    ("error", lambda: ConfigError("model.path: /x has no config.json", key="model.path")),
    ("oom", lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
    ("oom", lambda: torch.OutOfMemoryError()),  # no message
    ("oom", lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later")),
    ("oom", lambda: MemoryError("cannot allocate the optimizer state")),
    ("host_oom", lambda: HostMemoryError("the pinned pool of 18.00 GiB could not be page-locked")),
    ("diverged", lambda: Diverged("train loss is nan at step 3")),
    ("diverged", lambda: FloatingPointError("overflow encountered in exp")),
    ("pruned", lambda: Pruned("pruned at step 2")),
    ("error", lambda: Preempted("SIGTERM")),
    ("error", lambda: OSError(errno.ENOSPC, "No space left on device", "/results/r.json")),
    ("error", lambda: ValueError("boom")),
]
IDS = [
    "unsupported",
    "config",
    "cuda-oom",
    "cuda-oom-no-message",
    "cuda-error-oom",
    "memory-error",
    "host-oom",
    "diverged",
    "floating-point",
    "pruned",
    "preempted",
    "disk-full",
    "value-error",
]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return compose([*FAST, f"results_dir={tmp_path_factory.mktemp('results')}"])


def _sweeper_side(make) -> dict:
    try:
        raise make()
    except BaseException as exc:  # noqa: BLE001 - what the trial process's execute() does
        return result_from_exception(exc, sweep="s", trial=0, overrides=[])


def _trial_side(make, cfg, tmp_path, monkeypatch) -> dict:
    from vramsweep.trial import run_trial

    def failing_train(*args, **kwargs):
        raise make()

    monkeypatch.setattr("vramsweep.trial._train", failing_train)
    return run_trial(cfg, result_path=tmp_path / "r.json", sweep="s", trial=0)


@pytest.mark.parametrize("want,make", CASES, ids=IDS)
def test_the_trial_and_the_sweeper_classify_an_exception_alike(want, make, cfg, tmp_path, monkeypatch):
    trial = _trial_side(make, cfg, tmp_path, monkeypatch)
    sweeper = _sweeper_side(make)
    assert (trial["status"], sweeper["status"]) == (want, want), (trial["reason"], sweeper["reason"])
    # the same reason; the sweeper adds where an unexpected error happened (it keeps no traceback)
    assert sweeper["reason"] == trial["reason"] or sweeper["reason"].startswith(trial["reason"] + " (at "), (
        trial["reason"],
        sweeper["reason"],
    )
    assert json.loads((tmp_path / "r.json").read_text())["status"] == want
    # only an unexpected error (the ValueError) keeps the trial's traceback
    assert ("traceback" in trial["meta"]) is (type(make()) is ValueError)


def test_a_sweep_point_the_rules_refuse_is_unsupported(tmp_path):
    """In a grid or a search a combination the rules refuse is data (docs/SWEEPS.md): ``unsupported``,
    reason ``invalid combination: ...``, not an ``error`` that counts toward ``max_failure_rate``."""
    from vramsweep.sweeper.settings import Objective
    from vramsweep.sweeper.trialproc import execute

    spec = trial_spec(
        tmp_path,
        overrides=[*FAST, "tiling=on", "kernels=unsloth"],
        objectives=[Objective("peak_memory_bytes", "minimize")],
    )
    for preflight in (False, True):
        spec.preflight = preflight
        res = execute(spec)
        assert res["status"] == "unsupported", res["reason"]
        assert res["reason"].startswith(
            "invalid combination: tiling=on cannot be combined with kernels=unsloth"
        )
