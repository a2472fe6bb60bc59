"""Sweep efficiency: exhaustive grid vs our default sampler (multivariate TPE + median pruning) vs random.

Space (48 configs): ``quant`` {none, nf4} x ``adapter.r`` {4, 16, 64} x ``train.lr`` {1e-4, 3e-4, 1e-3,
3e-3} x ``checkpointing`` {off, on}; objective: minimize ``eval_loss``; constraint: ``hardware.budget_gib``
(peaks above it are infeasible). Both arms run through the real sweeper (fork-server trial processes,
SQLite study, our outcome rules).

* Grid arm: all 48 points, no pruning. Its cost is the sum of the 48 trials' seconds; its answer is
  the best feasible config.
* Search arm (our defaults, per seed): trials run in chunks of 8 (the sweep is resumed with a larger
  ``n_trials``: resume runs exactly the remainder) until a feasible trial within ``--tol`` of the grid's
  best value completes; its cost is the trial-seconds spent until then (pruned trials cost what they
  ran; repeated points cost nothing).

* Random arm (per seed): the same, with ``hydra.sweeper.sampler=random`` (same pruning, same dedup):
  the baseline that tells a good sampler from luck.

* Preflight arm (per seed): TPE with ``sweep.preflight=true`` and ``sweep.edge_start=false``: points the
  memory estimator puts over the budget are recorded ``infeasible_estimate`` when their slot comes up
  (each costs a slot, not a trial's seconds).
* Edge arm (per seed): TPE with ``sweep.preflight=true`` and ``sweep.edge_start`` (its default then): the
  study starts with the points the estimator puts just inside the budget, and the sampled points it puts
  over the budget are recorded before the first trial (no trial, no slot), their excess as TPE's
  constraint (docs/SWEEPS.md, *Edge start*). The estimator is the real one, estimating the real configs
  of these overrides (the tiny model); the fake trial's memory is its own surrogate, so the estimator
  is as wrong here as it is about any landscape it did not measure.

Landscapes (``--landscapes``, fake trials; ``tests/fakes.py`` ``LANDSCAPES``): ``rank_helps`` (a higher
rank lowers the loss: the best feasible config is the highest-memory one, where the edge start begins),
``rank_hurts`` (the best is not the highest-memory one) and ``unrelated`` (memory and quality unrelated).
Each landscape runs its own grid and every arm over ``--seeds`` seeds (default 10).

Printed: the ratio search / grid per seed and arm, per landscape the median ratio with its min-max over the
seeds, and how many configs are within ``--tol`` of the best (the more there are, the easier luck finds
one). Goals: TPE <= 0.2 and <= half of random; the edge arm <= half of random's median and below TPE's.
The pre-flight arm is the screen at slot time without the edge start's first points; the edge arm adds
the screen before the first trial and the start (the two are not yet separable settings).

Trial-seconds come from each trial's ``meta.wall_s``. Two trial functions:

* ``--trial fake`` (default; seconds): the deterministic fake landscape of
  ``tests/fakes.py`` with *simulated* seconds (steps run x modelled step time), no model. It
  is a surrogate of the real knobs' effects (memory from precision/rank/checkpointing, loss from
  learning rate/rank/precision, cost from precision/checkpointing), used so the bench runs in a minute.
* ``--trial real``: the real tiny-model trial (``vramsweep.trial``) with very few steps (``--steps``,
  default 10) on CPU and its measured wall time: ~48 x 20-60 s for the grid alone on 2 cores.

Run:  python bench/sweep_efficiency.py [--trial fake|real] [--seeds 10] [--tol 0.005] [--arms tpe,random,preflight,edge]
        [--landscapes rank_helps,rank_hurts,unrelated]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

SPACE = [
    "quant=none,nf4",
    "adapter.r=4,16,64",
    "train.lr=1e-4,3e-4,1e-3,3e-3",
    "checkpointing=off,on",
]
N_POINTS = 48
#: search arms: the sampler and sweep settings each adds to the common overrides
ARMS = {
    "tpe": ["hydra.sweeper.sampler=tpe"],
    "random": ["hydra.sweeper.sampler=random"],
    "preflight": [
        "hydra.sweeper.sampler=tpe",
        "+sweep.preflight=true",
        "+sweep.edge_screen=false",
        "+sweep.edge_start=false",
    ],
    "screen": [
        "hydra.sweeper.sampler=tpe",
        "+sweep.preflight=true",
        "+sweep.edge_screen=true",
        "+sweep.edge_start=false",
    ],
    "edge": [
        "hydra.sweeper.sampler=tpe",
        "+sweep.preflight=true",
        "+sweep.edge_screen=true",
        "+sweep.edge_start=true",
    ],
}
ARM_NAMES = {
    "tpe": "TPE",
    "random": "random",
    "preflight": "TPE+preflight",
    "screen": "TPE+edge screen",
    "edge": "TPE+screen+start",
}


def _trials(root: Path, name: str) -> list[dict]:
    d = root / "sweeps" / name / "trials"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"), key=lambda p: int(p.stem))]


def _feasible_value(r: dict) -> float | None:
    opt = (r.get("meta") or {}).get("optuna") or {}
    if opt.get("state") != "COMPLETE" or (opt.get("constraint") or 0.0) > 0:
        return None
    return float(opt["values"][0])


def _cost(r: dict) -> float:
    return float((r.get("meta") or {}).get("wall_s") or 0.0)


def _run(args: list[str]) -> None:
    """One sweeper run; its own output is kept out of the bench's (shown only on failure)."""
    import contextlib
    import io

    from vramsweep.sweeper import run_multirun

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = run_multirun(args)
    if rc != 0:
        print(buf.getvalue())
        raise SystemExit(f"sweep failed (exit {rc}): {' '.join(args)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trial", choices=["fake", "real"], default="fake")
    ap.add_argument("--seeds", type=int, default=10, help="search-arm repetitions (TPE seeds)")
    ap.add_argument(
        "--landscapes",
        default="rank_helps,rank_hurts,unrelated",
        help="fake landscapes (tests/fakes.py LANDSCAPES); real trials have one",
    )
    ap.add_argument(
        "--tol", type=float, default=0.005, help="relative tolerance: 'within noise' of the grid best"
    )
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per trial (real: keep small)")
    ap.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="default: fake 0.06 (the lowest-loss config is over it), real: none",
    )
    ap.add_argument("--chunk", type=int, default=8, help="search trials per resumed run")
    ap.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated search arms (default: {','.join(ARMS)})"
    )
    ap.add_argument(
        "--isolation",
        default=None,
        help="hydra.sweeper.isolation (default: inprocess for fake trials, whose seconds are simulated, "
        "so the bench does not start a fork server per resumed chunk; fork for real ones)",
    )
    ap.add_argument("--out", default="results/bench/sweep_efficiency.json")
    ap.add_argument("--workdir", default=None, help="keep the sweeps here (default: a temp dir)")
    args = ap.parse_args(argv)

    eval_every = max(1, args.steps // 5)
    common = [
        *SPACE,
        f"train.steps={args.steps}",
        f"train.eval_every={eval_every}",
        "train.warmup_steps=0",
        "hydra.sweeper.progress=false",
        f"hydra.sweeper.isolation={args.isolation or ('inprocess' if args.trial == 'fake' else 'fork')}",
    ]
    env_fake = {}
    if args.trial == "fake":
        budget = 0.06 if args.budget_gib is None else args.budget_gib
        common += [
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.preload=[fakes]",
        ]
        env_fake = {"step_s": 1.0}
        # the fake trial is a test double: it lives in tests/fakes.py (importable by the trial processes too)
        tests_dir = str(Path(__file__).resolve().parents[1] / "tests")
        sys.path.insert(0, tests_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    else:
        budget = 0.0 if args.budget_gib is None else args.budget_gib
        common += [
            "train.eval_batches=1",
            "train.measure_warmup_steps=1",
            "data.num_docs=4",
            "data.num_eval_docs=1",
            "context.max_tokens=128",
        ]
    if budget:
        common.append(f"hardware.budget_gib={budget}")
    shapes = args.landscapes.split(",") if args.trial == "fake" else ["real"]
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            if args.trial == "fake":
                os.environ["VRAMSWEEP_FAKE"] = json.dumps({**env_fake, "landscape": shape})
            root = Path(args.workdir or tmp).resolve() / shape
            print(f"=== landscape {shape}", flush=True)
            summary[shape] = _landscape(args, common, root, budget)
    _print_summary(summary, args)
    return 0


def _print_summary(summary: dict[str, dict], args) -> None:
    """Per landscape and arm: the median ratio to the grid with its min-max over the seeds."""
    from _arms import spread

    print(
        f"\nsummary ({args.trial} trials, {args.seeds} seeds; ratio = trial-seconds to a config within "
        f"{args.tol:.1%} of the grid's best / the grid's trial-seconds; median [min-max]):"
    )
    for shape, s in summary.items():
        print(f"  {shape} ({s['near']} configs within tolerance):")
        for arm, rs in s["rows"].items():
            ratios = [r["ratio"] for r in rs]
            print(f"    {ARM_NAMES[arm]:15s} {spread(ratios, 'seed')}")


def _landscape(args, common: list[str], root: Path, budget: float) -> dict:
    """One landscape: the grid, then every search arm over the seeds; written to ``args.out``."""
    # ---- grid arm
    _run(
        [
            *common,
            f"results_dir={root}",
            "hydra.sweeper.sampler=grid",
            "hydra.sweeper.pruner=none",
            "hydra.sweeper.study_name=grid",
        ]
    )
    grid = _trials(root, "grid")
    assert len(grid) == N_POINTS, len(grid)
    grid_cost = args.grid_cost = sum(_cost(r) for r in grid)
    feasible = [(v, r) for r in grid if (v := _feasible_value(r)) is not None]
    best_v, best_r = min(feasible, key=lambda x: x[0])
    target = best_v + abs(best_v) * args.tol
    near = sum(v <= target for v, _ in feasible)
    print(
        f"grid: {N_POINTS} trials, {grid_cost:.1f} trial-s; {len(feasible)} feasible; best eval_loss "
        f"{best_v:.4f} ({' '.join(best_r['overrides'][-4:])}); {near} config(s) within {args.tol:.1%}"
    )

    # ---- search arms: our defaults (TPE), and random search with the same pruning as the baseline
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in range(args.seeds):  # seeds outermost: a bench cut short still holds every arm's first seeds
        for arm, sampler in arms.items():
            rows[arm].append(_search_arm(root, common, arm, sampler, seed, target, args))
    _report(args, rows, near, budget, grid_cost, best_v, root.name)
    return {"rows": rows, "near": near}


def _search_arm(
    root: Path, common: list[str], arm: str, sampler: list[str], seed: int, target: float, args
) -> dict:
    """One seed of one search arm: resumed in chunks until a feasible trial within tolerance completes;
    its cost is the trial-seconds of every trial up to that one (screened and copied trials cost 0)."""
    name = f"{arm}{seed}"
    spent, found_at, n = 0.0, None, 0
    while found_at is None and n < N_POINTS:
        n = min(N_POINTS, n + args.chunk)
        _run(
            [
                *common,
                *sampler,  # command-line lists alone are a grid
                f"results_dir={root}",
                f"hydra.sweeper.seed={seed}",
                f"hydra.sweeper.n_trials={n}",
                f"hydra.sweeper.study_name={name}",
            ]
        )
        spent = 0.0
        for r in _trials(root, name):
            spent += _cost(r)
            v = _feasible_value(r)
            if v is not None and v <= target:
                found_at = r["trial"]
                break
    trials = _trials(root, name)
    before = trials[: (len(trials) if found_at is None else found_at) + 1]
    pruned = sum(r["status"] == "pruned" for r in before)
    copies = sum(bool((r.get("meta") or {}).get("duplicate_of") is not None) for r in before)
    screened = sum(bool((r.get("meta") or {}).get("screened")) for r in before)
    skipped = sum(r["status"] == "infeasible_estimate" for r in before) - screened
    ratio = spent / args.grid_cost if found_at is not None else float("inf")
    print(
        f"{arm} seed {seed}: found at trial {found_at} after {spent:.1f} trial-s ({pruned} pruned, "
        f"{copies} re-proposed points copied, {screened} screened before the first trial, "
        f"{skipped} skipped by the pre-flight) -> ratio {ratio:.3f}",
        flush=True,
    )
    return {
        "seed": seed,
        "found_at_trial": found_at,
        "trial_seconds": round(spent, 2),
        "pruned_before": pruned,
        "copies_before": copies,
        "screened_before": screened,
        "preflight_skipped_before": skipped,
        "ratio": round(ratio, 4),
    }


def _report(
    args, rows: dict[str, list[dict]], near: int, budget: float, grid_cost: float, best_v: float, shape: str
) -> None:
    med = {arm: statistics.median(r["ratio"] for r in rs) for arm, rs in rows.items()}
    # a uniformly random order without repeats reaches one of `near` good configs among N after
    # (N+1)/(near+1) trials on average: the luck baseline, in trials
    luck = (N_POINTS + 1) / (near + 1)
    print(
        f"sweep efficiency ({args.trial} trials, {near}/{N_POINTS} configs within {args.tol:.1%}; a random order "
        f"needs {luck:.1f} trials on average): median ratio to the grid's trial-seconds: "
        + ", ".join(f"{ARM_NAMES[a]} {m:.3f}" for a, m in med.items())
    )
    if "edge" in med and "random" in med and "tpe" in med:
        print(
            f"edge start: {med['edge'] / med['random']:.2f}x random's median, {med['edge'] / med['tpe']:.2f}x "
            "today's TPE's (goal: <= 0.5x random's, < 1x TPE's)"
        )
    out = Path(args.out)
    out = out.with_name(f"{out.stem}_{shape}{out.suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "trial": args.trial,
                "landscape": shape,
                "space": SPACE,
                "n_points": N_POINTS,
                "budget_gib": budget,
                "steps": args.steps,
                "tol": args.tol,
                "grid_trial_seconds": round(grid_cost, 2),
                "grid_best_eval_loss": best_v,
                "configs_within_tol": near,
                "search": rows.get("tpe"),
                "random": rows.get("random"),
                "median_ratio": med.get("tpe"),
                "median_ratio_random": med.get("random"),
                "arms": rows,
                "median_ratios": med,
            },
            indent=2,
        )
    )
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
