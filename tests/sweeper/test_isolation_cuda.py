"""Trial isolation on CUDA hosts: no trial may run in a process forked after CUDA was initialised.

The 2026-12-01 GPU run: the fork server's default preload imported peft -> bitsandbytes, which queries the
device (initialising CUDA); every forked trial then failed "Cannot re-initialize CUDA in forked subprocess".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import trial_spec
from vramsweep.sweeper import isolation as R
from vramsweep.sweeper import trialproc as T
from vramsweep.sweeper.settings import DEFAULT_PRELOAD

TESTS = Path(__file__).resolve().parents[1]


def _spec(tmp_path: Path, fn: str, n: int = 0) -> T.TrialSpec:
    return trial_spec(
        tmp_path,
        n,
        trial_id=-1,
        sweep_name="iso",
        study_name="iso",
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


@pytest.mark.parametrize(("mode", "cuda_host"), [("bad_fork", "0"), ("driver", "1")])
def test_fork_server_is_refused_when_a_fork_cannot_use_cuda(
    tmp_path, monkeypatch, tests_on_path, mode, cuda_host
):
    """Poisoning that ``torch.cuda.is_initialized()`` never shows: a device count without NVML
    (torch's bad-fork flag), or a library touching the driver (only a real ``torch.cuda.init()`` in a
    forked child fails). The warm-up child probes for real; the runner falls back to spawn with the
    reason, and the trial that uses the GPU runs ok instead of ending in ``error``."""
    monkeypatch.setenv("VRAMSWEEP_SIM_POISON", mode)
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", cuda_host)
    runner = R.ProcessRunner("forkserver", ["torch", "_cuda_init_sim"])
    runner.start()
    try:
        rep = runner.run(_spec(tmp_path, "_cuda_init_sim:trial"), tick_s=0.05)
    finally:
        runner.stop()
    assert rep.result["status"] == "ok", rep.result.get("reason")
    assert runner.zygote.get("cuda_initialised") is False  # the old check saw nothing
    assert runner.fork_probe["usable"] is False
    # The trial imported the module itself: it was not forked from the poisoned server.
    assert rep.result["meta"]["imported_in"] == rep.result["meta"]["pid"]
    assert runner.name == "spawn" and "spawn" in (runner.fallback_reason or "")
    expected = "bad fork" if mode == "bad_fork" else "torch.cuda.init() failed"
    assert expected in runner.fallback_reason


def test_fork_server_serves_when_the_probe_passes(tmp_path, monkeypatch, tests_on_path):
    """The probe does not cost the warm start where forks are fine (CPU host, nothing poisoned)."""
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "0")
    runner = R.ProcessRunner("forkserver", ["torch"])
    runner.start()
    runner.stop()
    assert runner.name == "fork" and runner.fallback_reason is None
    assert runner.fork_probe == {**runner.fork_probe, "usable": True, "bad_fork": False, "cuda_init": None}


def test_unusable_reasons():
    assert R.fork_unusable_reason({}, {"usable": True, "bad_fork": False, "cuda_init": "ok"}, []) is None
    why = R.fork_unusable_reason({}, {"usable": False, "cuda_init": "RuntimeError: x"}, ["torchao"])
    assert "torch.cuda.init() failed" in why and "pulled in torchao" in why
    assert "died" in R.fork_unusable_reason({}, {"usable": False, "exitcode": -11}, [])
    assert "initialised CUDA" in R.fork_unusable_reason({"cuda_initialised": True}, {"usable": True}, [])


def test_cuda_host_preload_keeps_torchao_and_friends_out():
    """The GPU bundle makes torchao importable; transformers' torchao quantizer then imports it."""
    assert {"torchao", "cut_cross_entropy", "xformers", "flash_attn"} <= set(R.CUDA_INIT_MODULES)
    assert R.effective_preload(["torch", "torchao.quantization"], cuda=True)[1] == ["torchao.quantization"]


@pytest.mark.gpu
def test_real_cuda_poisoning_falls_back_to_spawn(tmp_path, monkeypatch, tests_on_path):
    """On a CUDA host: a preload that counts devices without NVML poisons forks for real."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "1")
    runner = R.ProcessRunner("forkserver", ["torch", "_cuda_poison_real"])
    runner.start()
    try:
        rep = runner.run(_spec(tmp_path, "_cuda_poison_real:trial"), tick_s=0.05)
    finally:
        runner.stop()
    assert runner.name == "spawn", runner.fork_probe
    assert rep.result["status"] == "ok", rep.result.get("reason")


@pytest.mark.gpu
def test_real_cuda_host_default_preload_forks_usable(tmp_path, monkeypatch, tests_on_path):
    """On a CUDA host, with whatever the image + bundle make importable: the default preload's forks can
    initialise CUDA (else the runner says which module the preload pulled in)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = R.ProcessRunner("forkserver", list(DEFAULT_PRELOAD))
    runner.start()
    runner.stop()
    assert runner.fork_probe.get("cuda_init") == "ok", (runner.fallback_reason, runner.pulled_in)
    assert runner.name == "fork", runner.fallback_reason


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
    spec = _spec(tmp_path, "trial_overhead:noop_trial")
    T._write_bad_fork_result(spec)
    res = json.loads(Path(spec.result_path).read_text())
    assert res["status"] == "error" and "isolation=spawn" in res["reason"]


