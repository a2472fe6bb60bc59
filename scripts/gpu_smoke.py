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
#: Seconds per sweep trial, slot to slot, measured on 2026-12-01 (10 spawn trials, H200, Qwen3-8B
#: nf4_dq, <= 4,096 tokens; tests/fixtures/gpu_2026-12-01/smoke_timing.json): first start to last finish
#: 185.4 s = 18.5 s per trial (slowest slot 27.8 s, int8).
MEASURED_TRIAL_S = 18.5
#: The plan's margin over the measured per-trial time (the unproven knobs may be slower).
TRIAL_MARGIN = 1.5
#: What the plan gives each sweep point: >= MEASURED_TRIAL_S x TRIAL_MARGIN (tested against the fixture).
TRIAL_S = 28.0
#: CLI start, study creation and the first trial's interpreter (2026-12-01: 22.9 s from the sweep's stamp
#: to trial 0's start, 6-7 s of it that trial's spawn).
SWEEP_STARTUP_S = 25.0
#: A cold interpreter's start before a trial can build anything (2026-12-01: 6-7 s of each spawn trial).
SPAWN_S = 7.0
#: Extracting + activating the 47.1 MiB bundle, in the shell before this driver (inside the budget): 22.9 s
#: measured on 2 shared CPU cores at load 9 (2026-12-02, python tarfile, 254 MiB out), x 1.3.
EXTRACT_S = 30.0
#: The environment probe imports torch only (versions come from importlib.metadata, so a cold ``import
#: unsloth`` from a fresh bundle cannot time it out): 10 s measured for ``import torch`` + the metadata reads
#: on 2 shared CPU cores (2026-12-02), + CUDA init and NVML (unmeasured): 30 s.
ENV_S = 30.0
#: Measured 2026-12-01 (H200, 15 GiB cap, nf4_dq + liger + checkpointing=on): 6,337 tokens/s at 12,288 tokens.
LONG_TOKENS_PER_S = 6337.0
#: The long-context probe's steps (``train.steps=3``) at its context length.
LONG_STEPS, LONG_TOKENS = 3, 16384
#: One long-context trial: a sweep trial's slot plus its steps at 16,384 tokens at the measured rate, with the
#: margin (offload's host copies are unmeasured on a GPU): 28 + 1.5 x 3 x 16,384 / 6,337 = 39.6 s.
LONG_TRIAL_S = TRIAL_S + TRIAL_MARGIN * LONG_STEPS * LONG_TOKENS / LONG_TOKENS_PER_S
#: bench/step_time.py: two cold interpreters, each building the model and stepping (a spawn trial's measured
#: 18.5 s + its 7 s start), with the margin: 1.5 x 2 x (7 + 18.5) = 76.5 s.
STEP_TIME_S = TRIAL_MARGIN * 2 * (SPAWN_S + MEASURED_TRIAL_S)
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


def plan(n_points: int, *, n_long: int = 1 + len(LONG_FACTORS), scale: float = 1.0) -> list[Phase]:
    """The smoke's phases and their caps (``scale`` = budget / :data:`DEFAULT_BUDGET_S`). A phase is
    stopped at its cap; a sweep point it did not reach is reported "not run"."""
    phases = [
        Phase(
            "bundle",
            EXTRACT_S,
            "extract + activate the bundle, in the shell (22.9 s measured on 2 CPU cores; 0 when extracted)",
        ),
        Phase(
            "env",
            ENV_S,
            "versions from importlib.metadata, device, driver (a throwaway process importing torch only)",
        ),
        Phase(
            "exact",
            25,
            "scripts/gpu_longctx_check.py: tiny NF4 Qwen3, on vs offload vs offload+tiling gradients, tiles in "
            "every pass, pinned exact pool",
        ),
        Phase(
            "weights",
            80,
            "Unsloth's random-weights folder (Qwen3-8B: 16.4 GB, 8 threads); else its points not run",
        ),
        Phase(
            "sweep",
            SWEEP_STARTUP_S + n_points * TRIAL_S,
            f"{SWEEP}: {n_points} points x {TRIAL_S:.0f} s + {SWEEP_STARTUP_S:.0f} s start-up, unproven first",
        ),
        Phase(
            "long",
            SWEEP_STARTUP_S + n_long * LONG_TRIAL_S,
            f"{LONG_SWEEP}: {n_long} point(s) x {LONG_TRIAL_S:.0f} s ({TRIAL_S:.0f} s + {LONG_STEPS} steps of "
            f"{LONG_TOKENS:,} tokens at {LONG_TOKENS_PER_S:,.0f} tok/s x {TRIAL_MARGIN}) + {SWEEP_STARTUP_S:.0f} s start-up",
        ),
        Phase(
            "step_time",
            STEP_TIME_S,
            f"bench/step_time.py: 1,024 vs 4,096 tokens, host vs device; 2 cold interpreters x "
            f"({SPAWN_S:.0f} s start + {MEASURED_TRIAL_S} s build and steps) x {TRIAL_MARGIN}",
        ),
        Phase("report", 20, "vramsweep report (its own cap) + summary + bundle"),
    ]
    return [Phase(p.name, p.cap_s * scale, p.what) for p in phases]


