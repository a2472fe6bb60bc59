"""GPU smoke test driver (called by ``scripts/gpu_smoke.sh``; run that, not this).

Runs ``sweeps/gpu_smoke.yaml`` through the real CLI (``vramsweep train -m sweep=gpu_smoke``) in a child
process with a wall-clock budget, reports it (``vramsweep report``), and bundles the results into one
folder of at most :data:`MAX_FILES` files with a dated markdown summary table for README.

The environment is probed in a separate short-lived process so this driver never holds a CUDA context
while the trials run (on a real 16 GB card that context would be memory the trials cannot use).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = ROOT / "sweeps"  # the shipped sweep files
SWEEP = "gpu_smoke"
MAX_FILES = 9
BUNDLE = (
    "summary.md",
    "summary.csv",
    "ablation.md",
    "pareto.png",
    "memory_breakdown.png",
    "trials.jsonl",
    "sweep.json",
    "smoke.log",
    "profile.md",
)
#: The long-context probe: a second sweep of one point no GPU has run: the long-context stack (offloaded
#: checkpoints, tiled MLP + chunked loss, Liger, 16-bit adapters) at 16,384 tokens, where nf4_dq + liger +
#: checkpointing=on went OOM on 2026-12-01 (its 12,288 fit: proven, left out).
LONG_SWEEP = "gpu_smoke_long"
LONG_BASELINE = [
    "quant=nf4_dq",
    "attention=sdpa",
    "kernels=liger",
    "checkpointing=offload",
    "tiling=mlp",
    "adapter.dtype=compute",
    "context.max_tokens=16384",
]
LONG_FACTORS: list[list[str]] = []
#: The step-time pass (bench/step_time.py): the smoke baseline at these lengths, host vs device per step.
STEP_TIME_TOKENS = (1024, 4096)
#: Extra overrides of the step-time pass: the sweep file's short trials (GPU) / the dry run's tiny data.
STEP_TIME_GPU = ["train.micro_batch=1", "train.warmup_steps=1", "train.measure_warmup_steps=2"]
STEP_TIME_DRY = [
    "train.warmup_steps=0",
    "train.measure_warmup_steps=1",
    "data.num_docs=4",
    "data.num_eval_docs=1",
]
#: The profiler pass (scripts/gpu_profile.py) runs only in the time the plan's phases leave unused.
PROFILE_TOKENS = (1024, 4096)

# ------------------------------------------------------------------------------------------ time plan
#: The smoke's wall-clock budget on a GPU: one device call (<= 600 s) inside a 15-minute loan, 540 s of work
#: plus its start (issue 37.9), leaving the rest of the loan for a rerun of a single step. Hard: it counts from
#: the shell's start (``VRAMSWEEP_SMOKE_T0``: bundle extraction included) to the last file written.
DEFAULT_BUDGET_S = 540.0
#: The plan's margin over a probe point's measured steps (a longer step was never measured).
TRIAL_MARGIN = 1.5
#: CLI start, study creation and the first trial's interpreter (2026-12-01: 22.9 s from the sweep's stamp
#: to trial 0's start, 6-7 s of it that trial's spawn).
SWEEP_STARTUP_S = 25.0
#: A cold interpreter's start before a trial can build anything (2026-12-01: 6-7 s of each spawn trial).
SPAWN_S = 7.0
#: Extracting + activating the 47.1 MiB bundle, in the shell before this driver (inside the budget): 22.9 s
#: measured on 2 shared CPU cores at load 9 (2026-12-02, python tarfile, 254 MiB out), x 1.3.
EXTRACT_S = 30.0
#: A probe point in a fresh interpreter, measured 2026-12-04 (H200, Qwen3-8B nf4_dq + liger + offload + tiled
#: MLP, compute adapters): 76 s for one step at 32,768 tokens (the first 8B build of the run) and 61.3 s for
#: two steps (5,038 tokens/s, 6.5 s a step): a 70 s slot (interpreter, imports, build, eval; 76 - 6.5, the
#: first build's) + its steps.
PROBE_SLOT_S = 70.0
#: ... and that trial's rate, the anchor of :func:`step_s`.
PROBE_TOKENS_PER_S, PROBE_RATE_TOKENS = 5038.0, 32768
#: Signal grace of a phase stopped at its cap, taken out of the cap (SIGINT: the sweeper closes its trials
#: and writes their results; SIGTERM; SIGKILL), so a cut phase ends by its cap.
GRACE_S = (20.0, 5.0, 2.0)


class Phase(NamedTuple):
    """One step of the smoke and the most wall-clock seconds it may take."""

    name: str
    cap_s: float
    what: str


def design_points(sweep_file: Path) -> list[tuple[str, list[str]]]:
    """``(change, overrides)`` per design point of an ablation sweep file, in run order (baseline first)."""
    import yaml

    sweep = (yaml.safe_load(sweep_file.read_text()) or {}).get("sweep") or {}
    points = [("(baseline)", [str(o) for o in sweep.get("baseline") or []])]
    points += [(" ".join(map(str, f)), [str(o) for o in f]) for f in sweep.get("factors") or []]
    return points


def unproven_first(points: list[tuple[str, list[str]]]) -> bool:
    """True when every factor touching an unproven knob (Unsloth, offload, tiling) runs before the others."""
    flags = [any(k in change for k in UNPROVEN) for change, _ in points[1:]]
    return flags == sorted(flags, reverse=True)


#: Knobs no GPU has run yet (2026-12-01 showed the rest): the smoke runs them first.
UNPROVEN = ("kernels=unsloth", "checkpointing=offload", "tiling=")


#: The memory probe (issue 37.9): Qwen3-8B under the 15 GiB cap (hardware=rtx4080_16gb) with the long-context
#: stack, one training step per length, in the order given, a length past an OOM or below a fit skipped
#: (:func:`probe_order_skip`). 2026-12-04 measured 49,152 fitting and 65,536 OOM with compute adapters: the
#: next loan bisects between them (57,344, then 61,440 if it fits or 53,248 if not: two points). fp32
#: adapters: 45,056 (the estimate said 41,134), then 49,152 or 40,960 (opt-in: --only ...,memprobe_fp32).
PROBE_COMPUTE_TOKENS = (57344, 61440, 53248)
PROBE_FP32_TOKENS = (45056, 49152, 40960)
#: Issue 53: the seed's stack with attention in 4 head groups (tiling.attention_heads=4) and paged 8-bit
#: AdamW, compute adapters with fp32 masters, ascending, stopping at the first OOM; the estimate beside each
#: point (predicted max 79,382 with paged 8-bit + groups; the vocabulary slice needs a corpus, and the
#: probe's random-init architecture has none: not in the probe). Opt-in: --only memprobe_grouped.
PROBE_GROUPED_TOKENS = (57344, 65536, 73728)
PROBE_GROUPED = ["optimizer=paged_adamw_8bit", "tiling.attention_heads=4"]
#: The dry run's tiny model has 2 kv heads: 2 groups.
DRY_PROBE_GROUPED = ["optimizer=paged_adamw_8bit", "tiling.attention_heads=2"]
PROBE_BASE = [o for o in LONG_BASELINE if not o.startswith(("adapter.dtype", "context.max_tokens"))]
#: Qwen3-8B's own positions (config.json: max_position_embeddings); a longer probe adds Qwen's documented
#: YaRN (factor 4 over original_max_position_embeddings=32,768). Without it every probe past 40,960 tokens was
#: refused as unsupported (2026-12-04, H200: 49,152 / 65,536 / 81,920 / 45,056 / 53,248 never ran).
QWEN3_8B_POSITIONS = 40960
PROBE_ROPE = ["rope=yarn", "rope.factor=4", "rope.original_max_position_embeddings=32768"]
#: One step per probe point (the peak is the training step's); the real trial: a warm-up step + a measured one.
PROBE_STEPS, TRIAL_STEPS = 1, 2
#: Causal attention's FLOPs equal the linear layers' at this length (Qwen3-8B: 79 % of the non-causal count
#: at 65,536 is attention, half of it causal: 65,536 / (0.79 / 0.21 / 2) = 34,860 tokens).
ATTN_EQ_TOKENS = 65536 / (0.79 / 0.21 / 2)
#: The environment probe + the 64 MiB pinned round trip: 10 s measured for import torch + the metadata reads
#: on 2 shared cores (2026-12-02), x 2 for CUDA init and NVML (unmeasured; the copy is < 0.1 s at 10 GB/s).
ENV_S = 20.0
#: The fork-server check: the sweep's measured start-up less its first trial's spawn (25 - 7 s: CLI start,
#: study, fork-server warm-up with the default preload) + 2 no-op trials forked in < 1 s each.
FORK_S = SWEEP_STARTUP_S - SPAWN_S + 2.0
#: scripts/gpu_longctx_check.py: tiny NF4 model, 5 modes x 1 step. On the H200 image (2026-12-04) the first
#: process importing transformers' model classes cold (generation -> sklearn -> joblib) was still composing
#: when a 39 s cap cut it at 27 s; on the warm machine it ended in 21.7 s: 100 s (cold, unmeasured whole).
EXACT_S = 100.0
#: scripts/gpu_batch_check.py: 20.0 s wall measured on 2 loaded CPU cores (2026-12-03, compute included);
#: on the H200 image (2026-12-04, cold) its verdict came at 23.8 s: that x 1.3, + the signal grace a cap keeps.
BATCH_S = 45.0
#: bench/step_time.py: 2 cold interpreters that each build the model and step (a spawn trial's 18.5 s slot,
#: its 7 s start included) x the margin, + bench's own interpreter start.
#: 2026-12-04 (H200): the 1,024-token child (cold interpreter, Qwen3-8B build, 6 steps of 0.87 s) had ended
#: when a 62 s cap cut the 4,096 one at 44 s: two children x 44 s + bench's own start.
STEP_TIME_CHILD_S = 44.0
STEP_TIME_S = 2 * STEP_TIME_CHILD_S + SPAWN_S
#: The summary and the result files (no subprocess): seconds.
REPORT_S = 5.0
#: The allocator's history with Python stacks (~2 us an event, torch's docs) and the trace's replay: a probe
#: point's cap x this (unmeasured).
SNAPSHOT_MARGIN = 1.25
#: Phases run only when named in --only: with 2026-12-04's measured costs the issue's whole list is ~850 s, so
#: the default plan (one call, <= 540 s) is the verification and the compute-adapter boundary, and a second
#: and a third call (:data:`CALLS`) take these.
OPT_IN = ("memprobe_fp32", "memprobe_grouped", "packing_bf16", "resume", "nf4_use", "snapshot", "step_time")
#: gpu_batch_check.py's verdict on a cold H200 (2026-12-04): one interpreter that imports the stack, builds
#: the embedded tiny model a few times and steps it; the unit of the two checks below (no GPU ran them yet).
TINY_PROCESS_S = 23.8
#: A cap's run time is 70 % of it below 90 s (the signal grace: :func:`grace_plan`): cap = work x 1.3 / 0.7.
SHORT_CAP_FACTOR = 1.3 / 0.7
#: scripts/gpu_resume_check.py: two interpreters (train.deterministic false, true), each with 4 tiny NF4
#: runs of 6 steps; each counted as one such process (not yet measured on a GPU).
RESUME_S = round(2 * TINY_PROCESS_S * SHORT_CAP_FACTOR)
#: gpu_batch_check.py --dtype bf16: batching's process + the throughput pass (2 more tiny builds, 2 warm-up, 6
#: timed and 2 profiled steps of ~12 micro-batches: 5 s, an estimate, not measured on a GPU).
PACKING_BF16_S = round((TINY_PROCESS_S + 5.0) * SHORT_CAP_FACTOR)
#: scripts/gpu_use_check.py: one interpreter: a tiny NF4 run, generate, export --merge (batching's cap).
NF4_USE_S = BATCH_S
#: The loan's calls (issue 37.9, 53): each a plan of at most DEFAULT_BUDGET_S (``--plan`` and ``--dry-run``
#: print their cap sums): the default one, then ``--only`` these.
CALLS = (
    None,
    ("memprobe_fp32", "snapshot", "step_time"),
    ("packing_bf16", "resume", "nf4_use", "memprobe_grouped"),
)


def step_s(tokens: int) -> float:
    """Seconds of one Qwen3-8B training step of ``tokens`` from the 2026-12-04 rate at 32,768 tokens
    (:data:`PROBE_TOKENS_PER_S`), the per-token cost growing with causal attention (:data:`ATTN_EQ_TOKENS`)."""
    growth = (1 + tokens / ATTN_EQ_TOKENS) / (1 + PROBE_RATE_TOKENS / ATTN_EQ_TOKENS)
    return tokens / PROBE_TOKENS_PER_S * growth


def trial_cost_s(tokens: int, steps: int) -> float:
    """One fresh-interpreter trial: the measured 18.5 s slot (spawn, build, eval) + its steps x the margin."""
    return PROBE_SLOT_S + TRIAL_MARGIN * steps * step_s(tokens)


def probe_cap_s(tokens: tuple[int, ...], steps: int = 1) -> float:
    """The most a probe order can cost: over every ok/OOM outcome of the points that run (the skip rule of
    :func:`probe_order_skip`), the costliest sequence (ascending lengths: all of them; a bisecting order: two)."""
    worst = 0.0
    for outcome in range(2 ** len(tokens)):
        done: list[dict[str, Any]] = []
        cost = 0.0
        for i, n in enumerate(tokens):
            if probe_order_skip(n, done) is None:
                cost += trial_cost_s(n, steps)
                done.append({"tokens": n, "status": "oom" if outcome >> i & 1 else "ok"})
        worst = max(worst, cost)
    return worst


def _lengths(tokens: tuple[int, ...]) -> str:
    return ", ".join(f"{n:,} ({trial_cost_s(n, PROBE_STEPS):.0f} s)" for n in tokens)


def plan(
    *,
    scale: float = 1.0,
    only: tuple[str, ...] | None = None,
    compute_tokens: tuple[int, ...] = PROBE_COMPUTE_TOKENS,
    fp32_tokens: tuple[int, ...] = PROBE_FP32_TOKENS,
    grouped_tokens: tuple[int, ...] = PROBE_GROUPED_TOKENS,
) -> list[Phase]:
    """The smoke's phases, in run order, and their caps (``scale`` = budget / :data:`DEFAULT_BUDGET_S`). Each
    phase is stopped at its cap; a point it did not reach is "not run"; a failed phase never stops the next."""
    compute, fp32 = probe_cap_s(compute_tokens), probe_cap_s(fp32_tokens)
    slot = (f"{PROBE_SLOT_S:.0f} s slot + {TRIAL_MARGIN} x steps at {PROBE_TOKENS_PER_S:,.0f} tok/s "
            f"({PROBE_RATE_TOKENS:,} tokens), attention-scaled")  # fmt: skip
    phases = [
        Phase("bundle", EXTRACT_S, "extract + activate the bundle, in the shell (22.9 s measured; 0 when extracted)"),
        Phase("env", ENV_S, "versions (importlib.metadata), device, driver, a 64 MiB pinned round trip (10 s measured x 2)"),
        Phase("fork", FORK_S, "fork server, default preload: a trial forked on this host, no fallback to spawn "
              f"({SWEEP_STARTUP_S:.0f} s start-up - {SPAWN_S:.0f} s spawn + 2 x 1 s)"),
        Phase("exact", EXACT_S, "scripts/gpu_longctx_check.py: tiling / offload / RNG replay gradients, pinned exact pool "
              "(21.7 s on a warm H200, > 27 s cold)"),
        Phase("batching", BATCH_S, "scripts/gpu_batch_check.py: token-weighted accumulation + packing == one batch "
              "(23.8 s to its verdict on a cold H200)"),
        Phase("packing_bf16", PACKING_BF16_S, "scripts/gpu_batch_check.py --dtype bf16: packed == unpacked and 2 "
              "head groups == one call in bf16 (tolerance 2e-2); tokens/s packed vs length-grouped padded batches "
              f"(equal real tokens, paired) and each one's attention kernels ({TINY_PROCESS_S} s + 5 s est. x 1.3, + grace)"),
        Phase("resume", RESUME_S, "scripts/gpu_resume_check.py: a production run (tiny NF4, paged 8-bit AdamW) "
              "stopped after 3 of 6 steps and resumed, with and without train.deterministic: adapters bitwise where "
              f"promised, the run-to-run spread, the step-time ratio (2 interpreters x {TINY_PROCESS_S} s x 1.3, + grace)"),
        Phase("nf4_use", NF4_USE_S, "scripts/gpu_use_check.py: generate / export --merge of a tiny NF4 run: the model "
              "on cuda:0, the prompt put there, merged vs trained logits as export reports them (batching's cap)"),
        Phase("memprobe", compute, f"Qwen3-8B, 15 GiB cap, compute adapters at {_lengths(compute_tokens)} in that order, "
              f"none past an OOM or below a fit; {slot}"),
        Phase("memprobe_fp32", fp32, f"the same, fp32 adapters at {_lengths(fp32_tokens)}"),
        Phase("memprobe_grouped", probe_cap_s(grouped_tokens), "memprobe's stack + paged 8-bit AdamW + attention in 4 head "
              f"groups, compute adapters at {_lengths(grouped_tokens)}, ascending, stopping at the first OOM"),
        Phase("trial", trial_cost_s(max(compute_tokens), TRIAL_STEPS), f"a real trial ({TRIAL_STEPS} steps) at the "
              f"longest length that fitted (sized at {max(compute_tokens):,}; also takes the plan's slack)"),
        Phase("snapshot", SNAPSHOT_MARGIN * trial_cost_s(max(compute_tokens), PROBE_STEPS),
              f"scripts/gpu_memsnapshot.py: the allocator's trace of one step at the longest fit, its peak by owner "
              f"(a probe point x {SNAPSHOT_MARGIN} for the recording)"),
        Phase("step_time", STEP_TIME_S, f"bench/step_time.py: 1,024 vs 4,096 tokens, 2 cold interpreters x "
              f"{STEP_TIME_CHILD_S:.0f} s (measured) + {SPAWN_S:.0f} s start"),
        Phase("report", REPORT_S, "summary.md / summary.csv / trials.jsonl / phases.json / smoke.log (no subprocess)"),
    ]  # fmt: skip
    picked = only if only is not None else tuple(p.name for p in phases if p.name not in OPT_IN)
    return [Phase(p.name, p.cap_s * scale, p.what) for p in phases if p.name in picked or p.name == "bundle"]


def render_plan(phases: list[Phase], budget_s: float) -> str:
    """The plan as printed before anything runs: each phase's cap, what runs in it and why it fits, their sum."""
    lines = [
        f"gpu_smoke: plan (budget {budget_s:.0f} s; each phase cut at its cap: what it did not reach is not run)"
    ]
    t = 0.0
    for p in phases:
        lines.append(f"  {t:5.0f} s +{p.cap_s:5.0f} s  {p.name:<13} {p.what}")
        t += p.cap_s
    ok = t <= budget_s + 1e-6
    lines.append(f"  total {t:.0f} s {'<=' if ok else '>'} {budget_s:.0f} s" + ("" if ok else "!"))
    return "\n".join(lines)


