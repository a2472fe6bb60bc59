"""One memory-probe point of the GPU smoke: a real trial at one context length, in this fresh interpreter,
and what its memory did (the smoke's "memprobe" phases call it once per length, stopping at the first OOM).

    python scripts/gpu_memprobe.py context.max_tokens=65536 model=qwen3_8b hardware=rtx4080_16gb ...

Prints ``PROBE {json}``: the trial's status, the training steps' reserved and allocated peaks, the CUDA
allocator's ``num_alloc_retries`` (the process's own count: this interpreter ran nothing else), the
offload pool's host bytes (``meta.host_memory.pool_bytes``), the estimator's peak for the same config, the
trial's wall time and tokens/s, and the first line of its reason.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def probe_row(result: dict, tokens: int | None, alloc_stats: dict | None, wall_s: float) -> dict:
    """The probe's record of one trial result (``alloc_stats``: ``torch.cuda.memory_stats()`` or None)."""
    m = result.get("metrics") or {}
    meta = result.get("meta") or {}
    est = result.get("estimate") or {}
    reason = str(result.get("reason") or "").splitlines()
    return {
        "tokens": tokens,
        "status": result.get("status"),
        "peak_reserved_bytes": m.get("peak_memory_bytes"),
        "memory_kind": m.get("memory_kind"),
        "peak_allocated_bytes": m.get("cuda_max_allocated_bytes"),
        "num_alloc_retries": None if alloc_stats is None else alloc_stats.get("num_alloc_retries"),
        "pool_bytes": (meta.get("host_memory") or {}).get("pool_bytes"),
        "estimate_bytes": est.get("peak_memory_bytes"),
        "estimate_required_bytes": est.get("required_bytes"),  # what must fit under the cap (the OOM line)
        # what the build installed (offload, mlp_tiles, attention_heads, ...): the stack that really ran
        "knobs": sorted((meta.get("build") or {}).get("knobs") or {}),
        "tokens_per_s": m.get("tokens_per_s"),
        "wall_s": round(wall_s, 2),
        "reason": reason[0][:200] if reason else "",
    }


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    import torch

    from vramsweep.config import ConfigError, compose
    from vramsweep.trial import run_trial

    try:
        cfg = compose(overrides)
    except ConfigError as exc:  # a config this machine cannot run is a result (unsupported), not a crash
        row = probe_row({"status": "unsupported", "reason": str(exc)}, None, None, time.perf_counter() - t0)
        print("PROBE " + json.dumps(row), flush=True)
        return 0
    result = run_trial(cfg, overrides=overrides)
    stats = dict(torch.cuda.memory_stats()) if torch.cuda.is_available() else None
    tokens = int(cfg.context.max_tokens)
    print("PROBE " + json.dumps(probe_row(result, tokens, stats, time.perf_counter() - t0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
