"""Issue 53's device phases on a CPU: scripts/gpu_resume_check.py (a production run's resume with and without
``train.deterministic``), scripts/gpu_use_check.py (``generate`` / ``export --merge`` of an NF4 run), the
packing throughput pass of scripts/gpu_batch_check.py, and the smoke's plan and summary lines for them."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
THIRD_CALL = ("packing_bf16", "resume", "nf4_use", "memprobe_grouped")


@pytest.fixture(scope="module")
def smoke():
    return load_script("gpu_smoke")


@pytest.fixture(scope="module")
def resume():
    return load_script("gpu_resume_check")


@pytest.fixture(scope="module")
def use():
    return load_script("gpu_use_check")


# ------------------------------------------------------------------------------------------------ plan
def test_every_call_of_the_loan_fits_540_s_and_the_third_holds_the_new_phases(smoke):
    """The loan's three calls (the default plan, the second and the third ``--only`` lists) each sum to at
    most 540 s of caps; the third runs packing_bf16, resume, nf4_use and memprobe_grouped; the dry run and
    ``--plan`` print each call's sum."""
    assert smoke.CALLS[2] == THIRD_CALL
    for only in smoke.CALLS:
        names = (*only, "env", "report") if only else None
        assert sum(p.cap_s for p in smoke.plan(only=names)) <= smoke.DEFAULT_BUDGET_S <= 540
    third = [p.name for p in smoke.plan(only=(*THIRD_CALL, "env", "report"))]
    assert third == ["bundle", "env", "packing_bf16", "resume", "nf4_use", "memprobe_grouped", "report"]
    text = smoke.render_calls()
    assert "--only packing_bf16,resume,nf4_use,memprobe_grouped: 538 s <= 540 s" in text
    assert "bash scripts/gpu_smoke.sh: 531 s <= 540 s" in text and "!" not in text
    assert {"resume", "nf4_use", "packing_bf16"} <= set(smoke.OPT_IN)  # never in the default call
    # each new cap: its interpreters' work (the batching check's 23.8 s cold on the H200) x 1.3 after the grace
    caps = {p.name: p.cap_s for p in smoke.plan(only=smoke.ALL_PHASES)}
    assert smoke.grace_plan(caps["resume"])[0] >= 2 * 23.8 * 1.3 - 0.5
    assert smoke.grace_plan(caps["nf4_use"])[0] >= 23.8 * 1.3
    assert smoke.grace_plan(caps["packing_bf16"])[0] >= (23.8 + 5) * 1.3 - 0.5


def test_the_dry_run_prints_the_calls_sums(tmp_path):
    import subprocess

    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--plan", "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "the loan's calls on a GPU" in proc.stdout
    assert "--only packing_bf16,resume,nf4_use,memprobe_grouped: 538 s <= 540 s" in proc.stdout
    names = [line.split()[5] for line in proc.stdout.splitlines() if line.startswith("  ") and " s +" in line]
    assert names[names.index("packing_bf16") : names.index("memprobe") + 1] == [
        "packing_bf16",
        "resume",
        "nf4_use",
        "memprobe",
    ]


# ---------------------------------------------------------------------------------------------- resume
def _rep(device="cuda", det=True, spread=0.0, resumed=0.0, bitwise=True, planned=True):
    return {
        "device": device,
        "deterministic": det,
        "as_planned": planned,
        "statuses": {"whole_a": "ok"},
        "resumed_next_step": 3,
        "spread": {"bitwise": bitwise and spread == 0, "max_abs": spread},
        "resume": {"bitwise": bitwise and resumed == 0, "max_abs": resumed},
        "losses_equal": bitwise,
        "within_spread": resumed <= spread,
    }