def render_calls(**tokens: tuple[int, ...]) -> str:
    """The loan's calls (:data:`CALLS`) at the GPU's caps: each one's cap sum against the 540 s budget."""
    lines = [f"gpu_smoke: the loan's calls on a GPU (caps unscaled; each <= {DEFAULT_BUDGET_S:.0f} s):"]
    for only in CALLS:
        names = (*only, "env", "report") if only else None
        total = sum(p.cap_s for p in plan(only=names, **tokens))
        cmd = "bash scripts/gpu_smoke.sh" + (f" --only {','.join(only)}" if only else "")
        ok = total <= DEFAULT_BUDGET_S + 1e-6
        lines.append(
            f"  {cmd}: {total:.0f} s {'<=' if ok else '>'} {DEFAULT_BUDGET_S:.0f} s" + ("" if ok else "!")
        )
    return "\n".join(lines)


#: Harmless noise filtered out of what the user sees (the trial logs keep it): Liger 0.8.5 with Triton 3.6
#: probes its Ascend (NPU) backend on import and reports the failed import of triton's ``tanh``.
HARMLESS = (
    re.compile(r"Backend impl 'liger_kernel\.ops\.backends\._ascend\.rope'.*cannot import name 'tanh'"),
)
#: Statuses that are results (the smoke test passes with them); ``error`` is a failure.
RESULT_STATUSES = ("ok", "oom", "unsupported", "infeasible_estimate", "pruned", "diverged")
#: A design point the smoke's time plan did not reach (or could not prepare): not a failure of what ran.
NOT_RUN = "not run"
#: The dry run: same sweep file, CPU, embedded tiny model, tiny steps.
DRY_OVERRIDES = [
    "model=tiny",
    "hardware=cpu",
    "train.steps=3",
    "train.warmup_steps=0",
    "train.measure_warmup_steps=1",
    "train.eval_batches=1",
    "data.num_docs=4",
    "data.num_eval_docs=1",
    "hydra.sweeper.timeout_s=900",  # 2 CPU cores shared with other jobs: a 512-token CPU trial took > 150 s
]
#: The dry run's weights-folder step: a small Qwen3 architecture (the GPU run writes Qwen3-8B's 16.4 GB).
DRY_ARCH = ["model=qwen3_tiny_arch"]
#: The dry run divides every ``context.max_tokens`` of the design by this (floor 128): same knobs, CPU-sized.
DRY_CONTEXT_DIVISOR = 8
GIB = 1024**3
#: Module -> distribution whose version the environment probe reads (importlib.metadata: nothing imported).
ENV_MODULES = {
    "transformers": "transformers",
    "peft": "peft",
    "bitsandbytes": "bitsandbytes",
    "liger_kernel": "liger-kernel",
    "flash_attn": "flash-attn",
    "pynvml": "nvidia-ml-py",
    "triton": "triton",
    "optuna": "optuna",
    "hydra": "hydra-core",
    "unsloth": "unsloth",
    "torchao": "torchao",
    "matplotlib": "matplotlib",
}


