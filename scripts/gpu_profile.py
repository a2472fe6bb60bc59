"""Where a training step's time goes: torch.profiler over a few steps of one trial config.

Launch: python scripts/gpu_profile.py --tokens 1024 [--steps 2] [--warmup 2] [--out FILE] -- <overrides>
(``scripts/gpu_smoke.sh`` runs it on the smoke baseline at 1,024 and 4,096 tokens.)

Builds the model exactly as a trial does (``build_model``/``build_optimizer``), feeds random token ids of
exactly ``--tokens`` (micro-batch 1), runs ``--warmup`` unprofiled steps, then profiles ``--steps`` steps
(forward + backward + optimizer step, synchronised). Prints, and appends to ``--out``:

* per step: wall time, GPU busy time (union of kernel/memcpy/memset intervals inside the step), the
  GPU-idle fraction (1 - busy / wall) and the number of GPU kernels launched;
* the top ops by self CPU time and by self CUDA time (``key_averages``).

On a CPU-only machine the CUDA columns are absent and the idle fraction is not computed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP = "vramsweep_step_"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_stats(trace: dict) -> list[dict]:
    """Per profiled step (a ``vramsweep_step_<i>`` annotation): wall, GPU busy, idle fraction, kernels."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    steps = sorted(
        (e for e in events if str(e.get("name", "")).startswith(STEP) and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    gpu = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events if e.get("cat") in GPU_CATS
    ]
    kernels = [float(e["ts"]) for e in events if e.get("cat") == "kernel"]
    out = []
    for s in steps:
        a, b = float(s["ts"]), float(s["ts"]) + float(s.get("dur", 0))
        clipped = [(max(x, a), min(y, b)) for x, y in gpu if y > a and x < b]
        busy = _union(clipped)
        wall = b - a
        out.append(
            {
                "step": s["name"][len(STEP) :],
                "wall_ms": wall / 1e3,
                "gpu_busy_ms": busy / 1e3 if gpu else None,
                "gpu_idle_fraction": (1 - busy / wall) if gpu and wall > 0 else None,
                "kernels": sum(1 for k in kernels if a <= k < b) if gpu else None,
            }
        )
    return out


def _table(prof, sort: str, rows: int) -> str:
    try:
        return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    except (AttributeError, KeyError, ValueError):
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_profile", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--out", help="append the report to this file")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from vramsweep.config import compose
    from vramsweep.knobs import build_model, build_optimizer

    cfg = compose([*args.overrides, f"context.max_tokens={args.tokens}", "train.micro_batch=1"])
    torch.manual_seed(int(cfg.train.seed))
    t0 = time.perf_counter()
    built = build_model(cfg)
    model, device = built.model, built.device
    params = [q for q in model.parameters() if q.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    model.train()
    build_s = time.perf_counter() - t0
    cuda = device.type == "cuda"
    ids = torch.randint(3, int(cfg.model.vocab_size), (1, args.tokens), device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step() -> float:
        a = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - a

    warm = [step() for _ in range(args.warmup)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=acts) as prof:
        for i in range(args.steps):
            with record_function(f"{STEP}{i}"):
                walls.append(step())
    with tempfile.TemporaryDirectory() as td:
        trace_path = Path(td) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        stats = step_stats(json.loads(trace_path.read_text()))
    peak = torch.cuda.max_memory_reserved(device) if cuda else None

    lines = [
        f"## torch.profiler: {cfg.model.name}, {args.tokens} tokens, "
        + " ".join(o for o in args.overrides if not o.startswith(("model=", "hardware=")))
        + f" ({device})",
        f"build {build_s:.1f} s; warm-up steps {', '.join(f'{w:.3f}' for w in warm)} s; profiled steps "
        f"{', '.join(f'{w:.3f}' for w in walls)} s (profiler overhead included)"
        + (f"; peak reserved {peak / 2**30:.2f} GiB" if peak is not None else ""),
        "",
        "| step | wall ms | GPU busy ms | GPU idle | kernels |",
        "|---|---|---|---|---|",
    ]
    for s in stats:
        busy = "–" if s["gpu_busy_ms"] is None else f"{s['gpu_busy_ms']:.1f}"
        idle = "–" if s["gpu_idle_fraction"] is None else f"{s['gpu_idle_fraction']:.1%}"
        lines.append(f"| {s['step']} | {s['wall_ms']:.1f} | {busy} | {idle} | {s['kernels'] or '–'} |")
    lines += ["", "Top ops by self CPU time:", "```", _table(prof, "self_cpu_time_total", args.rows), "```"]
    if cuda:
        table = _table(prof, "self_device_time_total", args.rows) or _table(
            prof, "self_cuda_time_total", args.rows
        )
        lines += ["", "Top ops by self CUDA time:", "```", table, "```"]
    lines.append(f"PROFILE_JSON {json.dumps({'tokens': args.tokens, 'walls_s': walls, 'steps': stats})}")
    text = "\n".join(lines) + "\n\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
