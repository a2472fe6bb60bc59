"""GPU smoke test driver (called by ``scripts/gpu_smoke.sh``; run that, not this).

Runs ``src/vramsweep/conf/sweep/gpu_smoke.yaml`` through the real CLI (``vramsweep train -m sweep=gpu_smoke``) in a child
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = ROOT / "src" / "vramsweep" / "conf" / "sweep"  # the packaged sweep files
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
#: The long-context probe: a second, 2-trial sweep (Qwen3-8B nf4_dq + Liger + checkpointing, 16 GiB cap).
LONG_SWEEP = "gpu_smoke_long"
LONG_BASELINE = [
    "quant=nf4_dq",
    "attention=sdpa",
    "kernels=liger",
    "checkpointing=on",
    "context.max_tokens=12288",
]
LONG_FACTORS = [["context.max_tokens=16384"]]
#: The profiler pass: the smoke baseline at these lengths (2 warm-up + 2 profiled steps each).
PROFILE_TOKENS = (1024, 4096)
#: Seconds of the --budget-s each phase may take at most (the sweep gets what the others leave).
PHASE_CAP_S = {"weights": 150.0, "long": 75.0, "profile": 90.0}
#: Harmless noise filtered out of what the user sees (the trial logs keep it): Liger 0.8.5 with Triton 3.6
#: probes its Ascend (NPU) backend on import and reports the failed import of triton's ``tanh``.
HARMLESS = (
    re.compile(r"Backend impl 'liger_kernel\.ops\.backends\._ascend\.rope'.*cannot import name 'tanh'"),
)
#: Statuses that are results (the smoke test passes with them); ``error`` is a failure.
RESULT_STATUSES = ("ok", "oom", "unsupported", "infeasible_estimate", "pruned", "diverged")
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
ENV_MODULES = (
    "transformers",
    "peft",
    "bitsandbytes",
    "liger_kernel",
    "flash_attn",
    "pynvml",
    "triton",
    "optuna",
    "hydra",
    "unsloth",
)


# ------------------------------------------------------------------------------------------ environment
def probe_environment() -> dict[str, Any]:
    """Versions, device and allocator settings (run in a throwaway process: it may initialise CUDA)."""
    import importlib
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
    for mod in ENV_MODULES:
        try:
            m = importlib.import_module(mod)
            env["versions"][mod] = str(getattr(m, "__version__", "installed"))
        except Exception as exc:  # missing, or importable only with a GPU
            env["versions"][mod] = (
                None if isinstance(exc, ImportError) else f"import failed: {type(exc).__name__}"
            )
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


def environment(python: str) -> dict[str, Any]:
    """:func:`probe_environment` in a child process (JSON on stdout)."""
    proc = subprocess.run(
        [python, str(Path(__file__).resolve()), "--probe-env"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
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


def run_logged(cmd: list[str], budget_s: float, log: Path, *, tee: bool = False) -> tuple[int, bool, str]:
    """Run ``cmd`` in its own process group, output filtered (:class:`NoiseFilter`) into ``log`` (and the
    console with ``tee``); SIGINT/SIGTERM/SIGKILL it when over ``budget_s``.

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
        try:
            rc = proc.wait(timeout=max(budget_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            fh.write(f"\ngpu_smoke: over the {budget_s:.0f} s budget: interrupting\n")
            fh.flush()
            for sig, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
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
        reader.join(10)
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


def run_report(python: str, sweep_dir: Path, out: Path, log: Path) -> int:
    cmd = [python, "-m", "vramsweep.cli", "report", str(sweep_dir), "--out", str(out)]
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=600).returncode


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


def verdict(trials: list[dict[str, Any]], expected: int | None, sweep_rc: int) -> tuple[bool, str]:
    """Pass when the sweep finished every point, no trial ended in ``error`` and the baseline trained."""
    errors = [r for r in trials if r.get("status") not in RESULT_STATUSES]
    baseline = [r for r in trials if ((r.get("meta") or {}).get("design") or {}).get("role") == "baseline"]
    problems = []
    if sweep_rc != 0:
        problems.append(f"the sweep exited {sweep_rc}")
    if expected is not None and len(trials) < expected:
        problems.append(f"{len(trials)}/{expected} trials finished")
    if errors:
        problems.append("error in trial(s) " + ", ".join(str(r.get("trial")) for r in errors))
    if not baseline or baseline[0].get("status") != "ok":
        problems.append(
            f"the baseline did not train (status {baseline[0].get('status') if baseline else 'missing'})"
        )
    return (not problems), ("; ".join(problems) or "every trial recorded a result and the baseline trained")


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, embedded tiny model, tiny steps")
    p.add_argument("--out", help="result folder (default: $OUT, else results/gpu_smoke[_dry])")
    p.add_argument("--work", help="sweep working folder (default: results/.gpu_smoke_work/<stamp>)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole smoke (default 470 s: weights folder, sweep, long-context "
        "probe, profiler; 1800 s for --dry-run on busy CPUs)",
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
        args.budget_s = 1800.0 if args.dry_run else 470.0
    when = datetime.now(UTC)
    stamp = when.strftime("%Y%m%d-%H%M%S")
    default_out = ROOT / "results" / ("gpu_smoke_dry" if args.dry_run else "gpu_smoke")
    out = Path(args.out or os.environ.get("OUT") or default_out).resolve()
    work = Path(args.work or ROOT / "results" / ".gpu_smoke_work" / stamp).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "smoke.log"
    t0 = time.perf_counter()

    env = environment(python)
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

    deadline = t0 + args.budget_s

    def left(reserve: float = 0.0) -> float:
        return deadline - time.perf_counter() - reserve

    divisor = DRY_CONTEXT_DIVISOR if args.dry_run else 1
    base_model = (
        ["model=tiny", "hardware=cpu"] if args.dry_run else ["model=qwen3_8b", "hardware=rtx4080_16gb"]
    )
    iso = [f"hydra.sweeper.isolation={args.isolation}"] if args.isolation else []
    notes: list[str] = []

    # 1. Unsloth's weights folder for the Qwen3-8B architecture: written once, outside the trials' timeouts.
    weights = None
    unsloth_ok = str((env.get("versions") or {}).get("unsloth") or "").split(":")[0] not in (
        "",
        "import failed",
    )
    if args.dry_run or unsloth_ok:  # the dry run writes a tiny architecture's folder (same code path)
        cmd = [python, "-m", "vramsweep.knobs.arch_weights", "--workers", str(min(8, os.cpu_count() or 1))]
        print(
            "gpu_smoke: Unsloth weights folder for qwen3_8b (written once into VRAMSWEEP_CACHE)", flush=True
        )
        arch = DRY_ARCH if args.dry_run else base_model
        wrc, wto, text = run_logged(cmd + arch, min(PHASE_CAP_S["weights"], left(200)), log, tee=True)
        weights = next((json.loads(x) for x in reversed(text.splitlines()) if x.startswith("{")), None)
        if weights is None:
            notes.append(
                f"Unsloth weights folder: not written (exit {wrc}{', timed out' if wto else ''}; smoke.log)"
            )
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

    # 2. The ablation sweep (src/vramsweep/conf/sweep/gpu_smoke.yaml).
    dry = DRY_OVERRIDES + dry_design_overrides(SWEEP_FILES / f"{SWEEP}.yaml") if args.dry_run else []
    overrides = dry + list(args.overrides) + iso
    sweep_dir = work / "sweeps" / SWEEP
    budget = max(60.0, left(PHASE_CAP_S["long"] + PHASE_CAP_S["profile"]))
    print(f"gpu_smoke: sweep {SWEEP} -> {sweep_dir} (budget {budget:.0f} s, log {log})", flush=True)
    rc, timed_out = run_sweep(python, work, overrides, budget, log)
    trials = load_trials(sweep_dir)
    report_dir = work / "report"
    report_rc = run_report(python, sweep_dir, report_dir, log) if trials else 1
    expected = None
    try:
        expected = int(json.loads((sweep_dir / "sweep.json").read_text()).get("n_total"))
    except (OSError, ValueError, TypeError):
        pass

    # 3. Long-context probe: nf4_dq + Liger + checkpointing at 12,288 and 16,384 tokens under the cap.
    long_trials: list[dict[str, Any]] = []
    long_rc, long_to = 0, False
    budget = min(PHASE_CAP_S["long"], left(PHASE_CAP_S["profile"]))
    if budget > 20:
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
            f"gpu_smoke: long-context probe -> {work / 'sweeps' / LONG_SWEEP} (budget {budget:.0f} s)",
            flush=True,
        )
        long_rc, long_to = run_sweep(python, work, long_ov, budget, log)
        long_trials = load_trials(work / "sweeps" / LONG_SWEEP)
    else:
        notes.append("long-context probe: skipped (time budget spent)")

    # 4. torch.profiler on the baseline: where a step's fixed cost goes.
    profile_md = work / "profile.md"
    baseline = [o for o in _baseline(SWEEP_FILES / f"{SWEEP}.yaml") if not o.startswith("context.max_tokens")]
    prof_lines = []
    for tokens in PROFILE_TOKENS:
        n = max(128, tokens // divisor)
        budget = min(PHASE_CAP_S["profile"] / len(PROFILE_TOKENS), left()) if not args.dry_run else left()
        if budget < 15:
            prof_lines.append(f"{n} tokens: skipped (time budget spent)")
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

    command = "bash scripts/gpu_smoke.sh" + (" --dry-run" if args.dry_run else "")
    rows = summary_rows(trials)
    md = render_summary(
        rows, env, trials, dry=args.dry_run, command=command, when=when, sweep_rc=rc, timed_out=timed_out
    )
    long_rows = summary_rows(long_trials)
    if long_rows:
        md += (
            "\n"
            + render_table(long_rows, title="Long-context probe (nf4_dq + liger + checkpointing)")
            + (
                f"Long-context sweep exit code {long_rc}{' (stopped at the time budget)' if long_to else ''}.\n"
            )
        )
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    ok, why = verdict(trials, expected, rc)
    long_errors = [r for r in long_trials if r.get("status") not in RESULT_STATUSES]
    if long_errors:
        ok, why = (
            False,
            f"{why}; error in long-context trial(s) " + ", ".join(str(r.get("trial")) for r in long_errors),
        )
    if report_rc != 0:
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


def _baseline(sweep_file: Path) -> list[str]:
    import yaml

    return [
        str(o)
        for o in ((yaml.safe_load(sweep_file.read_text()) or {}).get("sweep") or {}).get("baseline") or []
    ]


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