def test_resume_judge_holds_bitwise_only_where_promised(resume):
    assert resume.judge(_rep())[0] is True
    ok, why = resume.judge(_rep(det=True, resumed=2e-7, bitwise=False))
    assert ok is False and "bitwise promised, not met" in why  # deterministic CUDA: must be bitwise
    ok, why = resume.judge(_rep(det=False, spread=1e-6, resumed=2e-6, bitwise=False))
    assert ok is True and "within the spread: False" in why and "2e-06" in why  # recorded, not judged
    assert (
        resume.judge(_rep(device="cpu", det=False, resumed=1e-7, bitwise=False))[0] is False
    )  # CPU: bitwise
    assert resume.judge(_rep(planned=False))[0] is False
    why = "RuntimeError: scatter_add_cuda_kernel does not have a deterministic implementation"
    ok, text = resume.judge({**_rep(planned=False), "reasons": {"whole_a": why}})
    assert ok is False and text.endswith(f"; whole_a: {why}")  # the run's own reason, for the device log


def test_adapter_diff_sees_one_ulp(resume, tmp_path):
    import torch
    from safetensors.torch import save_file

    t = {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.randn(8, 4)}
    for name, tensors in (("x", t), ("y", {k: v.clone() for k, v in t.items()})):
        (tmp_path / name / "adapter").mkdir(parents=True)
        save_file(tensors, str(tmp_path / name / "adapter" / "adapter_model.safetensors"))
    same = resume.adapter_diff(tmp_path / "x", tmp_path / "y")
    assert same == {"bitwise": True, "max_abs": 0.0, "tensors": 2}
    u = {k: v.clone() for k, v in t.items()}
    u["a.lora_B.weight"][0, 0] = torch.nextafter(u["a.lora_B.weight"][0, 0], torch.tensor(math.inf))
    save_file(u, str(tmp_path / "y" / "adapter" / "adapter_model.safetensors"))
    one = resume.adapter_diff(tmp_path / "x", tmp_path / "y")
    assert one["bitwise"] is False and 0 < one["max_abs"] < 1e-6


def test_step_time_ratio_is_paired_by_run(resume):
    reps = {
        True: {"step_time_s": {"whole_a": 3.0, "whole_b": 2.4}},
        False: {"step_time_s": {"whole_a": 2.0, "whole_b": 2.0}},
    }
    r = resume.step_time_ratio(reps)
    assert r["pairs"] == {"whole_a": 1.5, "whole_b": 1.2} and r["mean"] == pytest.approx(1.35)
    assert resume.step_time_ratio({True: {"step_time_s": {}}, False: {}})["mean"] is None


def test_resume_runs_share_one_config_but_the_folder(resume, tmp_path):
    """The three runs of a setting differ in their folder only (and the resumed one in train.resume), so the
    comparison is of the same training; train.deterministic is the setting's."""
    a = resume.overrides("cuda", True, tmp_path / "a")
    b = resume.overrides("cuda", True, tmp_path / "b", "train.resume=auto")
    strip = lambda ovs: [o for o in ovs if not o.startswith(("train.output_dir", "results_dir"))]  # noqa: E731
    assert strip(b) == [*strip(a), "train.resume=auto"]
    assert "train.deterministic=true" in a and "train.deterministic=false" in resume.overrides(
        "cuda", False, tmp_path
    )
    assert {"quant=nf4", "optimizer=paged_adamw_8bit", "adapter.dropout=0.1", "hardware=rtx4080_16gb"} <= set(
        a
    )
    from vramsweep.config import compose

    compose(a, rules="config")


@pytest.mark.slow
def test_resume_check_on_cpu_is_bitwise_and_fails_without_the_rng_restore(
    resume, tmp_path, monkeypatch, embedded_model_dir
):
    """One setting in-process on CPU: bitwise (the CPU promise); with the checkpoint's RNG states not restored
    (LoRA dropout 0.1 draws from them) the resumed adapter differs and the judge says FAIL."""
    rep = resume.child("cpu", False, tmp_path / "good")
    assert rep["as_planned"] and resume.judge(rep)[0], rep
    assert rep["resumed_next_step"] == resume.STOP_AT and rep["resume"]["bitwise"]
    import vramsweep.production.checkpoint as ck

    monkeypatch.setattr(ck.Resume, "restore_rng", lambda self: None)
    bad = resume.child("cpu", False, tmp_path / "bad")
    ok, why = resume.judge(bad)
    assert ok is False and not bad["resume"]["bitwise"] and bad["resume"]["max_abs"] > 0, why


