"""Time to prepare N conversations for a trial, cold (render + tokenise + mask) and warm (the cache).

    PYTHONPATH=src python bench/data_prep.py [--n 50000]

Writes N two-exchange ``messages`` records (system prompt included) to a temp folder, then calls
:func:`vramsweep.data.prep.trial_data` twice with the embedded tokenizer and a fresh ``VRAMSWEEP_CACHE``:
the first call builds the examples (a cache miss), the second reads them back (a hit). Prints both times.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="conversations (default 50,000)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vramsweep-bench-data-"))
    os.environ["VRAMSWEEP_CACHE"] = str(work / "cache")
    from vramsweep.config import compose
    from vramsweep.data.prep import trial_data
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    path = work / "chats.jsonl"
    with path.open("w") as fh:
        for i in range(args.n):
            msgs = [
                {"role": "system", "content": "You answer questions about grant reports."},
                {
                    "role": "user",
                    "content": f"Report {i}: the project starts on {i % 28 + 1} May 2027. When?",
                },
                {"role": "assistant", "content": f"It starts on {i % 28 + 1} May 2027."},
                {"role": "user", "content": "Who coordinates it?"},
                {"role": "assistant", "content": f"Coordinator number {i}."},
            ]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    cfg = compose(["data=file", f"data.path={path}"])
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        d = trial_data(cfg, tok)
        times.append((time.perf_counter() - t0, d.stats["cache"]))
    n_tok = d.stats["train"]["total_tokens"] + d.stats["eval"]["total_tokens"]
    print(f"{args.n} conversations, {n_tok} tokens (embedded tokenizer, {os.cpu_count()} CPUs)")
    for label, (s, status) in zip(("cold", "warm"), times):
        print(f"{label}: {s:.2f} s (cache {status})")


if __name__ == "__main__":
    main()
