"""How much of a demo trial is evaluation: ``meta.eval_s`` (initial + final eval, what the trial records) over
``meta.wall_s`` (the whole trial: build, data, evals, steps), for the demo's trial as shipped and as it ran
before issue 52 (torch's default thread count, bf16 on the CPU), side by side.

Each arm is one real trial (``vramsweep.trial.run_trial``, embedded tiny model) in a fresh process, with the
demo sweep's own settings (``sweeps/demo.yaml``: its ``train``, ``data`` and ``context`` keys and its
baseline), outside a sweep folder: each trial computes its own initial eval, as the first trial of a
sweep does (the demo's other trials read it from the sweep's store, ``meta.initial_eval.shared``, and spend
less). Arms (``--arms``):

* ``shipped``: the demo as it runs today (``train.threads=auto``, ``train.dtype=auto``).
* ``before``: ``train.threads=<usable cores>`` (torch's default) and ``train.dtype=bf16`` (the defaults the
  issue measured: eval 78-115 s of 141-213 s per trial under load).
* ``eval4``: shipped, with ``train.eval_batches=4`` (the conf default instead of the demo's 1).

``--competitor N`` runs a process doing N-thread float32 matmuls for the whole bench (one competing job);
the machine's load average is printed at the start and the end. Arm order rotates every round
(``bench/_arms.py``). Printed per arm: eval share median [min-max] over the rounds, eval and wall seconds;
the target (issue 52): eval <= 25 % of a demo trial.

Run:  python bench/eval_share.py [--rounds 3] [--arms shipped,before] [--competitor 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import yaml
from _arms import competitor, order, spread
from _child import emit, run_child

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DEMO = Path(__file__).resolve().parents[1] / "sweeps" / "demo.yaml"
#: eval / whole trial: at most this (issue 52)
TARGET = 0.25


def demo_overrides(path: Path = DEMO) -> list[str]:
    """The demo sweep's trial settings as overrides: its baseline, then its ``train``/``data``/``context``."""
    node = yaml.safe_load(path.read_text())
    over = [str(x) for x in node["sweep"]["baseline"]]
    for group in ("train", "data", "context"):
        over += [f"{group}.{k}={v}" for k, v in (node.get(group) or {}).items()]
    return over


def arm_overrides(arm: str, cores: int) -> list[str]:
    if arm == "shipped":
        return []
    if arm == "before":
        return [f"train.threads={cores}", "train.dtype=bf16"]
    if arm == "eval4":
        return ["train.eval_batches=4"]
    raise SystemExit(f"unknown arm {arm!r}: shipped, before, eval4")


def run_arm(overrides: list[str]) -> dict:
    """In a child: one demo trial; its recorded eval and wall seconds, threads and dtype."""
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    res = run_trial(compose([*demo_overrides(), "logger=none", *overrides]))
    if res["status"] != "ok":
        raise SystemExit(f"trial {res['status']}: {res.get('reason')}")
    m = res["meta"]
    return {
        "eval_s": m["eval_s"],
        "wall_s": m["wall_s"],
        "threads": m["timing_conditions"]["torch_threads"],
        "dtype": res["config"]["train"].get("dtype"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="shipped,before")
    ap.add_argument("--competitor", type=int, default=0, help="threads of a competing matmul job (0: none)")
    ap.add_argument("--child", nargs="*", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        emit(run_arm(a.child))
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    arms = a.arms.split(",")
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    with competitor(a.competitor):
        load0 = os.getloadavg()[0]
        for rnd in range(a.rounds):
            for arm in order(arms, rnd):
                argv = [sys.executable, __file__, "--child", *arm_overrides(arm, cores)]
                r, p = run_child(argv)
                if p.returncode or r is None:
                    print(f"[round {rnd}] {arm}: FAILED\n{p.stderr[-1500:]}", flush=True)
                    continue
                rows[arm].append(r)
                print(
                    f"[round {rnd}] {arm:8s} threads {r['threads']} dtype {r['dtype']}: eval {r['eval_s']:.2f} s "
                    f"of {r['wall_s']:.2f} s = {r['eval_s'] / r['wall_s']:.1%}",
                    flush=True,
                )
    load1 = os.getloadavg()[0]
    print(
        f"\ndemo trial ({' '.join(demo_overrides())}), first trial of a sweep (computes its initial eval); "
        f"{cores} usable cores; competitor: {f'{a.competitor}-thread matmuls' if a.competitor else 'none'}; "
        f"load average {load0:.2f} at the start, {load1:.2f} at the end"
    )
    for arm, rs in rows.items():
        if not rs:
            print(f"  {arm}: n/a")
            continue
        share = [r["eval_s"] / r["wall_s"] for r in rs]
        med = statistics.median(share)
        verdict = "PASS" if med <= TARGET else "FAIL"
        print(
            f"  {arm:8s}: eval share {spread(share)}; eval {spread([r['eval_s'] for r in rs])} s, wall "
            f"{spread([r['wall_s'] for r in rs])} s; target <= {TARGET:.0%}: {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