# ------------------------------------------------------------------------------------------ environment
def plots_note(env: dict[str, Any]) -> str | None:
    """Why the smoke has no plots, when matplotlib is missing (neither the GPU image nor the bundle has it:
    the report writes its tables and skips pareto.png / memory_breakdown.png)."""
    if (env.get("versions") or {}).get("matplotlib"):
        return None
    return "plots: skipped (matplotlib is in neither the image nor the bundle); the tables are complete"


def installed_version(module: str, dist: str) -> str | None:
    """``dist``'s version from its metadata when ``module`` is importable here, without importing it (a cold
    ``import unsloth`` from a fresh bundle takes longer than the probe's cap); None when it is absent."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def probe_environment() -> dict[str, Any]:
    """Versions, device and allocator settings (run in a throwaway process: it may initialise CUDA). Only
    torch is imported; the other versions are read from their metadata (:func:`installed_version`)."""
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        "versions": {},
    }
    for mod, dist in ENV_MODULES.items():
        env["versions"][mod] = installed_version(mod, dist)
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            device_total_bytes=int(props.total_memory),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            device_count=torch.cuda.device_count(),
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
            pynvml.nvmlShutdown()
        except Exception:
            env["driver"] = None
        try:
            env["pinned_round_trip"] = pinned_round_trip(torch)
        except Exception as exc:  # a failed registration or copy is this phase's result, not a crash
            env["pinned_round_trip"] = {
                "equal": False,
                "note": f"64 MiB pinned round trip failed: {exc}"[:300],
            }
    else:
        env["pinned_round_trip"] = {"note": "64 MiB pinned round trip: not run (no CUDA device)"}
        env["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    return env


#: The pinned round trip's size (issue 37.9): 64 MiB.
ROUND_TRIP_BYTES = 64 * 1024**2


def pinned_round_trip(torch: Any, nbytes: int = ROUND_TRIP_BYTES, device: str = "cuda") -> dict[str, Any]:
    """``nbytes`` of random bytes from page-locked host memory to ``device`` and back into another pinned
    buffer (non-blocking copies, timed by events): both buffers pinned, the bytes equal, GB/s each way."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    back = torch.empty_like(src).pin_memory()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    events[0].record()
    dev = src.to(device, non_blocking=True)
    events[1].record()
    back.copy_(dev, non_blocking=True)
    events[2].record()
    torch.cuda.synchronize()
    h2d_s = events[0].elapsed_time(events[1]) / 1e3
    d2h_s = events[1].elapsed_time(events[2]) / 1e3
    return {
        "bytes": nbytes,
        "pinned": bool(src.is_pinned() and back.is_pinned()),
        "equal": bool(torch.equal(src, back)) and bool(src.is_pinned() and back.is_pinned()),
        "h2d_gb_s": nbytes / max(h2d_s, 1e-9) / 1e9,
        "d2h_gb_s": nbytes / max(d2h_s, 1e-9) / 1e9,
    }


def environment(python: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """:func:`probe_environment` in a child process (JSON on stdout), stopped after ``timeout_s``."""
    try:
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--probe-env"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the environment probe took more than its {timeout_s:.0f} s cap"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr or proc.stdout)[-2000:]}


# ------------------------------------------------------------------------------------------------ sweep
def _scale_override(ov: str, divisor: int) -> str:
    key, sep, value = ov.partition("=")
    if key.strip() == "context.max_tokens" and sep and value.strip().isdigit():
        return f"{key}={max(128, int(value) // divisor)}"
    return ov


