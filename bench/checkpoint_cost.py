"""What checkpointing costs a production run: time and peak memory, side by side in one run.

Each arm is a real ``vramsweep train`` production run (its own process, a run folder, the embedded tiny model
on CPU) of ``--steps`` optimizer steps; the arms differ only in ``train.save_every``:

- ``off``: ``train.save_every=0`` (checkpoints only on SIGTERM/SIGUSR1, the default);
- ``every K``: a checkpoint every K optimizer steps, for each K of ``--every``.

The arms alternate over ``--rounds`` rounds (the order reversed every other round) so machine load hits
them alike. Printed per arm (medians over rounds):

- ``ckpt s / wall s``: the seconds the run spent writing checkpoints (``meta.checkpoints.seconds``:
  staging + completing, fsyncs included) over the run's wall seconds (``meta.wall_s``) — the cost, measured
  inside one run, so load swings cancel;
- ``wall vs off``: the run's wall seconds over the ``off`` arm's of the same round (load-noisy);
- ``max RSS vs off``: the process's peak resident memory (``wait4``'s ``ru_maxrss``) over the ``off`` arm's;
- ``tracked peak vs off``: ``metrics.peak_memory_bytes`` (the CPU tensor tracker) over the ``off`` arm's.

Every arm runs with its torch threads pinned (``--threads``, default 1: ``train.threads`` and the thread
pools' environment), so a count torch picks from a busy machine is not a difference between arms; the wall
ratio is printed as the median of the per-round ratios with their min-max.

Run:  python bench/checkpoint_cost.py [--steps 60] [--every 10 30] [--rounds 2] [--threads 1] [overrides ...]
Goal (issue 36): checkpointing <= 5 % of run time, saving does not raise the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _arms import child_env, spread


def run_arm(out: Path, steps: int, every: int, cache: str, overrides: list[str], threads: int = 1) -> dict:
    argv = [
        sys.executable,
        "-m",
        "vramsweep.cli",
        "train",
        f"train.steps={steps}",
        "train.warmup_steps=0",
        f"train.save_every={every}",
        "train.keep_checkpoints=2",
        f"train.output_dir={out}",
        f"results_dir={out.parent}",
        f"train.threads={threads}",
        *overrides,
    ]
    env = {
        **child_env(threads),
        "VRAMSWEEP_CACHE": cache,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"checkpoint_cost: the run with save_every={every} failed:\n{err[-2000:]}")
    res = json.loads((out / "result.json").read_text())
    ck = res["meta"].get("checkpoints") or {}
    return {
        "wall_s": float(res["meta"]["wall_s"]),
        "ckpt_s": float(ck.get("seconds", 0.0)),
        "count": int(ck.get("count", 0)),
        "bytes": int(ck.get("bytes", 0)),
        "rss": usage.ru_maxrss * 1024,  # KiB on Linux
        "peak": res["metrics"].get("peak_memory_bytes"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument(
        "--every", type=int, nargs="+", default=[10, 30], help="save_every values (default: %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of all arms (default: %(default)s)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads in every arm (default: %(default)s)"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        default=["context.max_tokens=256"],
        help="more overrides for every arm (default: %(default)s)",
    )
    args = ap.parse_args()
    cache = os.environ.get("VRAMSWEEP_CACHE") or str(Path.home() / ".cache" / "vramsweep")
    arms = [0, *args.every]
    rows: dict[int, list[dict]] = {e: [] for e in arms}
    with tempfile.TemporaryDirectory(prefix="ckpt-cost-") as tmp:
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for e in order:
                got = run_arm(Path(tmp) / f"r{r}-e{e}", args.steps, e, cache, args.overrides, args.threads)
                rows[e].append(got)
                print(
                    f"round {r} save_every={e}: wall {got['wall_s']:.2f} s, checkpoints {got['count']} "
                    f"({got['ckpt_s']:.3f} s, {got['bytes'] / 2**20:.2f} MiB each), max RSS "
                    f"{got['rss'] / 2**20:.0f} MiB",
                    flush=True,
                )
    off = rows[0]
    print(
        f"\n{args.steps} optimizer steps per run, embedded tiny model, CPU, medians over {args.rounds} rounds"
    )
    print(
        f"{'arm':<14}{'ckpts':>6}{'ckpt s / wall s':>17}{'wall vs off':>13}{'max RSS vs off':>16}{'tracked peak vs off':>21}"
    )
    for e in arms:
        rs = rows[e]
        share = statistics.median(x["ckpt_s"] / x["wall_s"] for x in rs)
        wall = statistics.median(x["wall_s"] / o["wall_s"] for x, o in zip(rs, off, strict=True))
        rss = statistics.median(x["rss"] / o["rss"] for x, o in zip(rs, off, strict=True))
        peaks = [x["peak"] / o["peak"] for x, o in zip(rs, off, strict=True) if x["peak"] and o["peak"]]
        peak = f"{statistics.median(peaks):.3f}x" if peaks else "n/a"
        name = "off" if e == 0 else f"every {e}"
        print(f"{name:<14}{rs[0]['count']:>6}{share:>16.2%} {wall:>12.3f}x{rss:>15.3f}x{peak:>21}")
    for e in args.every:
        walls = [x["wall_s"] / o["wall_s"] for x, o in zip(rows[e], off, strict=True)]
        print(f"wall every {e} / off: {spread(walls)}; threads {args.threads} in every arm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
