"""Trial isolation on CUDA hosts: no trial may run in a process forked after CUDA was initialised.

The 2026-12-01 GPU run: the fork server's default preload imported peft -> bitsandbytes, which queries the
device (initialising CUDA); every forked trial then failed "Cannot re-initialize CUDA in forked subprocess".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vramsweep.sweeper import isolation as R
from vramsweep.sweeper import trialproc as T
from vramsweep.sweeper.settings import DEFAULT_PRELOAD

TESTS = Path(__file__).resolve().parent


def _spec(tmp_path: Path, fn: str, n: int = 0) -> T.TrialSpec:
    return T.TrialSpec(
        number=n,
        trial_id=-1,
        slot=n,
        overrides=[],
        result_path=str(tmp_path / f"{n:04d}.json"),
        sweep_name="iso",
        study_name="iso",
        storage="",
        objectives=[],
        trial_fn=fn,
        parent_pid=os.getpid(),
        env=dict(os.environ),
        cwd=os.getcwd(),
    )


@pytest.fixture()
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    yield
    R._stop_forkserver()


def test_fork_server_is_refused_when_a_preload_initialises_cuda(tmp_path, monkeypatch, tests_on_path):
    # Not flagged as a CUDA host, so the module filter does not catch it: the zygote's own report must.
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "0")
    runner = R.ProcessRunner("forkserver", ["torch", "_cuda_init_sim"])
    runner.start()
    try:
        rep = runner.run(_spec(tmp_path, "_cuda_init_sim:trial"), tick_s=0.05)
    finally:
        runner.stop()
    assert runner.zygote.get("cuda_initialised") is True
    assert runner.zygote.get("cuda_initialised_by") == "_cuda_init_sim"
    assert rep.result["status"] == "ok", rep.result.get("reason")
    # The trial imported the module itself: it was not forked from the CUDA-initialised server.
    assert rep.result["meta"]["imported_in"] == rep.result["meta"]["pid"]
    assert runner.name == "spawn"
    assert "_cuda_init_sim" in (runner.fallback_reason or "") and "spawn" in runner.fallback_reason


def test_cuda_host_preload_leaves_out_modules_that_initialise_cuda():
    modules, left_out = R.effective_preload(list(DEFAULT_PRELOAD), cuda=True)
    assert "peft" in left_out and "peft" not in modules
    assert not any(m.split(".")[0] in R.CUDA_INIT_MODULES for m in modules)
    assert "torch" in modules and "transformers" in modules
    assert set(R.CUDA_SAFE_EXTRAS) <= set(modules)  # peft's heavy CUDA-free imports still come warm
    # CPU host: the full list (peft warm: ~4-14 s of imports saved per trial)
    assert R.effective_preload(list(DEFAULT_PRELOAD), cuda=False) == (list(DEFAULT_PRELOAD), [])
    # an explicit submodule of a CUDA-initialising package is left out too
    assert R.effective_preload(["bitsandbytes.nn", "torch"], cuda=True)[1] == ["bitsandbytes.nn"]


def test_cuda_host_fork_server_never_imports_bitsandbytes(tmp_path, monkeypatch, tests_on_path):
    """The real default preload on a (flagged) CUDA host: nothing that initialises CUDA gets imported."""
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "1")
    runner = R.ProcessRunner("forkserver", list(DEFAULT_PRELOAD))
    runner.start()
    runner.stop()
    assert runner.name == "fork" and runner.fallback_reason is None
    loaded = set(runner.zygote["top_level_modules"])
    assert "torch" in loaded and "transformers" in loaded
    assert not loaded & set(R.CUDA_INIT_MODULES), loaded & set(R.CUDA_INIT_MODULES)
    assert runner.zygote["cuda_initialised"] is False


def test_cuda_host_detection_without_touching_cuda(monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "1")
    assert R.cuda_host()
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "0")
    assert not R.cuda_host()
    monkeypatch.delenv("VRAMSWEEP_CUDA_HOST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not R.cuda_host()


def test_trial_forked_after_cuda_init_fails_with_a_reason(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert T.forked_after_cuda_init()
    spec = _spec(tmp_path, "vramsweep.sweeper.runner:noop_trial")
    T._write_bad_fork_result(spec)
    res = json.loads(Path(spec.result_path).read_text())
    assert res["status"] == "error" and "isolation=spawn" in res["reason"]