def _quote(items: list[str]) -> str:
    return "[" + ",".join("'" + i.replace("\\", "\\\\").replace("'", "\\'") + "'" for i in items) + "]"


def dry_design_overrides(sweep_file: Path, divisor: int = DRY_CONTEXT_DIVISOR) -> list[str]:
    """``sweep.baseline=[...]`` / ``sweep.factors=[[...],...]`` overrides: the sweep file's own design with
    its context lengths divided by ``divisor`` (the embedded tiny model trains ~30-400 tokens/s on 2 CPU
    cores, an 8B on a GPU thousands)."""
    import yaml

    sweep = (yaml.safe_load(sweep_file.read_text()) or {}).get("sweep") or {}
    baseline = [_scale_override(str(o), divisor) for o in sweep.get("baseline") or []]
    factors = [[_scale_override(str(o), divisor) for o in f] for f in sweep.get("factors") or []]
    return [
        f"sweep.baseline={_quote(baseline)}",
        "sweep.factors=[" + ",".join(_quote(f) for f in factors) + "]",
    ]


def is_harmless(line: str) -> bool:
    """True for a known-harmless line (:data:`HARMLESS`) that the user output leaves out."""
    return any(p.search(line) for p in HARMLESS)


class NoiseFilter:
    """Drops :data:`HARMLESS` lines (and the ``warnings.warn(...)`` source echo that follows a warning)."""

    def __init__(self) -> None:
        self.dropped = 0
        self._after = False

    def keep(self, line: str) -> bool:
        if is_harmless(line):
            self.dropped += 1
            self._after = True
            return False
        if self._after and line.startswith((" ", "\t")) and "warn" in line:
            self._after = False
            return False
        self._after = False
        return True


def grace_plan(budget_s: float) -> tuple[float, tuple[float, float, float]]:
    """``(run_s, (sigint, sigterm, sigkill) grace)`` of a phase capped at ``budget_s``: the grace of
    :data:`GRACE_S`, shrunk for a short cap (at most 30 % of it), is taken out of the cap, so a phase that is
    stopped still ends by ``budget_s``."""
    total = sum(GRACE_S)
    factor = min(1.0, 0.3 * max(budget_s, 0.0) / total)
    grace = tuple(g * factor for g in GRACE_S)
    return max(budget_s - sum(grace), 0.0), grace  # type: ignore[return-value]


def run_logged(cmd: list[str], budget_s: float, log: Path, *, tee: bool = False) -> tuple[int, bool, str]:
    """Run ``cmd`` in its own process group, output filtered (:class:`NoiseFilter`) into ``log`` (and the
    console with ``tee``); SIGINT/SIGTERM/SIGKILL it so that it has ended by ``budget_s`` (:func:`grace_plan`).

    Returns:
        ``(exit code, timed_out, filtered output)``.
    """
    import threading

    flt = NoiseFilter()
    kept: list[str] = []
    timed_out = False
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            text=True,
            errors="replace",
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if flt.keep(line):
                    kept.append(line)
                    fh.write(line)
                    fh.flush()
                    if tee:
                        sys.stdout.write(line)
                        sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        run_s, graces = grace_plan(budget_s)
        try:
            rc = proc.wait(timeout=max(run_s, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            fh.write(f"\ngpu_smoke: at {run_s:.0f} s of its {budget_s:.0f} s cap: interrupting\n")
            fh.flush()
            for sig, grace in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), graces, strict=True):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    rc = proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.wait()
        reader.join(1)
        if flt.dropped:
            fh.write(f"gpu_smoke: left out {flt.dropped} harmless line(s) (Liger's Ascend backend probe)\n")
    return int(rc), timed_out, "".join(kept)


def run_sweep(
    python: str, results_dir: Path, overrides: list[str], budget_s: float, log: Path
) -> tuple[int, bool]:
    """Run the sweep through the CLI; Ctrl-C it when over budget.

    Returns:
        ``(exit code, timed_out)``.
    """
    cmd = [
        python,
        "-m",
        "vramsweep.cli",
        "train",
        "-m",
        f"sweep={SWEEP}",
        f"results_dir={results_dir}",
        *overrides,
    ]
    rc, timed_out, _ = run_logged(cmd, budget_s, log)
    return rc, timed_out


def run_report(python: str, sweep_dir: Path, out: Path, log: Path, cap_s: float) -> tuple[int, bool]:
    """``vramsweep report`` within ``cap_s`` (the report phase's cap): ``(exit code, cut at the cap)``."""
    cmd = [python, "-m", "vramsweep.cli", "report", str(sweep_dir), "--out", str(out)]
    rc, timed_out, _ = run_logged(cmd, cap_s, log)
    return rc, timed_out


