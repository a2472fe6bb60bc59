"""GPU smoke of ``hydra.sweeper.trials_per_gpu`` (issue 54): two tiny trials share one card under two caps.

    python scripts/gpu_share_smoke.py            # on a CUDA host (any card larger than 16 GB); ~1-2 min
    python scripts/gpu_share_smoke.py --dry-run  # on CPU: the card faked, the fake trial in its place

The sweep: ``hardware=rtx4080_16gb hardware.budget_gib=2,3 hydra.sweeper.trials_per_gpu=2
hydra.sweeper.cuda_devices=[0]`` on the embedded tiny model, through the real CLI (a child process: this
driver never touches CUDA). Checked (one line per finding, exit 1 on any failure):

* the sweep's first line says ``2 workers on GPU 0, up to 2 trials per GPU``;
* both trials ``ok``, both on GPU 0 (``CUDA_VISIBLE_DEVICES``), each marked ``meta.gpu_share.shared`` with the
  other (exact);
* the confirm stage (``sweep.confirm``) re-ran the config ``pick`` chooses alone: ``ok``, not shared;
* on a GPU only: each trial capped at its own budget (``meta.cuda.cap``: applied, ``cap_bytes`` = 2 GiB and
  3 GiB) and its peak (``metrics.peak_memory_bytes``, the allocator's reserved peak) under its cap; the two
  trials' wall-clock spans overlap (``meta.started`` / ``meta.finished``).

Writes ``<out>/share_smoke.json`` (the findings) beside the sweep folder. Not yet run on a GPU (2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
CAPS_GIB = (2, 3)
NAME = "gpu_share"


def sweep_args(out: Path, dry: bool) -> list[str]:
    """The command line of the smoke's sweep (after ``vramsweep train -m``)."""
    args = [
        f"results_dir={out}",
        f"sweep.name={NAME}",
        "hardware=rtx4080_16gb",
        "hardware.budget_gib=" + ",".join(str(c) for c in CAPS_GIB),
        "hydra.sweeper.trials_per_gpu=2",
        "hydra.sweeper.cuda_devices=[0]",
        "train.steps=8",
        "train.eval_every=0",
    ]
    if dry:  # the fake trial (tests/fakes.py) sleeps long enough for the two to overlap
        args += ["hydra.sweeper.trial_fn=fakes:fake_trial", "hydra.sweeper.preload=[fakes]"]
    return args


def run_sweep(out: Path, dry: bool, timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *([str(ROOT / "tests")] if dry else []), env.get("PYTHONPATH", "")]
    )
    if dry:
        env["VRAMSWEEP_FAKE_GPUS"] = "80"
        env["VRAMSWEEP_FAKE"] = json.dumps({"sleep_s": 12.0})
    cmd = [sys.executable, "-m", "vramsweep.sweeper", *sweep_args(out, dry)]
    print("$ vramsweep train -m " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def _time(text: object) -> float | None:
    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def check(out: Path, log: str, dry: bool) -> list[tuple[bool, str]]:
    """The findings: ``(passed, what)``."""
    found: list[tuple[bool, str]] = []
    found.append(
        ("2 workers on GPU 0, up to 2 trials per GPU" in log, "first line: 2 workers on GPU 0, 2 per GPU")
    )
    trials = sorted((out / "sweeps" / NAME / "trials").glob("[0-9]*.json"))
    res = [json.loads(p.read_text()) for p in trials]
    found.append((len(res) == 2, f"{len(res)} trial results (want 2)"))
    for r in res:
        n, meta = r.get("trial"), r.get("meta") or {}
        share = meta.get("gpu_share") or {}
        others = [x.get("trial") for x in res if x is not r]
        found.append(
            (r.get("status") == "ok", f"trial {n}: status {r.get('status')} {r.get('reason') or ''}")
        )
        found.append((share.get("device") == "0", f"trial {n}: GPU {share.get('device')}"))
        found.append(
            (
                share.get("shared") is True and share.get("exact") is True and share.get("with") == others,
                f"trial {n}: gpu_share {share}",
            ),
        )
        if dry:
            continue
        cap = (meta.get("cuda") or {}).get("cap") or {}
        budget = float(((r.get("config") or {}).get("hardware") or {}).get("budget_gib") or 0) * GIB
        peak = (r.get("metrics") or {}).get("peak_memory_bytes")
        found.append(
            (
                cap.get("applied") is True and cap.get("cap_bytes") == int(budget),
                f"trial {n}: cap {cap.get('cap_bytes')} B applied={cap.get('applied')} (budget {budget:.0f} B)",
            ),
        )
        found.append(
            (
                isinstance(peak, int | float) and 0 < peak < budget,
                f"trial {n}: peak {peak} B < cap {budget:.0f} B",
            )
        )
    confirm = [
        json.loads(p.read_text()) for p in (out / "sweeps" / NAME / "confirm" / "trials").glob("[0-9]*.json")
    ]
    found.append(
        (
            len(confirm) == 1
            and confirm[0].get("status") == "ok"
            and (confirm[0].get("meta") or {}).get("gpu_share", {}).get("shared") is False,
            f"confirm stage: {len(confirm)} config re-run alone (want 1, ok, not shared)",
        )
    )
    if not dry and len(res) == 2:
        spans = [(_time(r["meta"].get("started")), _time(r["meta"].get("finished"))) for r in res]
        ok = all(a is not None and b is not None for a, b in spans) and max(s[0] for s in spans) < min(
            s[1] for s in spans
        )
        found.append((bool(ok), f"the two trials overlap in time: {spans}"))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="on CPU: the card faked, the fake trial in its place"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="results folder (default results/gpu_share_smoke[_dry])"
    )
    ap.add_argument("--timeout-s", type=float, default=420.0)
    args = ap.parse_args(argv)
    out = (
        args.out or ROOT / "results" / ("gpu_share_smoke_dry" if args.dry_run else "gpu_share_smoke")
    ).resolve()
    if (out / "sweeps" / NAME).exists():
        print(f"error: {out / 'sweeps' / NAME} exists: give another --out", file=sys.stderr)
        return 2
    t0 = time.time()
    code, log = run_sweep(out, args.dry_run, args.timeout_s)
    print(log[-4000:])
    found = [(code == 0, f"sweep exit code {code}")] + check(out, log, args.dry_run)
    for ok, what in found:
        print(f"{'PASS' if ok else 'FAIL'} {what}")
    summary = {
        "dry_run": args.dry_run,
        "wall_s": round(time.time() - t0, 1),
        "command": "vramsweep train -m " + " ".join(sweep_args(out, args.dry_run)),
        "findings": [{"ok": ok, "what": what} for ok, what in found],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "share_smoke.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(ok for ok, _ in found) else 1


if __name__ == "__main__":
    sys.exit(main())