# ---------------------------------------------------------------------------------------------- nf4 use
def test_merge_check_needs_a_finite_measurement_and_the_argmax_kept(use):
    good = {
        "measured": True,
        "max_abs_logit_diff": 2.4,
        "mean_abs_logit_diff": 0.17,
        "argmax_agreement": 0.963,
    }
    assert use.merge_ok(good)
    assert not use.merge_ok(None) and not use.merge_ok({"measured": False, "reason": "moved"})
    assert not use.merge_ok({**good, "max_abs_logit_diff": float("nan")})
    assert not use.merge_ok({**good, "argmax_agreement": 0.5})


@pytest.mark.slow
def test_use_check_on_cpu_passes_and_fails_when_the_model_is_elsewhere(use, tmp_path, monkeypatch, capsys):
    assert use.main(["--device", "cpu", "--work", str(tmp_path / "w")]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["pass"] for r in rows] == [True] * 4
    assert rows[1]["device"] == "cpu" and rows[1]["linear4bit"] > 0
    assert rows[3]["merged_vs_trained"]["measured"] and "same argmax at" in rows[3]["line"]
    monkeypatch.setattr(use, "placement", lambda run: {"device": "meta", "linear4bit": 56})
    assert use.main(["--device", "cpu", "--work", str(tmp_path / "w2")]) == 1


