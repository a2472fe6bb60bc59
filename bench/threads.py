"""``train.threads=auto`` against fixed thread counts, on an idle machine and beside a competing torch job.

Each arm is one short real trial (``vramsweep.trial.run_trial``, embedded tiny model) in a fresh process
with ``train.threads=<arm>``: ``auto`` and each ``--fixed`` count (default 1 and this process's usable
cores). Two conditions: ``idle`` (nothing else started by the bench) and ``busy`` (a process doing
``--competitor-threads``-thread float32 matmuls for the whole condition: another trial, any job doing
multi-threaded matmuls). Arm order rotates every round (``bench/_arms.py``). Measured per arm: the trial's
wall seconds (build, data, initial eval, steps, final eval; what a user waits for) and its tokens/s.

Printed per condition: each arm's median wall seconds [min-max], what ``auto`` chose, and ``auto`` / the
best fixed arm (the fixed count with the lowest median in that condition) as the median of the per-round
ratios with their min-max. Targets (issue 52): busy <= 1.30, idle <= 1.10; each line says PASS or FAIL.
The machine's own load (other users) is printed with each condition: a figure taken on a shared machine
says so.

Run:  python bench/threads.py [--rounds 3] [--steps 6] [--fixed 1,2] [--competitor-threads 2] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _arms import competitor, order, paired_ratios, spread
from _child import emit, run_child

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: The trial every arm runs (small: the bench compares arms, not absolute speed).
TRIAL = [
    "train.eval_batches=1",
    "data.num_docs=8",
    "data.num_eval_docs=1",
    "context.max_tokens=256",
    "logger=none",
]
#: auto / best fixed: at most this much slower beside a competing job, and idle.
TARGETS = {"busy": 1.30, "idle": 1.10}


def run_arm(threads: str, steps: int, overrides: list[str]) -> dict:
    """In a child: one trial with ``train.threads=<threads>``; its wall seconds, tokens/s, threads used."""
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    over = [*TRIAL, f"train.steps={steps}", f"train.threads={threads}", *overrides]
    t0 = time.perf_counter()
    res = run_trial(compose(over))
    wall = time.perf_counter() - t0
    if res["status"] != "ok":
        raise SystemExit(f"trial {res['status']}: {res.get('reason')}")
    used = res["meta"].get("threads") or {}
    return {
        "wall_s": wall,
        "tokens_per_s": res["metrics"].get("tokens_per_s"),
        "threads": res["meta"]["timing_conditions"]["torch_threads"],
        "why": used.get("why"),
    }


def best_fixed(walls: dict[str, list[float | None]], fixed: list[str]) -> str | None:
    """The fixed arm with the lowest median wall time (arms with no measured round left out)."""
    med = {a: statistics.median([w for w in walls[a] if w is not None]) for a in fixed if any(walls[a])}
    return min(med, key=med.get) if med else None


def verdict(ratios: list[float], target: float) -> str:
    """PASS when the median ratio is within ``target``, FAIL otherwise, n/a without rounds."""
    if not ratios:
        return "n/a"
    return "PASS" if statistics.median(ratios) <= target else "FAIL"


def _condition(name: str, arms: list[str], a: argparse.Namespace) -> dict[str, list]:
    rows: dict[str, list] = {arm: [None] * a.rounds for arm in arms}
    with competitor(a.competitor_threads if name == "busy" else None):
        load0 = os.getloadavg()[0]
        for rnd in range(a.rounds):
            for arm in order(arms, rnd):
                argv = [sys.executable, __file__, "--child", arm, "--steps", str(a.steps), *a.overrides]
                r, p = run_child(argv)
                if p.returncode or r is None:
                    print(f"[{name} round {rnd}] threads={arm}: FAILED\n{p.stderr[-1500:]}", flush=True)
                    continue
                rows[arm][rnd] = r
                tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "n/a"
                print(
                    f"[{name} round {rnd}] threads={arm:4s} used {r['threads']}  {r['wall_s']:6.1f} s  "
                    f"{tps} tokens/s",
                    flush=True,
                )
    print(f"[{name}] load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end", flush=True)
    if name == "idle" and load0 > 0.5 * max(1, len(os.sched_getaffinity(0))):
        print(f"[idle] WARNING: the machine is not idle (load {load0:.2f}): not an idle figure", flush=True)
    return rows


def _summary(name: str, rows: dict[str, list], fixed: list[str]) -> None:
    walls = {arm: [r["wall_s"] if r else None for r in rs] for arm, rs in rows.items()}
    for arm, ws in walls.items():
        got = [w for w in ws if w is not None]
        chose = sorted({r["threads"] for r in rows[arm] if r})
        if got:
            print(f"  {name:4s} threads={arm:4s}: {spread(got)} s wall; used {chose}")
    best = best_fixed(walls, fixed)
    if best is None:
        print(f"  {name}: no fixed arm measured")
        return
    ratios = paired_ratios(walls["auto"], walls[best])
    print(
        f"  {name}: auto / best fixed (threads={best}) wall time: {spread(ratios)}; target <= "
        f"{TARGETS[name]:.2f}: {verdict(ratios, TARGETS[name])}"
    )
    why = next((r["why"] for r in rows["auto"] if r and r.get("why")), None)
    if why:
        print(f"  {name}: auto's reason (first round): {why}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fixed", default=None, help="fixed counts (default: 1 and the usable cores)")
    ap.add_argument("--competitor-threads", type=int, default=2)
    ap.add_argument("--conditions", default="idle,busy")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.child:
        emit(run_arm(a.child, a.steps, a.overrides))
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fixed = a.fixed.split(",") if a.fixed else sorted({"1", str(cores)}, key=int)
    arms = ["auto", *fixed]
    results = {c: _condition(c, arms, a) for c in a.conditions.split(",")}
    print(
        f"\nconfig: {' '.join(TRIAL + a.overrides)} train.steps={a.steps}; {cores} usable cores; competitor: "
        f"{a.competitor_threads}-thread matmuls; arm order rotated per round; wall = the whole trial"
    )
    for c, rows in results.items():
        _summary(c, rows, fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