def load_trials(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every trial result JSON of the sweep, by trial number."""
    out = []
    for p in sorted((sweep_dir / "trials").glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: (r.get("trial") is None, r.get("trial") or 0))


# ---------------------------------------------------------------------------------------------- summary
def _change(result: dict[str, Any]) -> str:
    design = (result.get("meta") or {}).get("design") or {}
    if design.get("role") == "baseline":
        return "(baseline)"
    change = design.get("change")
    return " ".join(change) if change else " ".join(result.get("overrides") or [])


def _gib(v: Any) -> float | None:
    return None if v is None else float(v) / GIB


def summary_rows(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trial: what changed, status, memory figures (GiB), throughput, reason."""
    rows = []
    for r in trials:
        m = r.get("metrics") or {}
        reason = (r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
        rows.append(
            {
                "trial": r.get("trial"),
                "change": _change(r),
                "status": r.get("status"),
                "peak_gib": _gib(m.get("peak_memory_bytes")),
                "memory_kind": m.get("memory_kind"),
                "allocated_gib": _gib(m.get("cuda_max_allocated_bytes")),
                "fragmentation_gib": _gib(m.get("cuda_fragmentation_bytes")),
                "nvml_gib": _gib(m.get("nvml_process_peak_bytes")),
                "tokens_per_s": m.get("tokens_per_s"),
                "step_time_s": m.get("step_time_s"),
                "mfu": m.get("mfu"),
                "wall_s": (r.get("meta") or {}).get("wall_s"),
                "reason": reason,
            }
        )
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _short(text: str, n: int = 90) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= n else text[: n - 1] + "…"


def header_line(env: dict[str, Any], trials: list[dict[str, Any]], dry: bool, when: datetime) -> str:
    """The dated title line of the summary."""
    date = when.strftime("%Y-%m-%d")
    if dry:
        return f"### GPU smoke — DRY RUN on CPU ({date}, embedded tiny model; not GPU figures)"
    cap = None
    for r in trials:
        cap = ((r.get("meta") or {}).get("cuda") or {}).get("cap")
        if cap:
            break
    total = env.get("device_total_bytes")
    where = f"{env.get('device', '?')}" + (f", {total / GIB:.1f} GiB" if total else "")
    if cap and cap.get("applied"):
        where += f"; emulating {cap.get('profile')}: capped at {cap['cap_bytes'] / GIB:.2f} GiB"
    elif cap:
        where += f"; {cap.get('profile')}: no cap ({cap.get('reason')})"
    return f"### GPU smoke — {date} ({where})"


def render_summary(
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    trials: list[dict[str, Any]],
    *,
    dry: bool,
    command: str,
    when: datetime,
    sweep_rc: int,
    timed_out: bool,
) -> str:
    """The markdown summary: dated title, environment line, one table row per trial."""
    v = env.get("versions") or {}

    def ver(name: str) -> str:
        return v.get(name) or "not installed"

    conf = (env.get("alloc_conf") or {}).get("PYTORCH_CUDA_ALLOC_CONF")
    model = ((trials[0].get("config") or {}).get("model") or {}).get("name") if trials else None
    lines = [
        header_line(env, trials, dry, when),
        "",
        f"`{command}` · torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) · transformers {ver('transformers')} · "
        f"peft {ver('peft')} · bitsandbytes {ver('bitsandbytes')} · liger-kernel {ver('liger_kernel')} · "
        f"unsloth {ver('unsloth')} · flash-attn {ver('flash_attn')} · driver {env.get('driver') or '–'} · "
        f"PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'} · model {model or '?'} (random init, memory/speed only)"
        if not dry
        else f"`{command}` · torch {env.get('torch')} · transformers {ver('transformers')} · bitsandbytes "
        f"{ver('bitsandbytes')} · {env.get('device')} · model {model or '?'}",
        "",
        render_table(rows).rstrip("\n"),
    ]
    kinds = sorted({r["memory_kind"] for r in rows if r["memory_kind"]})
    lines += [
        "",
        f"Peak = {', '.join(kinds) or 'n/a'} (CUDA: max reserved in the training steps; CPU: tracked tensor bytes). "
        "Allocated/fragmentation/NVML are CUDA-only. Sweep exit code "
        f"{sweep_rc}{' (stopped at the time budget)' if timed_out else ''}; {len(rows)} trial(s).",
    ]
    return "\n".join(lines) + "\n"


def render_table(rows: list[dict[str, Any]], *, title: str | None = None) -> str:
    """One markdown table row per trial (memory in GiB, or MiB when every peak is under 1 GiB)."""
    peaks = [r["peak_gib"] for r in rows if r["peak_gib"] is not None]
    unit, scale = ("GiB", 1.0) if not peaks or max(peaks) >= 1.0 else ("MiB", 1024.0)  # tiny CPU runs: MiB
    lines = [f"{title}:", ""] if title else []
    lines += [
        f"| # | change from baseline | status | peak {unit} | allocated {unit} | frag. {unit} | NVML {unit} "
        "| tokens/s | s/step | MFU | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mem(v: float | None) -> str:
        return _fmt(None if v is None else v * scale, ".2f" if unit == "GiB" else ".1f")

    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['change']} | {r['status']} | {mem(r['peak_gib'])} | {mem(r['allocated_gib'])} | "
            f"{mem(r['fragmentation_gib'])} | {mem(r['nvml_gib'])} | {_fmt(r['tokens_per_s'], '.0f')} | "
            f"{_fmt(r['step_time_s'], '.2f')} | {_fmt(r['mfu'], '.3f')} | {_short(r['reason'])} |"
        )
    return "\n".join(lines) + "\n"


def summary_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    cols = list(rows[0]) if rows else ["trial", "change", "status"]
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def bundle(
    out: Path,
    *,
    summary_md: str,
    summary_csv_text: str,
    trials: list[dict[str, Any]],
    sweep_dir: Path,
    report_dir: Path,
    log: Path,
) -> list[Path]:
    """Write the at-most-:data:`MAX_FILES`-file folder. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    foreign = [p.name for p in out.iterdir() if p.name not in BUNDLE]
    if foreign:
        raise SystemExit(
            f"gpu_smoke: {out} holds other files ({', '.join(sorted(foreign)[:5])}): use an empty --out"
        )
    for name in BUNDLE:
        (out / name).unlink(missing_ok=True)
    (out / "summary.md").write_text(summary_md)
    (out / "summary.csv").write_text(summary_csv_text)
    with open(out / "trials.jsonl", "w") as fh:
        for r in trials:
            fh.write(json.dumps(r, sort_keys=False) + "\n")
    for src, name in (
        (report_dir / "ablation.md", "ablation.md"),
        (report_dir / "pareto.png", "pareto.png"),
        (report_dir / "memory_breakdown.png", "memory_breakdown.png"),
        (sweep_dir / "sweep.json", "sweep.json"),
        (log, "smoke.log"),
        (log.with_name("profile.md"), "profile.md"),
    ):
        if src.is_file():
            shutil.copyfile(src, out / name)
    written = sorted(p for p in out.iterdir() if p.is_file())
    assert len(written) <= MAX_FILES, written
    return written


def cut_by_time(result: dict[str, Any]) -> bool:
    """A trial the smoke's time cap interrupted (the sweeper closes it ``interrupted (Ctrl-C)``), or one the
    sweeper killed at its ``timeout_s`` (an Unsloth point building cold): "not run", never a failure."""
    return str(result.get("reason") or "").startswith(("interrupted", "timeout:"))


def not_run_rows(
    points: list[tuple[str, list[str]]], trials: list[dict[str, Any]], why: dict[str, str], default: str
) -> list[dict[str, Any]]:
    """Summary rows for the design points no trial result covers: status :data:`NOT_RUN`, with why."""
    done = {_change(r) for r in trials if not cut_by_time(r)}
    rows = []
    for change, _ in points:
        if change in done:
            continue
        row = dict.fromkeys(summary_rows([{}])[0])
        row.update(trial=None, change=change, status=NOT_RUN, reason=why.get(change, default))
        rows.append(row)
    return rows


def verdict(
    trials: list[dict[str, Any]],
    expected: int | None,
    sweep_rc: int,
    *,
    timed_out: bool = False,
    not_run: list[str] | tuple[str, ...] = (),
) -> tuple[bool, str]:
    """Pass when no trial that ran ended in ``error`` and the baseline trained. Points the time plan cut
    (``timed_out``) or could not prepare (``not_run``) are reported as not run, not as failures; a sweep
    that stopped on its own with points missing is a failure."""
    ran = [r for r in trials if not cut_by_time(r)]
    errors = [r for r in ran if r.get("status") not in RESULT_STATUSES]
    baseline = [r for r in ran if ((r.get("meta") or {}).get("design") or {}).get("role") == "baseline"]
    problems = []
    over = [r for r in trials if str(r.get("reason") or "").startswith("timeout:")]
    if sweep_rc != 0 and not timed_out and not over:
        problems.append(f"the sweep exited {sweep_rc}")
    missing = (expected or 0) - len(ran) - len(over)
    if missing > 0 and not timed_out:
        problems.append(f"{len(ran)}/{expected} trials finished")
    if errors:
        problems.append("error in trial(s) " + ", ".join(str(r.get("trial")) for r in errors))
    if not baseline or baseline[0].get("status") != "ok":
        problems.append(
            f"the baseline did not train (status {baseline[0].get('status') if baseline else 'not run'})"
        )
    if problems:
        return False, "; ".join(problems)
    why = "every trial that ran recorded a result and the baseline trained"
    cut = max(missing, 0) if timed_out else 0
    if cut or not_run or over:
        why += f"; not run: {cut + len(not_run) + len(over)} point(s)" + (" (time cap)" if cut else "")
        if over:
            why += f" ({len(over)} over the trial timeout_s)"
    return True, why


# ----------------------------------------------------------------------------------------------- main
#: The dry run: the probe lengths / this (floor 128), the first lengths only (2 compute, 1 fp32): CPU-sized
#: (the whole dry run within the slow test's 240 s on 2 loaded cores).
DRY_PROBE_DIVISOR = 256
#: The dry run's step-time lengths: 1,024 / 4,096 over this (128 vs 256 tokens).
DRY_STEP_TIME_DIVISOR = 16
DRY_PROBE = ["model=tiny", "hardware=cpu", "data.num_docs=4", "data.num_eval_docs=1"]
#: Liger needs CUDA: the dry run probes the same stack without it.
DRY_KERNELS = ["kernels=none"]
#: Statuses that stop the memory probe (the next, longer length would not fit either).
OOM_STATUSES = ("oom", "host_oom")


class Smoke:
    """The run's state: the hard deadline, the plan's caps, the log, and what each phase recorded."""

    def __init__(self, args: argparse.Namespace, phases: dict[str, Phase], python: str, log: Path) -> None:
        self.args, self.phases, self.python, self.log = args, phases, python, log
        self.dry = bool(args.dry_run)
        shell_t0 = float(os.environ.get("VRAMSWEEP_SMOKE_T0") or time.time())
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_s - max(0.0, time.time() - shell_t0)
        self.results: list[dict[str, Any]] = []  # one per phase: {phase, status PASS/FAIL/not run, detail}
        self.probes: list[dict[str, Any]] = []  # one per memory-probe / real-trial point
        self.env: dict[str, Any] = {}
        self.snapshot_md: str | None = None

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - time.perf_counter() - reserve

    def later(self, name: str) -> float:
        names = list(self.phases)
        return sum(self.phases[n].cap_s for n in names[names.index(name) + 1 :])

    def cap(self, name: str, *, slack: bool = False) -> float:
        """A phase's cap, never past what the later phases' caps leave; with ``slack`` all of that."""
        room = self.left(self.later(name))
        return max(0.0, room if slack else min(self.phases[name].cap_s, room))

    def record(self, phase: str, status: str, detail: str) -> None:
        self.results.append({"phase": phase, "status": status, "detail": detail})
        print(f"gpu_smoke: [{phase}] {status}: {detail}", flush=True)

    def run(self, phase: str, cmd: list[str], cap_s: float) -> tuple[int, bool, str]:
        print(f"gpu_smoke: [{phase}] cap {cap_s:.0f} s: {' '.join(cmd[1:3])}", flush=True)
        return run_logged(cmd, cap_s, self.log)

    def overrides(self, tokens: int, dtype: str, steps: int, phase: str = "memprobe") -> list[str]:
        """A memory-probe / real-trial point: the long-context stack on Qwen3-8B under the 15 GiB cap
        (``memprobe_grouped``: + paged 8-bit AdamW and attention in head groups)."""
        model = DRY_PROBE if self.dry else ["model=qwen3_8b", "hardware=rtx4080_16gb"]
        base = [*PROBE_BASE, *DRY_KERNELS] if self.dry else PROBE_BASE
        if phase == "memprobe_grouped":
            base = [*base, *(DRY_PROBE_GROUPED if self.dry else PROBE_GROUPED)]
        rope = PROBE_ROPE if not self.dry and tokens > QWEN3_8B_POSITIONS else []
        return [*model, *base, *rope, f"adapter.dtype={dtype}", f"context.max_tokens={tokens}",
                f"train.steps={steps}", "train.warmup_steps=0", f"train.measure_warmup_steps={steps - 1}",
                "train.micro_batch=1", "train.eval_batches=1", *self.args.overrides]  # fmt: skip


def _verdict_of(text: str, rc: int, timed_out: bool) -> tuple[str, str]:
    line = next((x for x in reversed(text.splitlines()) if x.startswith("verdict:")), None)
    if timed_out and line is None:
        return NOT_RUN, "cut at its cap (smoke.log)"
    if line is None:
        return "FAIL", f"no verdict (exit {rc}; smoke.log)"
    if timed_out and line.startswith("verdict: PASS"):  # its work done, the interpreter's exit cut at the cap
        return "PASS", line + " (its exit cut at the cap)"
    return ("PASS" if line.startswith("verdict: PASS") and rc == 0 else "FAIL"), line


def phase_env(sm: Smoke) -> None:
    sm.env = environment(sm.python, sm.cap("env"))
    env = sm.env
    if "error" in env:
        sm.record("env", "FAIL", f"environment probe: {env['error'].splitlines()[-1][:200]}")
        return
    rt = env.get("pinned_round_trip") or {}
    versions = " · ".join(f"{k} {v or '–'}" for k, v in (env.get("versions") or {}).items())
    trip = rt.get("note") or f"64 MiB pinned round trip {'equal' if rt.get('equal') else 'DIFFERS'}, " + (
        f"h2d {rt.get('h2d_gb_s', 0):.1f} GB/s, d2h {rt.get('d2h_gb_s', 0):.1f} GB/s"
    )
    ok = rt.get("equal") is not False
    sm.record(
        "env",
        "PASS" if ok else "FAIL",
        f"{env.get('device')} · torch {env.get('torch')} · {versions}; {trip}",
    )


def phase_fork(sm: Smoke) -> None:
    rc, to, text = sm.run("fork", [sm.python, str(Path(__file__).resolve()), "--probe-fork"], sm.cap("fork"))
    rep = next((json.loads(x) for x in reversed(text.splitlines()) if x.startswith('{"isolation"')), None)
    if rep is None:
        sm.record("fork", NOT_RUN if to else "FAIL", "cut at its cap" if to else f"no report (exit {rc})")
        return
    forked = rep.get("isolation") == "fork" and not rep.get("fallback_reason")
    detail = (
        f"isolation {rep.get('isolation')} (CUDA host: {rep.get('cuda_host')}), warm-up {rep.get('warmup_s') or 0:.1f} s, "
        f"per trial {rep.get('median_s')} s, preload {len(rep.get('preload') or [])} modules"
        + (f", fell back to spawn: {rep['fallback_reason']}" if rep.get("fallback_reason") else "")
    )
    sm.record("fork", "PASS" if forked else "FAIL", detail)


def _json_rows(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        if line.startswith('{"check"'):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _ratio(x: Any) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def summarise_resume(rows: list[dict[str, Any]]) -> str:
    """gpu_resume_check.py's figures: per setting its judgement, and the cost of determinism."""
    parts = [f"{r['check']}: {r.get('why')}" for r in rows if r["check"].startswith("resume ")]
    cost = next((r for r in rows if r["check"] == "cost of train.deterministic"), None)
    if cost:
        pairs = ", ".join(_ratio(v) for v in cost["pairs"].values())
        parts.append(f"step time deterministic / not {_ratio(cost['mean'])} (pairs {pairs})")
    return "; ".join(parts)


def summarise_use(rows: list[dict[str, Any]]) -> str:
    """gpu_use_check.py's figures: where the model is and the merge check."""
    parts = []
    for r in rows:
        if "placement" in r["check"]:
            parts.append(f"model on {r['device']} ({r['linear4bit']} 4-bit layers)")
        elif r["check"].startswith("vramsweep generate"):
            parts.append(f"generate exit {r['exit']}")
        elif r.get("merged_vs_trained"):
            m = r["merged_vs_trained"]
            parts.append(
                f"merged vs trained max |dlogit| {m['max_abs_logit_diff']:.3f}, mean {m['mean_abs_logit_diff']:.4f}, "
                f"same argmax {100 * m['argmax_agreement']:.1f} %"
                if m.get("measured")
                else "merge check not measured"
            )
    return "; ".join(parts)


def summarise_packing(rows: list[dict[str, Any]]) -> str:
    """gpu_batch_check.py --dtype bf16's throughput line: tokens/s packed vs padded, the kernels' names."""
    r = next((x for x in rows if x["check"] == "packing tokens/s against padding"), None)
    if r is None:
        return ""
    tps = r["tokens_per_s"]
    text = (f"{r['real_tokens']:,} real tokens ({r.get('dtype', '?')}): packed {tps['packed']:,.0f} tokens/s, length-grouped padded "
            f"{tps['padded']:,.0f} ({100 * r['padding_share']:.0f} % padding), packed/padded "
            f"{r['packed_over_padded']:.2f}")  # fmt: skip
    for mode in ("packed", "padded"):
        kernels = r.get(f"kernels_{mode}")
        if kernels is not None:
            names = ", ".join(
                f"{name} x{n}" for name, n in sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
            )
            text += f"; {mode} attention kernels: {names or 'none matched'}"
    return text


#: Phases whose check prints figures worth a place in the summary line (besides smoke.log).
SUMMARIES = {"resume": summarise_resume, "nf4_use": summarise_use, "packing_bf16": summarise_packing}


def phase_check(sm: Smoke, phase: str, script: str, extra: list[str]) -> None:
    cmd = [sm.python, str(ROOT / "scripts" / script), "--device", "cpu" if sm.dry else "cuda", *extra]
    rc, to, text = sm.run(phase, cmd, sm.cap(phase))
    status, detail = _verdict_of(text, rc, to)
    figures = SUMMARIES[phase](_json_rows(text)) if phase in SUMMARIES else ""
    sm.record(phase, status, detail + (f"; {figures}" if figures else ""))


def probe_point(sm: Smoke, phase: str, tokens: int, dtype: str, steps: int, cap_s: float) -> dict[str, Any]:
    """One trial in a fresh interpreter (scripts/gpu_memprobe.py): its probe row, "not run" when cut."""
    base = {"phase": phase, "tokens": tokens, "adapter": dtype}
    if cap_s < 5.0:
        return {**base, "status": NOT_RUN, "reason": "no time left in the phase's cap"}
    cmd = [sm.python, str(ROOT / "scripts" / "gpu_memprobe.py"), *sm.overrides(tokens, dtype, steps, phase)]
    rc, to, text = sm.run(phase, cmd, cap_s)
    row = next((json.loads(x[6:]) for x in reversed(text.splitlines()) if x.startswith("PROBE ")), None)
    if row is None:
        why = "cut at the phase's cap" if to else f"no result (exit {rc}; smoke.log)"
        return {**base, "status": NOT_RUN if to else "error", "reason": why}
    return {**row, **base}


def probe_order_skip(n: int, done: list[dict[str, Any]]) -> str | None:
    """Why a length is not probed after ``done``: at or above one that went OOM, or at or below one that
    fitted (lengths run in the order given: ascending stops at the first OOM; 65,536 then 81,920 then 49,152
    probes one side of the first point only)."""
    oom = [r["tokens"] for r in done if r["status"] in OOM_STATUSES]
    fit = [r["tokens"] for r in done if r["status"] == "ok"]
    if oom and n >= min(oom):
        return f"stopped at the first OOM ({min(oom):,} tokens)"
    if fit and n <= max(fit):
        return f"{max(fit):,} tokens fitted"
    return None


def phase_memprobe(sm: Smoke, phase: str, lengths: tuple[int, ...], dtype: str) -> None:
    """The lengths in the order given, one step each; a length past an OOM or below a fit is not run."""
    end = time.perf_counter() + sm.cap(phase)
    divisor = DRY_PROBE_DIVISOR if sm.dry else 1
    todo = [
        max(128, n // divisor) for n in (lengths[: 2 if dtype == "compute" else 1] if sm.dry else lengths)
    ]
    for n in todo:
        done = [r for r in sm.probes if r["phase"] == phase]
        why = probe_order_skip(n, done)
        if why is not None:
            sm.probes.append(
                {"phase": phase, "tokens": n, "adapter": dtype, "status": NOT_RUN, "reason": why}
            )
            continue
        sm.probes.append(probe_point(sm, phase, n, dtype, PROBE_STEPS, end - time.perf_counter()))
    rows = [r for r in sm.probes if r["phase"] == phase]
    errors = [r for r in rows if r["status"] not in (*RESULT_STATUSES, "host_oom", NOT_RUN)]
    fitted = [r["tokens"] for r in rows if r["status"] == "ok"]
    detail = "; ".join(f"{r['tokens']:,}: {r['status']}" for r in rows)
    detail += f"; longest that fitted: {max(fitted):,}" if fitted else "; none fitted"
    sm.record(
        phase,
        "FAIL" if errors else ("PASS" if any(r["status"] != NOT_RUN for r in rows) else NOT_RUN),
        detail,
    )


def phase_snapshot(sm: Smoke) -> None:
    """The allocator's trace of one step at the longest compute-adapter fit, its peak grouped by owner
    (scripts/gpu_memsnapshot.py; GPU only: the dry run says so)."""
    fitted = [r["tokens"] for r in sm.probes if r["phase"] == "memprobe" and r["status"] == "ok"]
    if getattr(sm.args, "snapshot_tokens", None):
        fitted = [sm.args.snapshot_tokens]
    if sm.dry or not fitted:
        sm.record(
            "snapshot",
            NOT_RUN,
            "CUDA only" if sm.dry else "no compute-adapter length fitted (--snapshot-tokens)",
        )
        return
    out = sm.log.parent / "snapshot.md"
    cmd = [sm.python, str(ROOT / "scripts" / "gpu_memsnapshot.py"), "--out", str(out),
           *sm.overrides(max(fitted), "compute", PROBE_STEPS)]  # fmt: skip
    rc, to, text = sm.run("snapshot", cmd, sm.cap("snapshot"))
    rep = next((json.loads(x[9:]) for x in reversed(text.splitlines()) if x.startswith("SNAPSHOT ")), None)
    if rep is None:
        sm.record(
            "snapshot", NOT_RUN if to else "FAIL", "cut at its cap" if to else f"no summary (exit {rc})"
        )
        return
    sm.snapshot_md = out.read_text() if out.is_file() else None
    top = "; ".join(f"{o['owner']} {o['bytes'] / GIB:.2f} GiB" for o in rep["owners"][:3])
    sm.record("snapshot", "PASS" if rep.get("status") == "ok" else "FAIL",
              f"{max(fitted):,} tokens: traced peak {rep['peak_bytes'] / GIB:.2f} GiB "
              f"(max_allocated {_fmt(_gib(rep.get('max_allocated_bytes')), '.2f')} GiB); top: {top}")  # fmt: skip


def phase_trial(sm: Smoke) -> None:
    fitted = [r["tokens"] for r in sm.probes if r["phase"] == "memprobe" and r["status"] == "ok"]
    if not fitted:
        sm.record("trial", NOT_RUN, "no compute-adapter length fitted (or none was probed)")
        return
    row = probe_point(sm, "trial", max(fitted), "compute", TRIAL_STEPS, sm.cap("trial", slack=True))
    sm.probes.append(row)
    st = row["status"]
    status = NOT_RUN if st == NOT_RUN else ("PASS" if st in (*RESULT_STATUSES, "host_oom") else "FAIL")
    tps = row.get("tokens_per_s")
    sm.record("trial", status, f"{row['tokens']:,} tokens, {TRIAL_STEPS} steps: {st}"
              + (f", {tps:.0f} tokens/s" if tps else "") + (f" ({row['reason']})" if row.get("reason") else ""))  # fmt: skip


def phase_step_time(sm: Smoke) -> None:
    divisor = DRY_STEP_TIME_DIVISOR if sm.dry else 1
    short, long_n = (max(128, n // divisor) for n in STEP_TIME_TOKENS)
    model = ["model=tiny", "hardware=cpu"] if sm.dry else ["model=qwen3_8b", "hardware=rtx4080_16gb"]
    cmd = [sm.python, str(ROOT / "bench" / "step_time.py"), "--short", str(short), "--long", str(long_n),
           "--rounds", "1", "--steps", "3" if sm.dry else "6", "--threads", "0", *model,
           "quant=nf4_dq", "attention=sdpa", "kernels=none", "checkpointing=on",
           *(STEP_TIME_DRY if sm.dry else STEP_TIME_GPU)]  # fmt: skip
    rc, to, text = sm.run("step_time", cmd, sm.cap("step_time"))
    lines = [x for x in text.splitlines() if x.startswith(("median step time", "host vs device"))]
    if lines:
        sm.record("step_time", "PASS" if rc == 0 else "FAIL", "; ".join(lines))
    else:
        sm.record(
            "step_time", NOT_RUN if to else "FAIL", "cut at its cap" if to else f"no figures (exit {rc})"
        )


ALL_PHASES = ("bundle", "env", "fork", "exact", "batching", "packing_bf16", "resume", "nf4_use", "memprobe",
              "memprobe_fp32", "memprobe_grouped", "trial", "snapshot", "step_time", "report")  # fmt: skip


def _tokens(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"gpu_smoke: probe lengths must be comma-separated integers, got {text!r}") from None


def _runner(sm: Smoke):
    """Run a phase that is in the plan; one left out by --only is recorded "not run"."""

    def run(name: str, fn, *args) -> None:
        if name not in sm.phases:
            if name not in OPT_IN:
                sm.record(name, NOT_RUN, "not selected (--only)")
            return
        fn(sm, *args)

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_env or args.probe_fork:
        print(json.dumps(probe_environment() if args.probe_env else probe_fork()))
        return 0
    if args.budget_s is None:
        args.budget_s = DRY_BUDGET_S * dry_load_factor() if args.dry_run else DEFAULT_BUDGET_S
    tokens = {
        "compute_tokens": _tokens(args.probe_tokens) or PROBE_COMPUTE_TOKENS,
        "fp32_tokens": _tokens(args.fp32_tokens) or PROBE_FP32_TOKENS,
    }
    only = None
    if args.only:
        only = tuple(x.strip() for x in args.only.split(",") if x.strip())
        known = [p.name for p in plan(only=tuple(ALL_PHASES))]
        bad = [x for x in only if x not in known]
        if bad:
            raise SystemExit(
                f"gpu_smoke: --only: unknown phase(s) {', '.join(bad)}; allowed: {', '.join(known)}"
            )
        only = (*only, "env", "report")  # env: the CUDA check and versions; report: the files
    if args.dry_run and only is None:  # the dry run goes through every phase, the opt-in ones too
        only = ALL_PHASES
    # --only keeps each phase's own cap (a rerun of a few phases in a short budget); the default plan and
    # the dry run scale theirs to the budget
    scale = 1.0 if only and not args.dry_run else args.budget_s / DEFAULT_BUDGET_S
    if args.dry_run:
        scale = args.budget_s / sum(p.cap_s for p in plan(only=only, **tokens))
    phases = {ph.name: ph for ph in plan(scale=scale, only=only, **tokens)}
    print(render_plan(list(phases.values()), args.budget_s), flush=True)
    print(render_calls(**tokens), flush=True)
    if args.plan:
        return 0
    when = datetime.now(UTC)
    default_out = ROOT / "results" / ("gpu_smoke_dry" if args.dry_run else "gpu_smoke")
    out = Path(args.out or os.environ.get("OUT") or default_out).resolve()
    work = Path(args.work or ROOT / "results" / ".gpu_smoke_work" / when.strftime("%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    check_out(out)
    sm = Smoke(args, phases, sys.executable, work / "smoke.log")
    run = _runner(sm)
    run("env", phase_env)
    if (
        not args.dry_run and "error" not in sm.env and not sm.env.get("cuda_available")
    ):  # a failed probe: go on
        print("gpu_smoke: no CUDA device here; use --dry-run for the CPU path", file=sys.stderr)
        return 2
    run("fork", phase_fork)
    run(
        "exact",
        phase_check,
        "exact",
        "gpu_longctx_check.py",
        ["--tokens", "64", "--tile", "16"] if sm.dry else [],
    )
    run("batching", phase_check, "batching", "gpu_batch_check.py", [])
    run("packing_bf16", phase_check, "packing_bf16", "gpu_batch_check.py", ["--dtype", "bf16"])
    run("resume", phase_check, "resume", "gpu_resume_check.py", ["--work", str(work / "resume")])
    run("nf4_use", phase_check, "nf4_use", "gpu_use_check.py", ["--work", str(work / "nf4_use")])
    run("memprobe", phase_memprobe, "memprobe", tokens["compute_tokens"], "compute")
    run("memprobe_fp32", phase_memprobe, "memprobe_fp32", tokens["fp32_tokens"], "fp32")
    run("memprobe_grouped", phase_memprobe, "memprobe_grouped", PROBE_GROUPED_TOKENS, "compute")
    run("trial", phase_trial)
    run("snapshot", phase_snapshot)
    run("step_time", phase_step_time)
    md = render_device_summary(sm, when)
    files = write_results(out, md, sm)
    print()
    print(md)
    print(f"gpu_smoke: wrote {len(files)} file(s) to {out}: {', '.join(f.name for f in files)}")
    return 0 if all(r["status"] != "FAIL" for r in sm.results) else 1


#: The dry run's budget: every phase's GPU cap x 1.71 (1,800 s over the 1,262 s of phases before issue 53's
#: resume and nf4_use: the older phases keep their CPU caps), x :func:`dry_load_factor` on a busy CPU.
DRY_BUDGET_S = 2400.0
#: The CPU load the dry run's budget is sized for: 2 runnable processes per core. 2026-12-06, load 13-19 on 2
#: cores: the fork, packing_bf16 and resume checks were cut at their scaled caps (the GPU's caps are the
#: plan's sums, unscaled; the dry run checks the code paths).
DRY_LOAD_PER_CORE = 2.0


def dry_load_factor() -> float:
    """How much more time the dry run gets on a busier CPU: the 1-minute load average over
    :data:`DRY_LOAD_PER_CORE` x the cores, at least 1 (printed with the plan)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    factor = max(1.0, load / (DRY_LOAD_PER_CORE * (os.cpu_count() or 1)))
    if factor > 1.0:
        print(f"gpu_smoke: --dry-run: load {load:.1f} on {os.cpu_count()} cores: the budget x {factor:.2f}")
    return factor


#: What the device run writes (at most MAX_FILES files).
RESULT_FILES = ("summary.md", "summary.csv", "trials.jsonl", "phases.json", "smoke.log", "snapshot.md")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, embedded tiny model, tiny steps")
    p.add_argument("--plan", action="store_true", help="print the time plan and exit")
    p.add_argument("--out", help="result folder (default: $OUT, else results/gpu_smoke[_dry])")
    p.add_argument("--work", help="working folder (default: results/.gpu_smoke_work/<stamp>)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget of the whole smoke (default {DEFAULT_BUDGET_S:.0f} s; "
                   f"{DRY_BUDGET_S:.0f} s x the CPU load factor for --dry-run); every phase cap scales with it")  # fmt: skip
    p.add_argument("--only", help="comma-separated phases to run (the rest: not run), e.g. memprobe,snapshot")
    p.add_argument(
        "--probe-tokens", help="compute-adapter probe lengths, in the order probed (e.g. 65536,81920,49152)"
    )
    p.add_argument("--fp32-tokens", help="fp32-adapter probe lengths, in the order probed")
    p.add_argument("--snapshot-tokens", type=int,
                   help="the snapshot's length (default: the longest compute-adapter length that fitted in this run)")  # fmt: skip
    p.add_argument("--probe-env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-fork", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "overrides", nargs="*", help="extra overrides of every probe point after --, e.g. -- train.seed=1"
    )
    return p.parse_args(argv)


def probe_fork() -> dict[str, Any]:
    """The sweeper's default fork server on this host (its default preload, the CUDA-host rules): two no-op
    trials forked from it; ``isolation`` stays ``fork`` unless it fell back to spawn (``fallback_reason``)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from trial_overhead import measure_overhead

    return measure_overhead("fork", n=2)


def check_out(out: Path) -> None:
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.name not in RESULT_FILES]
        if foreign:
            raise SystemExit(
                f"gpu_smoke: {out} holds other files ({', '.join(sorted(foreign)[:5])}): use an empty --out"
            )


def _probe_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| phase | tokens | adapters | status | reserved GiB | allocated GiB | alloc retries | pool GiB "
             "| estimate GiB | tokens/s | wall s | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        g = [_fmt(_gib(r.get(k)), ".2f") for k in ("peak_reserved_bytes", "peak_allocated_bytes")]
        lines.append(
            f"| {r['phase']} | {r['tokens']:,} | {r['adapter']} | {r['status']} | {g[0]} | {g[1]} | "
            f"{_fmt(r.get('num_alloc_retries'), 'd')} | {_fmt(_gib(r.get('pool_bytes')), '.2f')} | "
            f"{_fmt(_gib(r.get('estimate_bytes')), '.2f')} | {_fmt(r.get('tokens_per_s'), '.0f')} | "
            f"{_fmt(r.get('wall_s'), '.0f')} | {_short(str(r.get('reason') or ''))} |"
        )
    return lines


def render_device_summary(sm: Smoke, when: datetime) -> str:
    """The dated markdown summary: one line per phase in run order, the probe table, the verdict."""
    date = when.strftime("%Y-%m-%d")
    title = (f"### GPU smoke — DRY RUN on CPU ({date}, embedded tiny model; not GPU figures)" if sm.dry
             else f"### GPU smoke — {date} ({sm.env.get('device', '?')}; Qwen3-8B random init under a 15 GiB cap)")  # fmt: skip
    lines = [title, ""]
    lines += [f"- {r['phase']}: {r['status']}: {r['detail']}" for r in sm.results]
    if sm.probes:
        lines += [
            "",
            "Memory probe and real trial (peaks of the training step; CPU: tracked tensor bytes):",
            "",
        ]
        lines += _probe_table(sm.probes)
    failed = [r["phase"] for r in sm.results if r["status"] == "FAIL"]
    not_run = [r["phase"] for r in sm.results if r["status"] == NOT_RUN]
    why = "every phase that ran passed" if not failed else f"failed: {', '.join(failed)}"
    why += f"; not run: {', '.join(not_run)}" if not_run else ""
    wall = time.perf_counter() - sm.t0
    lines += ["", f"Verdict: {'PASS' if not failed else 'FAIL'}: {why}. Wall time {wall:.0f} s."]
    return "\n".join(lines) + "\n"


def write_results(out: Path, md: str, sm: Smoke) -> list[Path]:
    """summary.md, summary.csv (the probe rows), trials.jsonl, phases.json, smoke.log. Returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    check_out(out)
    (out / "summary.md").write_text(md)
    cols = ["phase", "tokens", "adapter", "status", "peak_reserved_bytes", "memory_kind", "peak_allocated_bytes",
            "num_alloc_retries", "pool_bytes", "estimate_bytes", "tokens_per_s", "wall_s", "reason"]  # fmt: skip
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in sm.probes:
        w.writerow(r)
    (out / "summary.csv").write_text(buf.getvalue())
    (out / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sm.probes))
    (out / "phases.json").write_text(json.dumps({"results": sm.results, "env": sm.env}, indent=1) + "\n")
    if sm.log.is_file():
        shutil.copyfile(sm.log, out / "smoke.log")
    if sm.snapshot_md:
        (out / "snapshot.md").write_text(sm.snapshot_md)
    written = sorted(p for p in out.iterdir() if p.is_file())
    assert len(written) <= MAX_FILES, written
    return written


def profile_summary(prof: dict[str, Any]) -> str:
    """One line per profiled length: mean step wall time, GPU-idle fraction and kernels per step."""
    steps = prof.get("steps") or []
    walls = [s["wall_ms"] for s in steps] or [w * 1e3 for w in prof.get("walls_s") or []]
    text = f"{prof['tokens']} tokens: {sum(walls) / max(len(walls), 1):.0f} ms/step"
    idle = [s["gpu_idle_fraction"] for s in steps if s.get("gpu_idle_fraction") is not None]
    if idle:
        kernels = [s["kernels"] for s in steps if s.get("kernels") is not None]
        text += (
            f", GPU idle {sum(idle) / len(idle):.0%}, {sum(kernels) / max(len(kernels), 1):.0f} kernels/step"
        )
    return text


if __name__ == "__main__":
    sys.exit(main())
