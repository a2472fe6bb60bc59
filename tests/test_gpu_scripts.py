"""The GPU smoke's helpers on a CPU (issue 10): the harmless-noise filter, the profiler's GPU-idle
arithmetic, and the offline bundle's trimming and activation."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The line Liger 0.8.5 + Triton 3.6 printed on import in every trial on the H200 image (2026-12-01).
LIGER_NOISE = (
    "Backend impl 'liger_kernel.ops.backends._ascend.rope' failed to load: cannot import name 'tanh' "
    "from 'triton.language.extra.libdevice'"
)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke():
    return _load("gpu_smoke")


def test_liger_ascend_noise_is_filtered_and_nothing_else(smoke):
    assert smoke.is_harmless(LIGER_NOISE)
    assert smoke.is_harmless(f"/x/liger_kernel/ops/backends/__init__.py:41: UserWarning: {LIGER_NOISE}\n")
    for line in (
        "ImportError: cannot import name 'tanh' from 'triton.language.math'",  # a real failure elsewhere
        "Backend impl 'liger_kernel.ops.backends._ascend.rope' failed to load: CUDA error",
        "[####] 3/10 trial 0002 ok | peak 9.1 GiB",
    ):
        assert not smoke.is_harmless(line), line
    flt = smoke.NoiseFilter()
    lines = [
        "vramsweep: trial 0 started\n",
        f"/x/backends/__init__.py:41: UserWarning: {LIGER_NOISE}\n",
        "  warnings.warn(\n",  # the warning's source echo goes with it
        "  indented output that stays\n",
        "vramsweep: trial 0 ok\n",
    ]
    kept = [x for x in lines if flt.keep(x)]
    assert kept == [lines[0], lines[3], lines[4]] and flt.dropped == 1


def test_run_logged_filters_the_console_log_only(smoke, tmp_path):
    trial_log = tmp_path / "0000.log"
    code = (
        "import sys\n"
        f"open({str(trial_log)!r}, 'w').write({LIGER_NOISE!r} + '\\n')\n"  # what a trial writes to its own log
        f"print({LIGER_NOISE!r}, file=sys.stderr)\n"
        "print('real output')\n"
    )
    script = tmp_path / "child.py"
    script.write_text(code)
    log = tmp_path / "smoke.log"
    rc, timed_out, text = smoke.run_logged([sys.executable, str(script)], 60, log)
    assert (rc, timed_out) == (0, False)
    assert "real output" in text and "tanh" not in text
    body = log.read_text()
    assert "real output" in body and "cannot import name 'tanh'" not in body
    assert "left out 1 harmless line(s)" in body
    assert LIGER_NOISE in trial_log.read_text()  # the trial log keeps it


def test_run_logged_interrupts_over_budget(smoke, tmp_path):
    rc, timed_out, _ = smoke.run_logged(
        [sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"], 1.5, tmp_path / "l"
    )
    assert timed_out and rc != 0


def test_profile_gpu_idle_fraction_from_a_trace():
    prof = _load("gpu_profile")
    trace = {
        "traceEvents": [
            {"name": "vramsweep_step_0", "cat": "user_annotation", "ts": 1000, "dur": 1000},
            {"name": "vramsweep_step_1", "cat": "user_annotation", "ts": 3000, "dur": 500},
            {"name": "k1", "cat": "kernel", "ts": 1100, "dur": 200},
            {"name": "k2", "cat": "kernel", "ts": 1200, "dur": 200},  # overlaps k1: busy 1100-1400
            {"name": "m", "cat": "gpu_memcpy", "ts": 1900, "dur": 300},  # clipped at the step end (2000)
            {"name": "k3", "cat": "kernel", "ts": 3000, "dur": 500},  # step 1 fully busy
            {"name": "aten::mm", "cat": "cpu_op", "ts": 1000, "dur": 900},
        ]
    }
    s0, s1 = prof.step_stats(trace)
    assert s0["wall_ms"] == pytest.approx(1.0) and s0["gpu_busy_ms"] == pytest.approx(0.4)
    assert s0["gpu_idle_fraction"] == pytest.approx(0.6) and s0["kernels"] == 2
    assert s1["gpu_idle_fraction"] == pytest.approx(0.0) and s1["kernels"] == 1
    cpu_only = prof.step_stats({"traceEvents": trace["traceEvents"][:2]})
    assert cpu_only[0]["gpu_idle_fraction"] is None
    smoke = _load("gpu_smoke")
    line = smoke.profile_summary({"tokens": 1024, "walls_s": [0.001, 0.0005], "steps": [s0, s1]})
    assert line == "1024 tokens: 1 ms/step, GPU idle 30%, 2 kernels/step"


def test_bundle_trimming():
    b = _load("gpu_bundle")
    keep = [
        ("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda130.so"),
        ("bitsandbytes", "bitsandbytes/libbitsandbytes_cpu.so"),
        ("pyarrow", "pyarrow/libarrow.so.2600"),
        ("pyarrow", "pyarrow/libarrow_substrait.so.2600"),  # every pyarrow module NEEDs it
        ("pyarrow", "pyarrow/libarrow_python.so.2600"),
        ("unsloth", "unsloth/models/llama.py"),
        ("pandas", "pandas/core/frame.py"),
    ]
    drop = [
        ("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda128.so"),
        ("pyarrow", "pyarrow/libarrow_flight.so.2600"),
        ("pyarrow", "pyarrow/libarrow_python.so.2600.1.0"),
        ("pyarrow", "pyarrow/include/arrow/api.h"),
        ("unsloth", "studio/frontend/index.js"),
        ("pandas", "pandas/tests/frame/test_api.py"),
        ("torchao", "test/test_ops.py"),
    ]
    assert [d for d, p in keep if b.trimmed_away(d, p)] == []
    assert [d for d, p in drop if not b.trimmed_away(d, p)] == []


def _fake_bundle(root: Path, manifest_name: str, requires: str = "") -> Path:
    site = root / "gpu_bundle"
    for top in ("pytest", "pytest-9.0.dist-info", "not_in_image_pkg", "not_in_image_pkg-1.0.dist-info"):
        (site / top).mkdir(parents=True)
    meta = "Metadata-Version: 2.1\nName: not-in-image-pkg\nVersion: 1.0\n" + requires
    (site / "not_in_image_pkg-1.0.dist-info" / "METADATA").write_text(meta)
    (site / manifest_name).write_text(
        json.dumps(
            {
                "dists": {
                    "pytest": {"dist": "pytest", "version": "9.0", "top": ["pytest", "pytest-9.0.dist-info"]},
                    "not-in-image-pkg": {
                        "dist": "not-in-image-pkg",
                        "version": "1.0",
                        "top": ["not_in_image_pkg", "not_in_image_pkg-1.0.dist-info"],
                    },
                }
            }
        )
    )
    return site


def test_bundle_activation_lets_the_image_copy_win(tmp_path, capsys):
    b = _load("gpu_bundle")
    site = _fake_bundle(tmp_path / "a", b.MANIFEST, "Requires-Dist: pytest>=1\n")
    assert b.main(["activate", str(site)]) == 0
    assert not (site / "pytest").exists() and (site.parent / "gpu_bundle.shadowed" / "pytest").is_dir()
    assert (site / "not_in_image_pkg").is_dir()
    # the image's pytest does not satisfy what a bundled distribution needs: the bundle's copy is used
    site = _fake_bundle(tmp_path / "b", b.MANIFEST, "Requires-Dist: pytest<1.0; python_version >= '3'\n")
    capsys.readouterr()
    assert b.main(["activate", str(site)]) == 0
    assert (site / "pytest").is_dir() and "not_in_image_pkg needs <1.0" in capsys.readouterr().out
