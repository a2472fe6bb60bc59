"""The GPU smoke's helpers on a CPU: the harmless-noise filter, the profiler's GPU-idle
arithmetic, and the offline bundle's trimming and activation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
#: The line Liger 0.8.5 + Triton 3.6 printed on import in every trial on the H200 image (2026-12-01).
LIGER_NOISE = (
    "Backend impl 'liger_kernel.ops.backends._ascend.rope' failed to load: cannot import name 'tanh' "
    "from 'triton.language.extra.libdevice'"
)


@pytest.fixture(scope="module")
def smoke():
    return load_script("gpu_smoke")


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
    prof = load_script("gpu_profile")
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
    smoke = load_script("gpu_smoke")
    line = smoke.profile_summary({"tokens": 1024, "walls_s": [0.001, 0.0005], "steps": [s0, s1]})
    assert line == "1024 tokens: 1 ms/step, GPU idle 30%, 2 kernels/step"


def test_bundle_trimming():
    b = load_script("gpu_bundle")
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
    b = load_script("gpu_bundle")
    site = _fake_bundle(tmp_path / "a", b.MANIFEST, "Requires-Dist: pytest>=1\n")
    assert b.main(["activate", str(site)]) == 0
    assert not (site / "pytest").exists() and (site.parent / "gpu_bundle.shadowed" / "pytest").is_dir()
    assert (site / "not_in_image_pkg").is_dir()
    # the image's pytest does not satisfy what a bundled distribution needs: the bundle's copy is used
    site = _fake_bundle(tmp_path / "b", b.MANIFEST, "Requires-Dist: pytest<1.0; python_version >= '3'\n")
    capsys.readouterr()
    assert b.main(["activate", str(site)]) == 0
    assert (site / "pytest").is_dir() and "not_in_image_pkg needs <1.0" in capsys.readouterr().out


# ============================================================== a smoke that fits its budget
SWEEP_FILE = ROOT / "sweeps" / "gpu_smoke.yaml"


DEVICE_ORDER = ["bundle", "env", "fork", "exact", "batching", "memprobe", "trial", "report"]
#: The second call's phases (--only): with 2026-12-04's measured costs they do not fit beside the first's.
SECOND_CALL = ["bundle", "env", "memprobe_fp32", "snapshot", "step_time", "report"]


def test_smoke_plan_is_the_issue_order_and_fits_its_budget_by_construction(smoke):
    """The device script's phases in the planned order, each cap >= its cost derived from the
    2026-12-04 H200 run, the default plan <= 540 s; the rest is a second call of <= 540 s."""
    phases = smoke.plan()
    assert [p.name for p in phases] == DEVICE_ORDER
    caps = {p.name: p.cap_s for p in phases}
    assert sum(caps.values()) <= smoke.DEFAULT_BUDGET_S <= 540
    second = smoke.plan(only=tuple(SECOND_CALL))
    assert [p.name for p in second] == SECOND_CALL and sum(p.cap_s for p in second) <= 540
    # 49,152 fitted and 65,536 went OOM on 2026-12-04: the next loan bisects between them
    assert all(49152 < n < 65536 for n in smoke.PROBE_COMPUTE_TOKENS)
    assert all(40_000 <= n <= 57_000 for n in smoke.PROBE_FP32_TOKENS)
    assert "adapter.dtype=compute" not in smoke.PROBE_BASE and "kernels=liger" in smoke.PROBE_BASE
    # a probe point: the measured 70 s slot (76 s for 1 step at 32,768, the first build) + its steps
    assert smoke.trial_cost_s(32768, 1) >= 76
    assert smoke.trial_cost_s(32768, 2) >= 61.3
    # a bisecting order of three runs two of them; an ascending one all
    cost = {n: smoke.trial_cost_s(n, 1) for n in smoke.PROBE_COMPUTE_TOKENS}
    assert caps["memprobe"] == pytest.approx(cost[57344] + max(cost[61440], cost[53248]))
    assert smoke.probe_cap_s((32768, 49152)) == pytest.approx(
        smoke.trial_cost_s(32768, 1) + smoke.trial_cost_s(49152, 1)
    )
    assert caps["trial"] >= smoke.trial_cost_s(max(smoke.PROBE_COMPUTE_TOKENS), smoke.TRIAL_STEPS)
    assert sum(p.cap_s for p in smoke.plan(scale=1800 / 540)) <= 1800


def test_smoke_caps_hold_what_runs_in_them(smoke):
    """Each cap holds what ran in it on the H200 (2026-12-04): the batching check's verdict at 23.8 s cold
    (its cap less the signal grace), the exactness check's 21.7 s warm and > 27 s cold, step_time's two
    cold children of >= 44 s; a step at 65,536 tokens costs ~1.48 x the 32,768-token rate per token
    (causal attention's share)."""
    caps = {p.name: p.cap_s for p in smoke.plan(only=tuple(DEVICE_ORDER + SECOND_CALL))}
    assert smoke.grace_plan(caps["batching"])[0] >= 23.8 * 1.3
    assert smoke.grace_plan(caps["exact"])[0] >= 2 * 27
    assert caps["step_time"] >= 2 * 44 + smoke.SPAWN_S
    assert caps["bundle"] >= 22.9 and caps["env"] >= 10.0
    assert smoke.ATTN_EQ_TOKENS == pytest.approx(34_860, rel=1e-3)
    per_token = smoke.step_s(65536) / 65536 / (smoke.step_s(32768) / 32768)
    assert per_token == pytest.approx(1.48, abs=0.01)
    assert smoke.step_s(32768) == pytest.approx(32768 / 5038, rel=1e-6)  # the measured anchor


def test_every_gpu_probe_point_composes(smoke, tmp_path):
    """Past Qwen3-8B's 40,960 positions a probe point carries YaRN (factor 4 over 32,768): without it every
    point from 45,056 up was refused as unsupported on the H200 (2026-12-04)."""
    from vramsweep.config import compose

    sm = _sm(smoke, tmp_path)
    for n in (32768, *smoke.PROBE_COMPUTE_TOKENS, *smoke.PROBE_FP32_TOKENS, 65536, 81920):
        for dtype in ("compute", "fp32"):
            ovs = sm.overrides(n, dtype, 1)
            assert ("rope=yarn" in ovs) == (n > 40960)
            compose(ovs, rules="config")  # raises ConfigError on a length past the positions


def test_probe_order_skips_past_an_oom_and_below_a_fit(smoke):
    skip = smoke.probe_order_skip
    assert skip(61440, [{"tokens": 57344, "status": "ok"}]) is None
    assert skip(53248, [{"tokens": 57344, "status": "ok"}]) == "57,344 tokens fitted"
    assert skip(61440, [{"tokens": 57344, "status": "oom"}]).startswith("stopped at the first OOM")
    assert skip(53248, [{"tokens": 57344, "status": "oom"}]) is None
    assert skip(53248, [{"tokens": 57344, "status": "unsupported"}]) is None


def test_only_runs_the_named_phases_and_says_the_rest_were_not_run(smoke, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(smoke, "environment", lambda python, cap: {"cuda_available": True, "device": "x"})
    for name in ("phase_fork", "phase_memprobe", "phase_trial", "phase_step_time", "phase_snapshot"):
        monkeypatch.setattr(smoke, name, lambda *a, _n=name, **k: ran.append(_n))
    monkeypatch.setattr(smoke, "phase_check", lambda sm, phase, *a: ran.append(phase))
    out = tmp_path / "out"
    rc = smoke.main(["--out", str(out), "--work", str(tmp_path / "w"), "--only", "batching,snapshot"])
    assert rc == 0 and ran == ["batching", "phase_snapshot"]
    md = (out / "summary.md").read_text()
    assert "- exact: not run: not selected (--only)" in md and "- memprobe: not run: not selected" in md
    with pytest.raises(SystemExit, match="unknown phase"):
        smoke.main(["--out", str(out), "--only", "memprobes"])


class _Args:
    dry_run, budget_s, overrides = False, 540.0, []


def _sm(smoke, tmp_path):
    phases = {p.name: p for p in smoke.plan(only=smoke.ALL_PHASES)}
    return smoke.Smoke(_Args(), phases, sys.executable, tmp_path / "smoke.log")


def test_memory_probe_stops_at_the_first_oom_and_the_trial_takes_the_longest_fit(
    smoke, tmp_path, monkeypatch
):
    calls = []

    def fake_point(sm, phase, tokens, dtype, steps, cap_s):
        calls.append((phase, tokens, dtype, steps))
        status = "oom" if tokens >= 65536 or (dtype == "fp32" and tokens > 50000) else "ok"
        return {"phase": phase, "tokens": tokens, "adapter": dtype, "status": status, "reason": ""}

    monkeypatch.setattr(smoke, "probe_point", fake_point)
    sm = _sm(smoke, tmp_path)
    smoke.phase_memprobe(sm, "memprobe", (32768, 49152, 65536, 81920), "compute")
    smoke.phase_memprobe(sm, "memprobe_fp32", (45056, 53248), "fp32")
    smoke.phase_trial(sm)
    assert [c[1] for c in calls] == [32768, 49152, 65536, 45056, 53248, 49152]  # 81,920 never started
    assert calls[-1] == ("trial", 49152, "compute", smoke.TRIAL_STEPS)
    by = {(r["phase"], r["tokens"]): r["status"] for r in sm.probes}
    assert by[("memprobe", 81920)] == "not run" and by[("memprobe", 65536)] == "oom"
    status = {r["phase"]: r["status"] for r in sm.results}
    assert status == {"memprobe": "PASS", "memprobe_fp32": "PASS", "trial": "PASS"}  # an OOM is a result
    md = smoke.render_device_summary(sm, __import__("datetime").datetime(2026, 12, 3))
    assert "longest that fitted: 49,152" in md and "Verdict: PASS" in md


def test_a_failed_or_cut_phase_never_stops_the_next(smoke, tmp_path, monkeypatch):
    """An error at one length fails its phase but the next phase runs; a cut point is "not run", no failure."""
    rows = iter([("error", "boom"), ("not run", "cut at the phase's cap"), ("ok", "")])

    def fake_point(sm, phase, tokens, dtype, steps, cap_s):
        st, why = next(rows, ("ok", ""))
        return {"phase": phase, "tokens": tokens, "adapter": dtype, "status": st, "reason": why}

    monkeypatch.setattr(smoke, "probe_point", fake_point)
    sm = _sm(smoke, tmp_path)
    smoke.phase_memprobe(sm, "memprobe", (32768, 49152, 65536), "compute")
    smoke.phase_memprobe(sm, "memprobe_fp32", (45056, 53248, 57344), "fp32")
    assert [r["status"] for r in sm.results] == ["FAIL", "PASS"]
    assert len(sm.probes) == 6  # every length of both phases was tried
    assert smoke._verdict_of("x\n", 1, True) == ("not run", "cut at its cap (smoke.log)")
    assert smoke._verdict_of("verdict: PASS (3 checks)\n", 0, False)[0] == "PASS"
    assert smoke._verdict_of("verdict: PASS\n", 1, False)[0] == "FAIL"


def test_a_probe_point_out_of_time_is_not_run(smoke, tmp_path):
    sm = _sm(smoke, tmp_path)
    row = smoke.probe_point(sm, "memprobe", 81920, "compute", 1, 1.0)
    assert row["status"] == "not run" and not (tmp_path / "smoke.log").exists()


def test_probe_row_records_the_allocators_figures():
    probe = load_script("gpu_memprobe")
    result = {
        "status": "ok",
        "metrics": {
            "peak_memory_bytes": 14 * 2**30,
            "cuda_max_allocated_bytes": 13 * 2**30,
            "tokens_per_s": 900.0,
        },
        "meta": {
            "host_memory": {"pool_bytes": 9 * 2**30},
            "build": {"knobs": {"offload": {}, "attention_heads": {}}},
        },
        "estimate": {"peak_memory_bytes": 13.5 * 2**30, "required_bytes": 13 * 2**30},
    }
    row = probe.probe_row(result, 65536, {"num_alloc_retries": 3}, 41.0)
    assert row["knobs"] == ["attention_heads", "offload"] and row["estimate_required_bytes"] == 13 * 2**30
    assert row["peak_reserved_bytes"] == 14 * 2**30 and row["peak_allocated_bytes"] == 13 * 2**30
    assert row["num_alloc_retries"] == 3 and row["pool_bytes"] == 9 * 2**30
    assert row["estimate_bytes"] == 13.5 * 2**30 and row["tokens"] == 65536
    assert probe.probe_row({"status": "oom", "reason": "CUDA out of memory\nmore"}, 1, None, 1)["reason"] == (
        "CUDA out of memory"
    )


def test_pinned_round_trip_checks_pinning_and_bytes(smoke):
    """The 64 MiB pinned round trip on a stand-in for torch.cuda (CPU here): equal bytes, both buffers pinned."""
    import torch

    class FakeEvent:
        t = 0.0

        def __init__(self, **kw):
            self.at = 0.0

        def record(self):
            FakeEvent.t += 1.0
            self.at = FakeEvent.t

        def elapsed_time(self, other):
            return (other.at - self.at) * 10.0  # 10 ms per copy

    class FakeTorch:
        uint8, randint, empty_like, equal = (
            torch.uint8,
            staticmethod(torch.randint),
            staticmethod(torch.empty_like),
            staticmethod(torch.equal),
        )

        class cuda:
            Event = FakeEvent
            synchronize = staticmethod(lambda: None)

    real_pin = torch.Tensor.pin_memory
    pinned = set()

    def pin(t):
        pinned.add(id(t))
        return t

    torch.Tensor.pin_memory = pin
    torch.Tensor.is_pinned = lambda t: id(t) in pinned  # type: ignore[method-assign]
    try:
        rt = smoke.pinned_round_trip(FakeTorch, nbytes=1 << 20, device="cpu")
    finally:
        torch.Tensor.pin_memory = real_pin
        del torch.Tensor.is_pinned
    assert rt["equal"] and rt["pinned"] and rt["h2d_gb_s"] == pytest.approx((1 << 20) / 0.01 / 1e9)


@pytest.mark.slow
def test_batch_check_catches_the_mean_of_means(monkeypatch, embedded_model_dir, capsys):
    """scripts/gpu_batch_check.py passes on CPU and fails when accumulation weighs micro-batches equally."""
    import vramsweep.loop as loop

    check = load_script("gpu_batch_check")
    assert check.main(["--device", "cpu"]) == 0
    monkeypatch.setattr(loop, "token_weights", lambda micro: [1.0 / len(micro)] * len(micro))
    assert check.main(["--device", "cpu"]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out


def test_batch_check_in_bf16_passes_and_fails_when_groups_cross_kv_heads(
    monkeypatch, embedded_model_dir, capsys
):
    """``--dtype bf16``: packed == unpacked and grouped == one call within 2e-2 on CPU; a grouping that mixes
    the kv heads' query heads (here: the groups' query heads reversed) fails it."""
    from vramsweep.longctx import attention as grouped

    check = load_script("gpu_batch_check")
    assert check.main(["--device", "cpu", "--dtype", "bf16", "--no-throughput"]) == 0
    assert '"bf16 packed, 2 head groups == packed"' in capsys.readouterr().out
    real = grouped.grouped_call

    def crossed(fn, groups, module, q, k, v, mask, **kw):
        return (
            real(fn, groups, module, q.flip(1), k, v, mask, **kw)
            if groups > 1
            else fn(module, q, k, v, mask, **kw)
        )

    monkeypatch.setattr(grouped, "grouped_call", crossed)
    assert check.main(["--device", "cpu", "--dtype", "bf16", "--no-throughput"]) == 1


def test_env_probe_reads_versions_without_importing(smoke, tmp_path, monkeypatch):
    """A cold ``import unsloth`` from a fresh bundle outlasted the probe's cap and aborted the whole smoke
    ("cannot import torch"); versions now come from the metadata and the module is never imported."""
    pkg = tmp_path / "unsloth"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported: a cold Unsloth import costs minutes')\n")
    (tmp_path / "unsloth-2026.10.9.dist-info").mkdir()
    (tmp_path / "unsloth-2026.10.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: unsloth\nVersion: 2026.10.9\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = smoke.probe_environment()
    assert env["versions"]["unsloth"] == "2026.10.9" and "unsloth" not in sys.modules
    assert env["versions"]["flash_attn"] is None  # absent here


def test_a_cut_phase_ends_by_its_cap(smoke, tmp_path):
    """The signal grace comes out of the cap (it was 80 s on top of it): a child that ignores SIGINT and
    SIGTERM is still gone by its 4 s cap."""
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('x', flush=True)\n"
        "time.sleep(120)\n"
    )
    t0 = __import__("time").perf_counter()
    rc, timed_out, _ = smoke.run_logged([sys.executable, "-c", code], 4.0, tmp_path / "l")
    wall = __import__("time").perf_counter() - t0
    assert timed_out and rc != 0 and wall <= 4.5, wall
    run_s, grace = smoke.grace_plan(470)
    assert run_s + sum(grace) == pytest.approx(470) and grace == smoke.GRACE_S


def test_a_trial_over_its_timeout_is_not_run_not_a_failure(smoke):
    """An Unsloth point building cold past the sweep's ``timeout_s: 90`` is "not run", not an error."""
    reason = "timeout: trial ran longer than hydra.sweeper.timeout_s=90 s and was killed"
    trials = [
        _trial(0, "ok"),
        _trial(1, "error", ["kernels=unsloth"], reason),
        _trial(2, "ok", ["tiling=on"]),
    ]
    ok, why = smoke.verdict(trials, 3, 1)
    assert ok, why
    assert "not run: 1 point(s) (1 over the trial timeout_s)" in why
    assert not smoke.verdict([*trials, _trial(3, "error", ["x=1"], "boom")], 4, 1)[0]


def test_smoke_runs_the_unproven_knobs_first(smoke):
    points = smoke.design_points(SWEEP_FILE)
    assert points[0][0] == "(baseline)"
    assert [c for c, _ in points[1:4]] == ["kernels=unsloth", "checkpointing=offload", "tiling=on"]
    assert smoke.unproven_first(points)
    assert not smoke.unproven_first([points[0], ("quant=nf4", []), ("kernels=unsloth", [])])


def test_smoke_plan_prints_caps_summing_within_budget(tmp_path):
    import subprocess

    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--plan"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "total 531 s <= 540 s" in proc.stdout
    names = [line.split()[5] for line in proc.stdout.splitlines() if line.startswith("  ") and " s +" in line]
    assert names == DEVICE_ORDER
    assert "61,440 (96 s)" in proc.stdout and "none past an OOM or below a fit" in proc.stdout  # why it fits


def _trial(n, status, change=None, reason=None):
    design = {"role": "baseline"} if change is None else {"role": "factor", "change": change}
    return {"trial": n, "status": status, "reason": reason, "overrides": [], "meta": {"design": design}}


def test_a_cut_trial_is_not_run_not_a_failure(smoke):
    """The sweep stopped at its cap after 3 of 6 points (one interrupted): PASS, the rest "not run"."""
    trials = [
        _trial(0, "ok"),
        _trial(1, "ok", ["kernels=unsloth"]),
        _trial(2, "error", ["checkpointing=offload"], "interrupted (Ctrl-C); re-run to resume"),
    ]
    ok, why = smoke.verdict(trials, 6, 1, timed_out=True)
    assert ok, why
    assert "not run: 4 point(s) (time cap)" in why
    points = smoke.design_points(SWEEP_FILE)
    rows = smoke.not_run_rows(points, trials, {}, "cut at the sweep's cap")
    assert [r["change"] for r in rows] == [
        "checkpointing=offload",
        "tiling=on",
        "context.max_tokens=4096 kernels=unsloth",
        "context.max_tokens=4096",
    ]
    assert {r["status"] for r in rows} == {"not run"}
    # what ran still counts: an error there fails, and a sweep that stopped by itself short of points fails
    assert not smoke.verdict([*trials, _trial(3, "error", ["tiling=on"], "boom")], 6, 1, timed_out=True)[0]
    assert not smoke.verdict(trials[:2], 6, 0)[0]


def test_unsloth_points_not_run_when_the_weights_folder_is_not_written(smoke):
    trials = [_trial(0, "ok"), _trial(1, "ok", ["checkpointing=offload"])]
    why = {"kernels=unsloth": "Unsloth weights folder not written within its 90 s cap"}
    ok, text = smoke.verdict(trials, 2, 0, not_run=list(why))
    assert ok and "not run: 1 point(s)" in text
    rows = smoke.not_run_rows(smoke.design_points(SWEEP_FILE)[:3], trials, why, "cut")
    assert [(r["change"], r["status"], r["reason"]) for r in rows] == [
        ("kernels=unsloth", "not run", why["kernels=unsloth"])
    ]


def test_carry_check_counts_the_tree_and_the_bundle(tmp_path):
    """What a device run carries: tracked + untracked-not-ignored files + the bundle, <= 64 MiB in all."""
    import subprocess

    bundle = load_script("gpu_bundle")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("wheels/\n")
    (repo / "tracked.bin").write_bytes(b"x" * 3 * 2**20)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    (repo / "untracked.bin").write_bytes(b"y" * 2 * 2**20)  # travels too (not ignored)
    (repo / "wheels").mkdir()
    (repo / "wheels" / "big.bin").write_bytes(b"z" * 9 * 2**20)  # ignored: not counted as tree
    tree = bundle.tree_bytes(repo)
    assert 5 * 2**20 <= tree < 5 * 2**20 + 100
    assert bundle.carry_check(repo, 58 * 2**20, 64.0)[0] is True
    ok, text = bundle.carry_check(repo, 60 * 2**20, 64.0)  # 60 MiB alone would have passed the old check
    assert not ok and "tree 5.0 MiB + bundle 60.0 MiB" in text


@pytest.mark.slow
def test_longctx_exactness_check_runs_on_cpu():
    """scripts/gpu_longctx_check.py (the smoke's "exact" phase) passes on CPU: offload == on and
    offload+tiling == on+tiling with LoRA dropout on NF4 layers, tiles in every pass, an exact host pool."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_longctx_check.py"),
            "--device",
            "cpu",
            "--tokens",
            "64",
            "--tile",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: PASS" in proc.stdout
    assert proc.stdout.count('"ok": true') == 7


# ============================================================== the bundle, checked before the loan
def _packed_bundle(path: Path, dists: dict[str, str], wanted: list[str] | None = None) -> Path:
    """A packed bundle whose BUNDLE.json lists ``{name: version}`` (and the WANTED list it was built from)."""
    import io
    import tarfile

    manifest = {
        "python": "3.12",
        "dists": {n: {"dist": n, "version": v, "top": [n]} for n, v in dists.items()},
    }
    if wanted is not None:
        manifest["wanted"] = wanted
    data = json.dumps(manifest).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo("gpu_bundle/BUNDLE.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def _wanted_dists(b) -> dict[str, str]:
    from packaging.requirements import Requirement

    return {b.norm(Requirement(w).name): str(Requirement(w).specifier).lstrip("=") for w in b.WANTED}


def test_bundle_pins_what_the_fork_server_and_data_stack_import():
    b = load_script("gpu_bundle")
    assert {"torchao==0.18.0", "datasets==4.8.5", "pyarrow==26.0.1"} <= set(b.WANTED)


def test_bundle_manifest_is_checked_against_wanted(tmp_path, capsys):
    b = load_script("gpu_bundle")
    good = _wanted_dists(b)
    assert b.manifest_mismatches({"dists": {b.norm(k): {"version": v} for k, v in good.items()}}) == []
    stale = {**good, "torchao": "0.17.0"}
    stale.pop("pyarrow")
    bad = b.manifest_mismatches({"dists": {k: {"version": v} for k, v in stale.items()}, "wanted": ["x==1"]})
    assert any("torchao: wanted ==0.18.0, bundle has 0.17.0" in line for line in bad), bad
    assert any("pyarrow" in line and "not in the bundle" in line for line in bad), bad
    assert any("another WANTED list" in line for line in bad), bad
    # found in wheels/ before the shared copy; the streamed manifest decides the exit status
    _packed_bundle(tmp_path / "shared" / "gpu-bundle" / b.BUNDLE_FILE, stale)
    assert b.find_bundle(tmp_path) == (tmp_path / "shared" / "gpu-bundle" / b.BUNDLE_FILE).resolve()
    assert b.main(["verify", "--root", str(tmp_path)]) == 1
    assert "does NOT match" in capsys.readouterr().out
    _packed_bundle(tmp_path / "wheels" / b.BUNDLE_FILE, good, list(b.WANTED))
    assert b.find_bundle(tmp_path) == (tmp_path / "wheels" / b.BUNDLE_FILE).resolve()
    assert b.main(["verify", "--root", str(tmp_path)]) == 0
    assert "manifest matches" in capsys.readouterr().out
    assert b.main(["verify", "--root", str(tmp_path / "empty" / "repo")]) == 3


def test_smoke_refuses_a_stale_bundle_before_anything_runs(tmp_path):
    """A GPU run (PYTHON given: no CUDA probe in the shell) with a bundle that does not match WANTED stops with
    exit 2 before extracting or running anything; --plan says the same without stopping."""
    import subprocess

    b = load_script("gpu_bundle")
    stale = _packed_bundle(tmp_path / "stale.tar.xz", {**_wanted_dists(b), "torchao": "0.17.0"})
    env = {
        **__import__("os").environ,
        "PYTHON": sys.executable,
        "VRAMSWEEP_GPU_BUNDLE": str(stale),
        "VRAMSWEEP_CACHE": str(tmp_path / "cache"),
    }
    script = str(ROOT / "scripts" / "gpu_smoke.sh")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torchao: wanted ==0.18.0, bundle has 0.17.0" in proc.stdout and "rebuild" in proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing extracted
    plan = subprocess.run(["bash", script, "--plan"], capture_output=True, text=True, timeout=120, env=env)
    assert plan.returncode == 0 and "does NOT match" in plan.stdout, plan.stdout + plan.stderr


def test_smoke_skips_plots_without_matplotlib_and_says_so(smoke):
    """Neither the GPU image nor the bundle has matplotlib; the smoke no longer requires it."""
    assert "plots: skipped" in smoke.plots_note({"versions": {"matplotlib": None}})
    assert smoke.plots_note({"versions": {"matplotlib": "3.10"}}) is None
    assert '"matplotlib"' not in (ROOT / "scripts" / "gpu_smoke.sh").read_text()


def test_a_probe_point_this_machine_cannot_run_is_unsupported_not_a_crash(capsys):
    """kernels=liger on a CPU: the probe prints an ``unsupported`` row (a result) instead of a traceback."""
    probe = load_script("gpu_memprobe")
    assert probe.main(["model=tiny", "hardware=cpu", "kernels=liger", "context.max_tokens=256"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("PROBE "))
    row = json.loads(line[6:])
    assert row["status"] == "unsupported" and "kernels=liger needs CUDA" in row["reason"]


def test_probe_overrides_gpu_and_dry(smoke, tmp_path):
    sm = _sm(smoke, tmp_path)
    ovs = sm.overrides(65536, "compute", 1)
    assert ovs[:2] == ["model=qwen3_8b", "hardware=rtx4080_16gb"] and "kernels=liger" in ovs
    assert {
        "adapter.dtype=compute",
        "context.max_tokens=65536",
        "checkpointing=offload",
        "tiling=mlp",
    } <= set(ovs)
    sm.dry = True
    dry = sm.overrides(256, "fp32", 2)
    assert dry[:2] == ["model=tiny", "hardware=cpu"] and dry.index("kernels=none") > dry.index(
        "kernels=liger"
    )
    assert "train.measure_warmup_steps=1" in dry and "adapter.dtype=fp32" in dry


def test_a_failed_environment_probe_does_not_stop_the_smoke(smoke, tmp_path, monkeypatch):
    """The env probe timing out (it once aborted the whole smoke) fails its phase; the next phases still run."""
    ran = []
    monkeypatch.setattr(smoke, "environment", lambda python, cap: {"error": "took more than its 20 s cap"})
    for name in ("phase_fork", "phase_memprobe", "phase_trial", "phase_step_time"):
        monkeypatch.setattr(smoke, name, lambda *a, _n=name, **k: ran.append(_n))
    monkeypatch.setattr(smoke, "phase_check", lambda sm, phase, *a: ran.append(phase))
    rc = smoke.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert rc == 1 and ran == ["phase_fork", "exact", "batching", "phase_memprobe", "phase_trial"]
    assert (
        "- env: FAIL: environment probe: took more than its 20 s cap"
        in (tmp_path / "out" / "summary.md").read_text()
    )


def test_memsnapshot_replays_the_trace_to_its_peak_and_names_the_owners():
    snap = load_script("gpu_memsnapshot")
    fr = lambda name, fn: [  # noqa: E731 - innermost first, as the allocator records them
        {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
        {"filename": f"/x/vramsweep/{fn}.py", "line": 7, "name": name},
    ]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 30},
        {"action": "alloc", "addr": 1, "size": 100, "frames": fr("weights", "build")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": fr("act", "loop")},
        {"action": "alloc", "addr": 3, "size": 50, "frames": fr("act", "loop")},
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 4, "size": 70, "frames": fr("tile", "tiling")},  # peak: 100 + 50 + 70
        {"action": "free_completed", "addr": 4, "size": 70},
        {"action": "alloc", "addr": 5, "size": 60, "frames": fr("act", "loop")},  # 210 < 220
    ]
    rep = snap.replay(trace)
    assert (rep["peak_bytes"], rep["peak_event"]) == (220, 6)
    s = snap.summarise(rep)
    assert [(o["owner"], o["bytes"], o["count"]) for o in s["owners"]] == [
        ("weights@vramsweep/build.py:7", 100, 1),
        ("tile@vramsweep/tiling.py:7", 70, 1),
        ("act@vramsweep/loop.py:7", 50, 1),
    ]
    assert "| `weights@vramsweep/build.py:7` |" in snap.render(s, ["a=b"])


def test_grouped_attention_probe_is_ascending_on_the_full_stack_and_fits_one_call(smoke, tmp_path):
    """Issue 53's device phase: 57,344 / 65,536 / 73,728 ascending (all three at most, stopping at the first
    OOM) on the long-context stack + paged 8-bit AdamW + 4 head groups with YaRN; every point composes
    under the rules; the phase (with env and report) fits one 540 s call."""
    from vramsweep.config import compose

    assert smoke.PROBE_GROUPED_TOKENS == (57344, 65536, 73728) and "memprobe_grouped" in smoke.OPT_IN
    phases = smoke.plan(only=("env", "memprobe_grouped", "report"))
    caps = {p.name: p.cap_s for p in phases}
    assert caps["memprobe_grouped"] == pytest.approx(
        sum(smoke.trial_cost_s(n, 1) for n in smoke.PROBE_GROUPED_TOKENS)
    )
    assert sum(caps.values()) <= 540
    sm = _sm(smoke, tmp_path)
    for n in smoke.PROBE_GROUPED_TOKENS:
        ovs = sm.overrides(n, "compute", 1, "memprobe_grouped")
        assert {"tiling.attention_heads=4", "optimizer=paged_adamw_8bit", "rope=yarn"} <= set(ovs)
        assert "checkpointing=offload" in ovs and "kernels=liger" in ovs and "quant=nf4_dq" in ovs
        compose(ovs, rules="config")
    assert "tiling.attention_heads=4" not in sm.overrides(57344, "compute", 1)  # the plain memprobe: none
    third = smoke.plan(only=("env", "packing_bf16", "memprobe_grouped", "report"))
    assert [p.name for p in third] == ["bundle", "env", "packing_bf16", "memprobe_grouped", "report"]
    assert sum(p.cap_s for p in third) <= 540
    skip = smoke.probe_order_skip
    assert skip(65536, [{"tokens": 57344, "status": "oom"}]).startswith("stopped at the first OOM")
    assert skip(73728, [{"tokens": 57344, "status": "ok"}, {"tokens": 65536, "status": "ok"}]) is None