def test_a_trial_started_after_ctrl_c_is_killed_at_once(tmp_path, monkeypatch, tests_on_path):
    """Ctrl-C (``kill_all``) racing a trial's start: the trial process is killed as it starts instead of
    running unseen (a hanging trial then hung the sweep, and the suite's Ctrl-C test, for good)."""
    import time

    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"faults": {"0": "hang"}}))
    runner = R.ProcessRunner("forkserver", ["fakes"])
    runner.start()
    try:
        runner.kill_all()  # Ctrl-C arrives before the worker's trial process is registered
        spec = _spec(tmp_path, "fakes:fake_trial")
        spec.env = dict(os.environ)
        t0 = time.perf_counter()
        report = runner.run(spec, tick_s=0.2, timeout_s=120)
        wall = time.perf_counter() - t0
    finally:
        runner.stop()
    assert wall < 60, f"the hanging trial ran for {wall:.0f} s after Ctrl-C"
    assert report.result["status"] == "error" and "SIGKILL" in report.result["reason"], report.result


# A GPU host as torchao sees it, simulated on CPU: torch.cuda says a device is there and counts the capability
# queries; a fake torchao 0.18.0 (with its dist-info, so transformers' is_torchao_available() says yes) queries
# the capability at import, as torchao.prototype.mx_formats.kernels does.
_GPU_HOST_PRELOAD = """
import json, os, sys
import torch
calls = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda *a, **k: (calls.append(1), (9, 0))[1]
from vramsweep.sweeper import isolation as R
from vramsweep.sweeper.settings import DEFAULT_PRELOAD
if sys.argv[1] == "preload":
    modules, left_out = R.effective_preload(list(DEFAULT_PRELOAD), cuda=True)
    os.environ["VRAMSWEEP_PRELOAD"] = ",".join(modules)
    import vramsweep.sweeper.zygote as Z
    failed = Z.FAILED
else:
    import importlib
    modules, left_out, failed = [sys.argv[1]], [], {}
    importlib.import_module(sys.argv[1])
print(json.dumps({"calls": len(calls), "torchao": "torchao" in sys.modules, "modules": modules,
                  "left_out": left_out, "failed": failed}))
"""


def _fake_torchao(root: Path) -> Path:
    pkg = root / "torchao"
    (pkg / "prototype" / "safetensors").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        'import torch\n__version__ = "0.18.0"\ntorch.cuda.get_device_capability()\n'
    )
    (pkg / "prototype" / "__init__.py").write_text("")
    (pkg / "prototype" / "safetensors" / "__init__.py").write_text("")
    (pkg / "prototype" / "safetensors" / "safetensors_support.py").write_text(
        "def flatten_tensor_state_dict(*a, **k):\n    return a\n"
    )
    meta = root / "torchao-0.18.0.dist-info"
    meta.mkdir()
    meta.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 0.18.0\n")
    return root


def _gpu_host_import(tmp_path: Path, what: str) -> dict:
    import subprocess
    import sys

    fake = _fake_torchao(tmp_path / "site")
    src = Path(R.__file__).resolve().parents[2]
    env = {**os.environ, "VRAMSWEEP_CUDA_HOST": "1", "PYTHONPATH": os.pathsep.join([str(src), str(fake)])}
    env.pop("VRAMSWEEP_ZYGOTE_STATUS", None)
    out = subprocess.run(
        [sys.executable, "-c", _GPU_HOST_PRELOAD, what], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchao_simulation_queries_the_device_through_modeling_utils(tmp_path):
    """The control: with the fake torchao importable, transformers.modeling_utils (a CUDA-safe extra before the
    CUDA-host preload was fixed) imports it and queries the device once, as the real torchao 0.18.0 does on the card."""
    got = _gpu_host_import(tmp_path, "transformers.modeling_utils")
    assert got["torchao"] is True and got["calls"] == 1, got


def test_cuda_host_preload_with_torchao_importable_never_queries_the_device(tmp_path):
    """The CUDA-host default preload, with torchao importable (the GPU bundle), imports nothing that
    calls torch.cuda.get_device_capability(): the zygote stays fork-safe and trials are forked, not spawned."""
    got = _gpu_host_import(tmp_path, "preload")
    assert got["calls"] == 0 and got["torchao"] is False, got
    assert {"transformers.modeling_utils", "transformers.models.auto.modeling_auto"} <= set(got["left_out"])
    assert "transformers" in got["modules"] and "accelerate" in got["modules"] and not got["failed"], got


def test_pulls_in_is_host_dependent(monkeypatch):
    """Without torchao importable, modeling_utils stays in the CUDA host's preload (its imports come warm)."""
    monkeypatch.setattr(R, "importable", lambda name: False)
    assert "transformers.modeling_utils" in R.effective_preload(list(DEFAULT_PRELOAD), cuda=True)[0]
    monkeypatch.setattr(R, "importable", lambda name: name == "torchao")
    modules, left_out = R.effective_preload(list(DEFAULT_PRELOAD), cuda=True)
    assert "transformers.modeling_utils" not in modules and "transformers.modeling_utils" in left_out
