"""Does ``adapter.dtype=compute`` (bf16 LoRA weights) stall learning, and does ``adapter.fp32_master`` fix it?

Trains the embedded tiny model with three adapter set-ups, the seeds interleaved (seed-major, arms in
rotating order) in fresh subprocesses through the project's trial entry point (``vramsweep.trial.run_trial``):

* ``fp32``: ``adapter.dtype=fp32`` (PEFT's default: fp32 adapters, fp32 AdamW state)
* ``compute``: ``adapter.dtype=compute adapter.fp32_master=false`` (bf16 adapters, bf16 AdamW state: every
  update below half a bf16 ulp of its weight is rounded away)
* ``compute+master``: ``adapter.dtype=compute`` (the default ``fp32_master=true``: bf16 adapters for the
  forward/backward, the optimizer steps fp32 master copies)

and prints the eval loss (the trial's fixed eval set) at each checkpoint as mean ± sample std over the seeds,
and each arm's gap to ``fp32`` (paired per seed: mean ± std of the differences). Every run is repeated at
each ``--lr`` (the stall needs updates below half an ulp: lr x |m/sqrt(v)| < |w| x 2**-8).

Run:  python bench/adapter_dtype.py [--steps 240] [--every 80] [--seeds 0 1 2] [--lr 3e-3 1e-4] [-- overrides ...]
      (18 trials; 2026-12-02: 1,759 s on 2 shared CPU cores at load average 7-8, 59-115 s per trial;
      results in docs/LONG_CONTEXT.md, "Adapter dtype")
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _child import emit, run_child

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARMS = {
    "fp32": ["adapter.dtype=fp32"],
    "compute": ["adapter.dtype=compute", "adapter.fp32_master=false"],
    "compute+master": ["adapter.dtype=compute", "adapter.fp32_master=true"],
}


def one(overrides: list[str]) -> dict:
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    t0 = time.perf_counter()
    res = run_trial(compose(overrides))
    if res["status"] != "ok":
        return {"status": res["status"], "reason": res["reason"]}
    m = res["metrics"]
    curve = {0: m["initial_eval_loss"]}
    curve.update({int(e["step"]): e["eval_loss"] for e in m.get("intermediate_eval") or []})
    curve[int(res["config"]["train"]["steps"])] = m["eval_loss"]
    return {
        "status": "ok",
        "curve": curve,
        "wall_s": time.perf_counter() - t0,
        "device": res["meta"]["device"],
        "adapter": (res["meta"].get("build") or {}).get("adapter"),
        "fp32_master": (res["meta"].get("optimizer") or {}).get("fp32_master"),
    }


def _ms(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.4f} ± {sd:.4f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--every", type=int, default=80, help="optimizer steps between evals")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-4])
    ap.add_argument("--tokens", type=int, default=128, help="context.max_tokens")
    ap.add_argument("--json", help="write every run's curve here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.child:
        emit(one(args.overrides))
        return 0
    base = [
        f"train.steps={args.steps}",
        f"train.eval_every={args.every}",
        f"context.max_tokens={args.tokens}",
        "train.micro_batch=1",
        "train.threads=1",  # one OpenMP thread: on a shared 2-core machine 2 threads ran 5x slower per step
        "train.dtype=bf16",
        "logger=none",
        *args.overrides,
    ]
    names = list(ARMS)
    runs: dict[tuple[float, str], list[dict]] = {}
    t_all = time.perf_counter()
    device = None
    for lr in args.lr:
        for i, seed in enumerate(args.seeds):
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate which arm runs first
            for arm in order:
                over = [*base, f"train.lr={lr}", f"train.seed={seed}", *ARMS[arm]]
                res, out = run_child([sys.executable, __file__, "--child", *over])
                if res is None:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    return 1
                if res["status"] != "ok":
                    print(f"lr {lr:g} seed {seed} {arm}: {res['status']} {res['reason']}", file=sys.stderr)
                    return 1
                res["curve"] = {int(k): v for k, v in res["curve"].items()}
                device = res["device"]
                runs.setdefault((lr, arm), []).append(res)
                last = res["curve"][max(res["curve"])]
                print(
                    f"lr {lr:g} seed {seed} {arm:>15}: eval loss {last:.4f} ({res['wall_s']:.0f} s)",
                    flush=True,
                )
    print(f"\ndevice: {device}; {len(args.seeds)} seeds; total wall {time.perf_counter() - t_all:.0f} s")
    print(f"overrides: {' '.join(base)}")
    for lr in args.lr:
        steps = sorted(runs[(lr, names[0])][0]["curve"])
        print(f"\nlr {lr:g}: eval loss, mean ± std over seeds (gap = arm - fp32, paired per seed)")
        print("| step | " + " | ".join(names) + " | " + " | ".join(f"gap {n}" for n in names[1:]) + " |")
        print("|---:|" + "---:|" * (2 * len(names) - 1))
        for s in steps:
            cells = [_ms([r["curve"][s] for r in runs[(lr, n)]]) for n in names]
            ref = [r["curve"][s] for r in runs[(lr, "fp32")]]
            gaps = [
                _ms([r["curve"][s] - f for r, f in zip(runs[(lr, n)], ref, strict=True)]) for n in names[1:]
            ]
            print(f"| {s} | " + " | ".join(cells) + " | " + " | ".join(gaps) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f"{lr:g}/{arm}": v for (lr, arm), v in runs.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
