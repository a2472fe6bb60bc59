"""Step time vs tokens: does a step's time grow with its tokens, or is a fixed per-step cost hiding?

Runs the same config at a short and a long context (``--short``/``--long`` tokens per sequence),
alternating in fresh subprocesses (``--rounds`` times) so machine load hits both alike, and prints for
each run the step time and where the host spent it (``meta.step_phases_s``: h2d, forward, backward,
optimizer, sync_wait, loss_sync, other, and on CUDA device_s; see ``vramsweep.measure.steps``), then the median ratio
step(short) / step(long). For compute-bound steps the ratio approaches short/long (0.25 for 1,024 vs
4,096); a ratio near 1 means a fixed per-step cost dominates. On CUDA, ``host_bound: true`` (the host
barely waited for the GPU) says that cost is Python/dispatch/launch overhead, not GPU work.

Each run also prints host vs device per step (:func:`host_device_split`): the host's own seconds
(issuing work + the loop's bookkeeping) against the seconds it waited for the device (the loss read and
Liger's in-forward sync), and on CUDA the device's seconds per step and per phase from the CUDA events
the loop records around each phase (``meta.step_phases_s.device_s``; read after the step, no extra sync).

Goal on a GPU (issue: H200, Qwen3-8B nf4_dq + LoRA + checkpointing: 0.70 s at 1,024 vs 0.75 s at 4,096):
step(1,024) <= 0.35 x step(4,096).

Each run's torch threads are pinned (``--threads``, default 1; ``0``: the config's ``train.threads``), and
the ratio is printed as the median of the per-round ratios with their min-max.

Run:  python bench/step_time.py [--short 256 --long 1024] [--rounds 2] [--steps 8] [--threads 1] [overrides ...]
      python bench/step_time.py --short 1024 --long 4096 model=qwen3_8b quant=nf4_dq checkpointing=on \\
          hardware=h200_141gb train.micro_batch=1          # on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _arms import child_env, paired_ratios, spread
from _child import emit, run_child

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


#: The host's waits for the device in ``meta.step_phases_s`` (vramsweep.measure.steps)
_WAITS = ("sync_wait", "loss_sync", "backward_sync", "optimizer_sync", "h2d_sync")


def host_device_split(phases: dict | None) -> dict | None:
    """Host vs device per step from ``meta.step_phases_s``: ``host_s`` = the host's own work (issuing
    h2d/forward/backward/optimizer + the loop's ``other``), ``wait_s`` = the host waiting for the device
    (``sync_wait`` at the loss read + ``loss_sync``, the wait at Liger's in-forward ``.item()``, +
    ``backward_sync``, ``optimizer_sync``, ``h2d_sync``: Liger's backward ``torch.equal``, bitsandbytes'
    per-parameter ``torch.cuda.synchronize``),
    ``host_share`` = host_s / step; on CUDA ``device_s`` = the GPU's seconds per step from CUDA events
    (``device_s.step``, first to last event of a step) and ``device_phases`` its split by phase (None on CPU).
    A host share near 1 with device seconds well under the step = a host-bound step (Python/launch
    overhead sets the time)."""
    if not phases or not phases.get("step"):
        return None
    host = sum(float(phases.get(k) or 0.0) for k in ("h2d", "forward", "backward", "optimizer", "other"))
    step = float(phases["step"])
    device = phases.get("device_s") or None
    return {
        "host_s": host,
        "wait_s": sum(float(phases.get(k) or 0.0) for k in _WAITS),
        "step_s": step,
        "host_share": host / step,
        "device_s": float(device["step"]) if device else None,
        "device_phases": {k: v for k, v in device.items() if k != "step"} if device else None,
    }


def _split_text(split: dict | None) -> str:
    if split is None:
        return "host vs device: n/a"
    text = (
        f"host {split['host_s']:.4f} s + device wait {split['wait_s']:.4f} s of {split['step_s']:.4f} s/step "
        f"(host {split['host_share']:.0%})"
    )
    if split.get("device_s") is None:
        return text + "; device time: no CUDA events (CPU)"
    parts = ", ".join(f"{k} {v:.4f}" for k, v in split["device_phases"].items())
    return text + f"; device {split['device_s']:.4f} s/step from CUDA events ({parts})"


def one(overrides: list[str]) -> dict:
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    res = run_trial(compose(overrides))
    if res["status"] != "ok":
        return {"status": res["status"], "reason": res["reason"]}
    m = res["metrics"]
    return {
        "status": "ok",
        "step_time_s": m["step_time_s"],
        "tokens_per_s": m["tokens_per_s"],
        "phases": res["meta"].get("step_phases_s"),
        "device": res["meta"]["device"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=256)
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (0: train.threads as set)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.child:
        emit(one(args.overrides))
        return 0
    pinned = [f"train.threads={args.threads}"] if args.threads else []
    base = [f"train.steps={args.steps}", "train.eval_batches=1", "logger=none", *pinned, *args.overrides]
    runs: dict[int, list[dict]] = {args.short: [], args.long: []}
    for r in range(args.rounds):
        for n in (args.short, args.long) if r % 2 == 0 else (args.long, args.short):
            over = [*base, f"context.max_tokens={n}"]
            res, out = run_child(
                [sys.executable, __file__, "--child", *over], env=child_env(args.threads or None)
            )
            if res is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                return 1
            runs[n].append(res)
            ph = res.get("phases") or {}
            print(
                f"round {r} tokens {n:>6}: {res['status']} step {res.get('step_time_s', float('nan')):.4f} s, "
                f"{res.get('tokens_per_s', float('nan')):,.0f} tok/s; {_split_text(host_device_split(ph))}; "
                "phases "
                + ", ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in ph.items()
                    if k != "device_s"
                )
            )
    ok = [all(x["status"] == "ok" for x in runs[n]) for n in runs]
    if not all(ok):
        print("not every run finished ok: no ratio")
        return 1
    short = statistics.median(x["step_time_s"] for x in runs[args.short])
    long = statistics.median(x["step_time_s"] for x in runs[args.long])
    for n in (args.short, args.long):
        print(f"host vs device, {n} tokens: {_split_text(host_device_split(runs[n][-1].get('phases')))}")
    print(
        f"device: {runs[args.long][0]['device']}\n"
        f"median step time: {args.short} tokens {short:.4f} s, {args.long} tokens {long:.4f} s; "
        f"ratio {short / long:.3f} (compute-bound ~{args.short / args.long:.2f}; goal <= 0.35 for 1,024/4,096)"
    )
    per_round = paired_ratios(
        [x["step_time_s"] for x in runs[args.short]], [x["step_time_s"] for x in runs[args.long]]
    )
    print(f"step({args.short}) / step({args.long}), per round: {spread(per_round)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