def render_plan(phases: list[Phase], budget_s: float, points: list[tuple[str, list[str]]]) -> str:
    """The plan as printed before anything runs: each phase's cap, their sum against the budget, the points."""
    lines = [f"gpu_smoke: plan (budget {budget_s:.0f} s)"]
    t = 0.0
    for p in phases:
        lines.append(f"  {t:5.0f} s +{p.cap_s:5.0f} s  {p.name:<9} {p.what}")
        t += p.cap_s
    lines.append(
        f"  total {t:.0f} s <= {budget_s:.0f} s"
        if t <= budget_s
        else f"  total {t:.0f} s > {budget_s:.0f} s!"
    )
    lines.append("  sweep points, in run order: " + "; ".join(c for c, _ in points))
    lines.append("  then, in the time left unused: torch.profiler on the baseline (profile.md)")
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
DRY_ARCH = [
    "model=qwen3_8b",
    "model.vocab_size=512",
    "model.hidden_size=128",
    "model.intermediate_size=512",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=32",
]
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
    else:
        env["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    return env


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
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, embedded tiny model, tiny steps")
    p.add_argument("--plan", action="store_true", help="print the time plan and exit")
    p.add_argument("--out", help="result folder (default: $OUT, else results/gpu_smoke[_dry])")
    p.add_argument("--work", help="sweep working folder (default: results/.gpu_smoke_work/<stamp>)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"wall-clock budget of the whole smoke (default {DEFAULT_BUDGET_S:.0f} s; 1800 s for --dry-run "
        "on busy CPUs); every phase cap scales with it",
    )
    p.add_argument(
        "--isolation",
        choices=("fork", "spawn"),
        default=None,
        help="trial isolation (default: the sweeper's fork server)",
    )
    p.add_argument("--probe-env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra overrides after --, e.g. -- train.steps=8")
    args = p.parse_args(argv)
    if args.probe_env:
        print(json.dumps(probe_environment()))
        return 0

    python = sys.executable
    if args.budget_s is None:
        args.budget_s = 1800.0 if args.dry_run else DEFAULT_BUDGET_S
    divisor = DRY_CONTEXT_DIVISOR if args.dry_run else 1
    points = [
        (
            " ".join(_scale_override(o, divisor) for o in ovs) if c != "(baseline)" else c,
            [_scale_override(o, divisor) for o in ovs],
        )
        for c, ovs in design_points(SWEEP_FILES / f"{SWEEP}.yaml")
    ]
    scale = args.budget_s / DEFAULT_BUDGET_S
    phases = {ph.name: ph for ph in plan(len(points), scale=scale)}
    print(render_plan(list(phases.values()), args.budget_s, points), flush=True)
    if args.plan:
        return 0
    when = datetime.now(UTC)
    stamp = when.strftime("%Y%m%d-%H%M%S")
    default_out = ROOT / "results" / ("gpu_smoke_dry" if args.dry_run else "gpu_smoke")
    out = Path(args.out or os.environ.get("OUT") or default_out).resolve()
    work = Path(args.work or ROOT / "results" / ".gpu_smoke_work" / stamp).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "smoke.log"
    t0 = time.perf_counter()
    # hard: the shell's start (bundle extraction included) counts; the plan's caps shrink to what is left
    shell_t0 = float(os.environ.get("VRAMSWEEP_SMOKE_T0") or time.time())
    deadline = t0 + args.budget_s - max(0.0, time.time() - shell_t0)

    def left(reserve: float = 0.0) -> float:
        return deadline - time.perf_counter() - reserve

    def cap(name: str, *later: str) -> float:
        """A phase's cap, never past what the later phases' caps leave of the budget."""
        return max(0.0, min(phases[name].cap_s, left(sum(phases[n].cap_s for n in later))))

    env = environment(python, cap("env", "exact", "weights", "sweep", "long", "step_time", "report"))
    if "error" in env:
        print(f"gpu_smoke: cannot import torch with {python}:\n{env['error']}", file=sys.stderr)
        return 1
    if not args.dry_run and not env.get("cuda_available"):
        print("gpu_smoke: no CUDA device here; use --dry-run for the CPU path", file=sys.stderr)
        return 2
    missing = [m for m in ("bitsandbytes", "hydra", "optuna") if not (env.get("versions") or {}).get(m)]
    if missing:
        print(
            f"gpu_smoke: required package(s) missing: {', '.join(missing)} (see scripts/fetch_gpu_wheels.sh)",
            file=sys.stderr,
        )
        return 1
    print(
        f"gpu_smoke: {env.get('device')} · torch {env.get('torch')} · "
        + " · ".join(f"{k} {v or '–'}" for k, v in (env.get("versions") or {}).items()),
        flush=True,
    )

    base_model = (
        ["model=tiny", "hardware=cpu"] if args.dry_run else ["model=qwen3_8b", "hardware=rtx4080_16gb"]
    )
    iso = [f"hydra.sweeper.isolation={args.isolation}"] if args.isolation else []
    notes: list[str] = [n for n in (plots_note(env),) if n]
    why_not_run: dict[str, str] = {}

    # 0. Long-context exactness on the device (unproven on a GPU): seconds, before anything long.
    ecap = cap("exact", "weights", "sweep", "long", "step_time", "report")
    cmd = [
        python,
        str(ROOT / "scripts" / "gpu_longctx_check.py"),
        "--device",
        "cpu" if args.dry_run else "cuda",
    ]
    if args.dry_run:
        cmd += ["--tokens", "64", "--tile", "16"]
    print(f"gpu_smoke: long-context exactness (cap {ecap:.0f} s)", flush=True)
    erc, eto, text = run_logged(cmd, ecap, log, tee=True)
    verdict_line = next((x for x in reversed(text.splitlines()) if x.startswith("verdict:")), None)
    notes.append(
        "Long-context exactness (scripts/gpu_longctx_check.py): "
        + (
            verdict_line
            or f"not finished (exit {erc}{', cut at its cap: not run' if eto else ''}; smoke.log)"
        )
    )

    # 1. Unsloth's weights folder for the Qwen3-8B architecture: written once, outside the trials' timeouts,
    #    within its cap; when it is not there in time, the Unsloth points are not run (never an error).
    weights = None
    unsloth_ok = str((env.get("versions") or {}).get("unsloth") or "").split(":")[0] not in (
        "",
        "import failed",
    )
    if args.dry_run or unsloth_ok:  # the dry run writes a tiny architecture's folder (same code path)
        cmd = [python, "-m", "vramsweep.knobs.arch_weights", "--workers", str(min(8, os.cpu_count() or 1))]
        wcap = cap("weights", "sweep", "long", "step_time", "report")
        print(
            f"gpu_smoke: Unsloth weights folder for qwen3_8b (once, into VRAMSWEEP_CACHE; cap {wcap:.0f} s)",
            flush=True,
        )
        arch = DRY_ARCH if args.dry_run else base_model
        wrc, wto, text = run_logged(cmd + arch, wcap, log, tee=True)
        weights = next((json.loads(x) for x in reversed(text.splitlines()) if x.startswith("{")), None)
        if weights is None:
            reason = (
                f"Unsloth weights folder not written within its {wcap:.0f} s cap"
                if wto
                else f"Unsloth weights folder not written (exit {wrc}; smoke.log)"
            )
            notes.append(reason)
            for change, ovs in points:
                if "kernels=unsloth" in ovs:
                    why_not_run[change] = reason
    if weights is not None:
        notes.append(
            f"Unsloth weights folder (random {'tiny Qwen3 test architecture' if args.dry_run else 'Qwen3-8B'}, "
            f"{weights['dtype']}): {weights['disk_bytes'] / 1e9:.3f} GB on disk in {weights['shards']} shards, "
            + (
                f"written in {weights['write_s']:.1f} s ({weights['write_mb_per_s']:.0f} MB/s)"
                if weights["written_now"]
                else f"reused (written earlier in {weights['write_s']:.1f} s)"
            )
        )

    # 2. The ablation sweep (sweeps/gpu_smoke.yaml), unproven points first, within its cap.
    run_points = [pt for pt in points if pt[0] not in why_not_run]
    design = [
        f"sweep.baseline={_quote(run_points[0][1])}",
        "sweep.factors=[" + ",".join(_quote(ovs) for _, ovs in run_points[1:]) + "]",
    ]
    overrides = (DRY_OVERRIDES if args.dry_run else []) + design + list(args.overrides) + iso
    sweep_dir = work / "sweeps" / SWEEP
    budget = cap("sweep", "long", "step_time", "report")
    print(f"gpu_smoke: sweep {SWEEP} -> {sweep_dir} (cap {budget:.0f} s, log {log})", flush=True)
    rc, timed_out = run_sweep(python, work, overrides, budget, log)
    trials = load_trials(sweep_dir)
    expected = None
    try:
        expected = int(json.loads((sweep_dir / "sweep.json").read_text()).get("n_total"))
    except (OSError, ValueError, TypeError):
        pass

    # 3. Long-context probe: the long-context stack at 16,384 tokens under the cap.
    long_trials: list[dict[str, Any]] = []
    long_rc, long_to = 0, False
    budget = cap("long", "step_time", "report")
    if budget > 20 * scale:
        long_ov = (DRY_OVERRIDES if args.dry_run else []) + [
            f"sweep.name={LONG_SWEEP}",
            "sweep.baseline=" + _quote([_scale_override(o, divisor) for o in LONG_BASELINE]),
            "sweep.factors=["
            + ",".join(_quote([_scale_override(o, divisor) for o in f]) for f in LONG_FACTORS)
            + "]",
            *([] if args.dry_run else ["train.steps=3", "train.measure_warmup_steps=1"]),  # dry: already
            *list(args.overrides),
            *iso,
        ]
        print(
            f"gpu_smoke: long-context probe -> {work / 'sweeps' / LONG_SWEEP} (cap {budget:.0f} s)",
            flush=True,
        )
        long_rc, long_to = run_sweep(python, work, long_ov, budget, log)
        long_trials = load_trials(work / "sweeps" / LONG_SWEEP)
    else:
        notes.append("long-context probe: not run (time budget spent)")

    # 4. Step time at two lengths, host vs device per step (bench/step_time.py): the fixed per-step cost.
    baseline = [o for o in points[0][1] if not o.startswith("context.max_tokens")]
    budget = cap("step_time", "report")
    short, long_n = (max(128, n // divisor) for n in STEP_TIME_TOKENS)
    if budget > 15 * scale:
        cmd = [
            python,
            str(ROOT / "bench" / "step_time.py"),
            "--short",
            str(short),
            "--long",
            str(long_n),
            "--rounds",
            "1",
            "--steps",
            "3" if args.dry_run else "6",
            *base_model,
            *baseline,
            *(STEP_TIME_DRY if args.dry_run else STEP_TIME_GPU),
        ]
        src, sto, text = run_logged(cmd, budget, log)
        ratio = [x for x in text.splitlines() if x.startswith(("median step time", "host vs device"))]
        notes.append(
            "Step time (bench/step_time.py, baseline): "
            + (
                "; ".join(ratio)
                if ratio
                else f"not finished (exit {src}{', cut at its cap' if sto else ''}; smoke.log)"
            )
        )
    else:
        notes.append("step-time pass: not run (time budget spent)")

    # 5. torch.profiler on the baseline, only in what the plan left unused (the report keeps its cap).
    profile_md = work / "profile.md"
    prof_lines = []
    for tokens in PROFILE_TOKENS:
        n = max(128, tokens // divisor)
        budget = min(60 * scale, left(phases["report"].cap_s))
        if budget < 30 * scale:
            prof_lines.append(f"{n} tokens: not run (no time left in the plan)")
            continue
        cmd = [python, str(ROOT / "scripts" / "gpu_profile.py"), "--tokens", str(n), "--out", str(profile_md)]
        prc, pto, text = run_logged(cmd + ["--", *base_model, *baseline], budget, log)
        prof = next(
            (json.loads(x.split(" ", 1)[1]) for x in text.splitlines() if x.startswith("PROFILE_JSON ")), None
        )
        if prof is None:
            prof_lines.append(f"{n} tokens: failed (exit {prc}{', timed out' if pto else ''}; smoke.log)")
            continue
        prof_lines.append(profile_summary(prof))
    if prof_lines:
        notes.append(
            "Profiler (baseline, 2 profiled steps): " + "; ".join(prof_lines) + " (tables: profile.md)"
        )

    # 6. Report, summary, bundle.
    report_dir = work / "report"
    report_rc, report_cut = (
        run_report(python, sweep_dir, report_dir, log, max(0.0, left(2.0))) if trials else (1, False)
    )
    command = "bash scripts/gpu_smoke.sh" + (" --dry-run" if args.dry_run else "")
    rows = summary_rows(trials)
    cut_reason = f"cut at the sweep's {phases['sweep'].cap_s:.0f} s cap"
    for row, r in zip(rows, trials, strict=True):
        if cut_by_time(r):
            own = str(r.get("reason") or "").splitlines()[0]
            row.update(status=NOT_RUN, reason=own if own.startswith("timeout:") else cut_reason)
    rows += not_run_rows(points, trials, why_not_run, cut_reason)
    md = render_summary(
        rows, env, trials, dry=args.dry_run, command=command, when=when, sweep_rc=rc, timed_out=timed_out
    )
    long_rows = summary_rows(long_trials)
    if long_rows:
        md += (
            "\n"
            + render_table(
                long_rows, title="Long-context probe (liger + offload + tiling=mlp + 16-bit adapters)"
            )
            + (f"Long-context sweep exit code {long_rc}{' (stopped at its cap)' if long_to else ''}.\n")
        )
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    ok, why = verdict(trials, expected, rc, timed_out=timed_out, not_run=list(why_not_run))
    long_errors = [r for r in long_trials if r.get("status") not in RESULT_STATUSES and not cut_by_time(r)]
    if long_errors:
        ok, why = (
            False,
            f"{why}; error in long-context trial(s) " + ", ".join(str(r.get("trial")) for r in long_errors),
        )
    if report_cut:
        why += "; the report: not run (cut at its cap; the summary above is complete)"
    elif report_rc != 0:
        ok, why = False, f"{why}; the report failed (exit {report_rc}, see smoke.log)"
    md += f"\nVerdict: {'PASS' if ok else 'FAIL'}: {why}. Wall time {time.perf_counter() - t0:.0f} s.\n"
    with open(log, "a") as fh:
        fh.write(f"\ngpu_smoke: environment {json.dumps(env)}\n")
    files = bundle(
        out,
        summary_md=md,
        summary_csv_text=summary_csv(rows + long_rows),
        trials=trials + long_trials,
        sweep_dir=sweep_dir,
        report_dir=report_dir,
        log=log,
    )
    print()
    print(md)
    print(f"gpu_smoke: wrote {len(files)} file(s) to {out}: {', '.join(f.name for f in files)}")
    return 0 if ok else 1


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
