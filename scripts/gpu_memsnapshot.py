"""The peak of one GPU trial, by owner: a real trial with the CUDA allocator's history recorded, the
alloc/free trace replayed to the moment of the largest live total, and the blocks alive then grouped by the
code that allocated them (the estimator's long-context terms are calibrated against this).

    python scripts/gpu_memsnapshot.py model=qwen3_8b hardware=rtx4080_16gb context.max_tokens=65536 ...

Prints ``SNAPSHOT {json}`` (the peak's live bytes, the top owners and the top block sizes) and the same as a
markdown table; ``--out FILE`` also writes the markdown there. GPU only: on a host without CUDA it exits 2.
The trace is the allocator's own (``torch.cuda.memory._record_memory_history``), so it counts what
``max_memory_allocated`` counts (not the reserve's slack).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: Frames from these paths say how, not who: an owner is the innermost frame outside them.
PLUMBING = ("/torch/nn/modules/module.py", "/torch/_tensor.py", "/torch/utils/_", "/torch/_ops.py",
            "/torch/autograd/function.py", "/torch/_library/", "/torch/_compile.py", "/torch/_dynamo/",
            "/contextlib.py", "/functools.py")  # fmt: skip
#: Events kept (an 8B trial at 64k makes ~10^5 per step); older ones are overwritten by the allocator.
MAX_ENTRIES = 2_000_000


def owner_of(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """The allocating code: the ``depth`` innermost frames outside :data:`PLUMBING`, innermost first."""
    picked = []
    for f in frames or []:
        name = str(f.get("filename", ""))
        if not name or any(p in name for p in PLUMBING) or name.startswith("??"):
            continue
        short = "/".join(name.split("/")[-2:])
        picked.append(f"{f.get('name', '?')}@{short}:{f.get('line', '?')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) or "(no python frame)"


def replay(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """Walk the allocator's events in order (``alloc`` adds a block, ``free_completed`` removes it) and
    return the largest live total reached, the event index where it was reached, and the live blocks then.

    Blocks alive before the trace began are not in it: the figures are the traced allocations only (the
    script starts the recording before the model is built, so that is all of the trial's)."""
    sizes: dict[int, int] = {}
    cur = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):  # pass 1: where the peak is
        act = ev.get("action")
        if act == "alloc":
            sizes[ev["addr"]] = int(ev["size"])
            cur += int(ev["size"])
            if cur > peak:
                peak, peak_at = cur, i
        elif act == "free_completed" and ev.get("addr") in sizes:
            cur -= sizes.pop(ev["addr"])
    live: dict[int, tuple[int, str]] = {}
    for ev in trace[: peak_at + 1]:  # pass 2: who is alive there
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = (int(ev["size"]), owner_of(ev.get("frames") or []))
        elif act == "free_completed":
            live.pop(ev.get("addr"), None)
    return {"peak_bytes": peak, "peak_event": peak_at, "events": len(trace), "blocks": live}


def summarise(rep: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """The peak's live blocks grouped by owner and by size, largest first."""
    by_owner: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_size: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for size, owner in rep["blocks"].values():
        by_owner[owner][0] += size
        by_owner[owner][1] += 1
        by_size[size][0] += size
        by_size[size][1] += 1
    owners = sorted(by_owner.items(), key=lambda kv: -kv[1][0])[:top]
    sizes = sorted(by_size.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_bytes": rep["peak_bytes"],
        "peak_event": rep["peak_event"],
        "events": rep["events"],
        "live_blocks": len(rep["blocks"]),
        "owners": [{"owner": o, "bytes": b, "count": n} for o, (b, n) in owners],
        "sizes": [{"block_bytes": s, "bytes": b, "count": n} for s, (b, n) in sizes],
    }


def render(summary: dict[str, Any], overrides: list[str]) -> str:
    gib = 2.0**30
    lines = [
        f"Peak of the traced allocations: {summary['peak_bytes'] / gib:.3f} GiB "
        f"({summary['live_blocks']} live blocks, event {summary['peak_event']} of {summary['events']})",
        f"Config: {' '.join(overrides)}",
        "",
        "| owner (innermost frames outside torch plumbing) | GiB | blocks |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{o['owner']}` | {o['bytes'] / gib:.3f} | {o['count']} |" for o in summary["owners"]]
    lines += ["", "| block bytes | GiB | blocks |", "|---:|---:|---:|"]
    lines += [f"| {s['block_bytes']:,} | {s['bytes'] / gib:.3f} | {s['count']} |" for s in summary["sizes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_memsnapshot", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the markdown summary to this file")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    if not torch.cuda.is_available():
        print("gpu_memsnapshot: no CUDA device here (the allocator's history is CUDA-only)", file=sys.stderr)
        return 2
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    cfg = compose(args.overrides)
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    result = run_trial(cfg, overrides=args.overrides)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    summary = summarise(replay(trace))
    m = result.get("metrics") or {}
    summary.update(
        status=result.get("status"),
        reason=str(result.get("reason") or "").splitlines()[:1],
        max_allocated_bytes=m.get("cuda_max_allocated_bytes"),
        peak_reserved_bytes=m.get("peak_memory_bytes"),
        estimate_bytes=(result.get("estimate") or {}).get("peak_memory_bytes"),
        tokens=int(cfg.context.max_tokens),
        trace_truncated=len(trace) >= MAX_ENTRIES,
        wall_s=round(time.perf_counter() - t0, 1),
    )
    md = render(summary, args.overrides)
    print("SNAPSHOT " + json.dumps(summary), flush=True)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
