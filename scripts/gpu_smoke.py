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
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SWEEP = "gpu_smoke"
MAX_FILES = 8
BUNDLE = (
    "summary.md",
    "summary.csv",
    "ablation.md",
    "pareto.png",
    "memory_breakdown.png",
    "trials.jsonl",
    "sweep.json",
    "smoke.log",
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


def run_sweep(
    python: str, results_dir: Path, overrides: list[str], budget_s: float, log: Path
) -> tuple[int, bool]:
    """Run the sweep through the CLI in its own process group; Ctrl-C it when over budget.

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
    timed_out = False
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            fh.write(f"\ngpu_smoke: over the {budget_s:.0f} s budget: interrupting the sweep\n")
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
    return int(rc), timed_out


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
    peaks = [r["peak_gib"] for r in rows if r["peak_gib"] is not None]
    unit, scale = ("GiB", 1.0) if not peaks or max(peaks) >= 1.0 else ("MiB", 1024.0)  # tiny CPU runs: MiB
    lines = [
        header_line(env, trials, dry, when),
        "",
        f"`{command}` · torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) · transformers {ver('transformers')} · "
        f"peft {ver('peft')} · bitsandbytes {ver('bitsandbytes')} · liger-kernel {ver('liger_kernel')} · "
        f"flash-attn {ver('flash_attn')} · driver {env.get('driver') or '–'} · "
        f"PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'} · model {model or '?'} (random init, memory/speed only)"
        if not dry
        else f"`{command}` · torch {env.get('torch')} · transformers {ver('transformers')} · bitsandbytes "
        f"{ver('bitsandbytes')} · {env.get('device')} · model {model or '?'}",
        "",
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
    kinds = sorted({r["memory_kind"] for r in rows if r["memory_kind"]})
    lines += [
        "",
        f"Peak = {', '.join(kinds) or 'n/a'} (CUDA: max reserved in the training steps; CPU: tracked tensor bytes). "
        "Allocated/fragmentation/NVML are CUDA-only. Sweep exit code "
        f"{sweep_rc}{' (stopped at the time budget)' if timed_out else ''}; {len(rows)} trial(s).",
    ]
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
    """Write the at-most-8-file folder. Returns the files written."""
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
        help="wall-clock budget of the sweep (default 420 s; 1500 s for --dry-run on busy CPUs)",
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
        args.budget_s = 1500.0 if args.dry_run else 420.0
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

    dry = DRY_OVERRIDES + dry_design_overrides(ROOT / "sweeps" / f"{SWEEP}.yaml") if args.dry_run else []
    overrides = dry + list(args.overrides)
    if args.isolation:
        overrides.append(f"hydra.sweeper.isolation={args.isolation}")
    sweep_dir = work / "sweeps" / SWEEP
    print(f"gpu_smoke: sweep {SWEEP} -> {sweep_dir} (budget {args.budget_s:.0f} s, log {log})", flush=True)
    rc, timed_out = run_sweep(python, work, overrides, args.budget_s, log)
    trials = load_trials(sweep_dir)
    report_dir = work / "report"
    report_rc = run_report(python, sweep_dir, report_dir, log) if trials else 1
    expected = None
    try:
        expected = int(json.loads((sweep_dir / "sweep.json").read_text()).get("n_total"))
    except (OSError, ValueError, TypeError):
        pass

    command = "bash scripts/gpu_smoke.sh" + (" --dry-run" if args.dry_run else "")
    rows = summary_rows(trials)
    md = render_summary(
        rows, env, trials, dry=args.dry_run, command=command, when=when, sweep_rc=rc, timed_out=timed_out
    )
    ok, why = verdict(trials, expected, rc)
    if report_rc != 0:
        ok, why = False, f"{why}; the report failed (exit {report_rc}, see smoke.log)"
    md += f"\nVerdict: {'PASS' if ok else 'FAIL'}: {why}. Wall time {time.perf_counter() - t0:.0f} s.\n"
    with open(log, "a") as fh:
        fh.write(f"\ngpu_smoke: environment {json.dumps(env)}\n")
    files = bundle(
        out,
        summary_md=md,
        summary_csv_text=summary_csv(rows),
        trials=trials,
        sweep_dir=sweep_dir,
        report_dir=report_dir,
        log=log,
    )
    print()
    print(md)
    print(f"gpu_smoke: wrote {len(files)} file(s) to {out}: {', '.join(f.name for f in files)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