# --------------------------------------------------------------------------------------- packing throughput
def test_throughput_batches_hold_the_same_real_tokens_packed_and_padded():
    check = load_script("gpu_batch_check")
    for device in ("cpu", "cuda"):
        packed, padded = check.throughput_batches(device)
        n, _, width, batch = check.THROUGHPUT[device][:4]
        assert sum(b["n_tokens"] for b in packed) == sum(b["n_tokens"] for b in padded)
        assert all(b["packed"] and b["input_ids"].shape == (1, width) for b in packed)
        assert len(padded) == -(-n // batch) and not any(b["packed"] for b in padded)
        widths = [b["input_ids"].shape[1] for b in padded]
        assert widths == sorted(widths, reverse=True)  # length-grouped: the longest together
        assert len(packed) < n  # rows hold several examples


@pytest.mark.slow
def test_packing_throughput_on_cpu_records_both_modes(embedded_model_dir):
    import torch

    check = load_script("gpu_batch_check")
    base = ["hardware=cpu", "model=tiny", "quant=none", "train.dtype=bf16", "attention=sdpa"]
    r = check.packing_throughput(base, torch.device("cpu"))
    assert set(r["tokens_per_s"]) == {"packed", "padded"} and all(v > 0 for v in r["tokens_per_s"].values())
    assert 0 < r["padding_share"] < 1 and "kernels_packed" not in r  # kernel names: CUDA only


# ------------------------------------------------------------------------------------------ summary lines
RESUME_ROWS = [
    {
        "check": "resume deterministic=False",
        "why": "spread max |d| 1e-06, resumed vs uninterrupted max |d| 2e-06",
    },
    {
        "check": "resume deterministic=True",
        "why": "spread max |d| 0, resumed vs uninterrupted max |d| 0 (bitwise)",
    },
    {"check": "cost of train.deterministic", "pairs": {"whole_a": 1.5, "whole_b": 1.25}, "mean": 1.375},
]
USE_ROWS = [
    {"check": "nf4 production run", "pass": True},
    {"check": "generate's model placement", "device": "cuda:0", "linear4bit": 56},
    {"check": "vramsweep generate (prompt on the model's device)", "exit": 0},
    {"check": "vramsweep export --merge: merged vs trained", "exit": 0,
     "merged_vs_trained": {"measured": True, "max_abs_logit_diff": 2.419, "mean_abs_logit_diff": 0.1695,
                           "argmax_agreement": 0.963}},
]  # fmt: skip
PACKING_ROW = {
    "check": "packing tokens/s against padding",
    "real_tokens": 15000,
    "dtype": "bf16",
    "padding_share": 0.31,
    "tokens_per_s": {"packed": 52000.0, "padded": 40000.0},
    "packed_over_padded": 1.3,
    "kernels_packed": {"pytorch_flash::flash_fwd_kernel": 96, "flash_bwd": 96, "softmax": 1},
    "kernels_padded": {},
}


def test_summary_lines_carry_the_figures(smoke):
    text = smoke.summarise_resume(RESUME_ROWS)
    assert "resume deterministic=True: spread max |d| 0" in text
    assert "step time deterministic / not 1.38 (pairs 1.50, 1.25)" in text
    text = smoke.summarise_use(USE_ROWS)
    assert text == ("model on cuda:0 (56 4-bit layers); generate exit 0; merged vs trained max |dlogit| 2.419, "
                    "mean 0.1695, same argmax 96.3 %")  # fmt: skip
    text = smoke.summarise_packing([PACKING_ROW])
    assert (
        "15,000 real tokens (bf16): packed 52,000 tokens/s, length-grouped padded 40,000 (31 % padding), packed/padded 1.30"
        in text
    )
    assert "packed attention kernels: pytorch_flash::flash_fwd_kernel x96" in text
    assert "padded attention kernels: none matched" in text
    assert smoke.summarise_packing([]) == ""


def test_phase_check_puts_the_figures_in_the_phase_line(smoke, tmp_path, monkeypatch):
    class Args:
        dry_run, budget_s, overrides = True, 540.0, []

    phases = {p.name: p for p in smoke.plan(only=smoke.ALL_PHASES)}
    sm = smoke.Smoke(Args(), phases, sys.executable, tmp_path / "smoke.log")
    out = "\n".join(json.dumps(r) for r in RESUME_ROWS) + "\nverdict: PASS (resume ...)\n"
    seen = []
    monkeypatch.setattr(sm, "run", lambda phase, cmd, cap: seen.append(cmd) or (0, False, out))
    smoke.phase_check(sm, "resume", "gpu_resume_check.py", ["--work", "w"])
    assert seen[0][1].endswith("gpu_resume_check.py") and seen[0][2:] == ["--device", "cpu", "--work", "w"]
    r = sm.results[-1]
    assert r["status"] == "PASS" and r["detail"].startswith(
        "verdict: PASS (resume ...); resume deterministic"
    )
    monkeypatch.setattr(sm, "run", lambda phase, cmd, cap: (1, False, "verdict: FAIL (x)\n"))
    smoke.phase_check(sm, "nf4_use", "gpu_use_check.py", [])
    assert sm.results[-1] == {"phase": "nf4_use", "status": "FAIL", "detail": "verdict: FAIL (x)"}


def test_a_check_whose_exit_was_cut_after_its_verdict_keeps_it(smoke):
    """2026-12-06, CPU at load 13: gpu_use_check.py printed ``verdict: PASS`` at 36.5 s and its interpreter was
    still exiting when the 40 s run time of its cap ran out: the phase read FAIL. The verdict stands; a FAIL
    verdict stays a failure and no verdict is "not run"."""
    status, detail = smoke._verdict_of("verdict: PASS (4 checks)\n", -2, True)
    assert status == "PASS" and detail.endswith("(its exit cut at the cap)")
    assert smoke._verdict_of("verdict: FAIL (x)\n", -2, True)[0] == "FAIL"
    assert smoke._verdict_of("partial\n", -2, True)[0] == "not run"


def test_the_dry_runs_budget_grows_with_the_cpuload_script(smoke, monkeypatch, capsys):
    """At load 13-19 on 2 cores the dry run's scaled caps cut checks that pass at a lower load; its budget
    (not the GPU's) is multiplied by the load over 2 per core, at least 1."""
    monkeypatch.setattr(smoke.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(smoke.os, "getloadavg", lambda: (2.0, 0.0, 0.0))
    assert smoke.dry_load_factor() == 1.0
    monkeypatch.setattr(smoke.os, "getloadavg", lambda: (16.0, 0.0, 0.0))
    assert smoke.dry_load_factor() == 4.0 and "the budget x 4.00" in capsys.readouterr().out
    rc = smoke.main(["--plan", "--dry-run"])
    assert rc == 0 and f"budget {4 * smoke.DRY_BUDGET_S:.0f} s" in capsys.readouterr().out
    rc = smoke.main(["--plan"])  # the GPU's budget never scales
    assert rc == 0 and "budget 540 s" in capsys.readouterr().out
