"""Packing vs padding: trained tokens/s, padding fraction and peak memory, side by side in one run.

A mixed-length set drawn like a chat corpus (log-normal lengths clipped to 30-2,000 tokens and to the
context, the last
~60 % of each example trained, like an assistant turn), at one context budget (``--max-tokens``, default
2,048). Both arms train the embedded tiny model through the product's own path (``micro_batches`` →
``collate_batch`` → ``loop.fit`` with the config's loss), one pass over the same examples from the same
initial weights, ``--micro-batch`` rows per micro-batch:

- ``padded``: the examples in micro-batches, each padded to its longest example (``data.packing=false``);
- ``packed``: the examples packed into rows of ``--max-tokens`` (``data.packing=true``, best-fit
  decreasing), each row padded to the full length.

The arms alternate (``--rounds`` pairs, padded first then packed, then the other way round) so machine load
hits both alike; tokens/s is trained (loss) tokens per second of the pass. Peak memory: the CPU tensor
tracker over each arm's first optimizer step (the worst micro-batch goes first in both). Quality: the
held-out loss after the pass, per arm and round (different rounds use different data-order seeds: their
spread is the seed noise).

Run:  python bench/packing.py [--examples 160] [--max-tokens 2048] [--micro-batch 2] [--rounds 2]
Goal: packed >= 1.5x padded trained tokens/s on CPU, eval loss within seed noise.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def chat_like(n: int, seed: int, vocab: int, lo: int = 30, hi: int = 2000):
    """``n`` examples with log-normal lengths (median ~250 tokens) clipped to [lo, hi]."""
    from vramsweep.data.examples import IGNORE_INDEX, Example

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = int(min(hi, max(lo, rng.lognormvariate(math.log(250), 0.9))))
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = int(length * 0.4)
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:], f"c{i}", 1, prompt))
    return out


def run_arm(cfg, examples, held_out, *, packed: bool, micro_batch: int, seed: int) -> dict:
    import torch

    from vramsweep.data.packing import pack_examples, packing_stats
    from vramsweep.data.prep import collate_batch, micro_batches
    from vramsweep.knobs import build_model, build_optimizer, build_scheduler
    from vramsweep.knobs.registry import loss_fn
    from vramsweep.loop import CpuMemoryTracking, Loop, fit
    from vramsweep.measure import TensorMemoryTracker
    from vramsweep.measure.cpu import close_tracker
    from vramsweep.measure.eval import evaluate

    if packed:  # the packed arm builds the model as data.packing=true does (segment-wise attention)
        cfg = copy.deepcopy(cfg)
        cfg.data.packing = True
    width = int(cfg.context.max_tokens)
    rows = pack_examples(examples, width, seed) if packed else list(examples)
    steps = math.ceil(len(rows) / micro_batch)
    micro = micro_batches(rows, micro_batch, 1, steps, seed)
    batches = [collate_batch(b, 0, width if packed else None) for b in micro]
    torch.manual_seed(0)
    model = build_model(cfg).model
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    sched = build_scheduler(cfg, opt)
    peak = {}

    def on_close(tracker):
        peak["bytes"] = close_tracker(tracker, opt)[0]

    tracking = CpuMemoryTracking(TensorMemoryTracker(model, opt), 1, on_close)
    model.train()
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches[:1], loss_fn=loss_fn(cfg, model),
                device=torch.device("cpu"), steps=1, params=params, max_grad_norm=1.0)  # fmt: skip
    fit(loop, [tracking])  # step 0: tracked (peak memory), not timed
    tracking.close()
    trained = sum(b["n_loss_tokens"] for b in batches[1:])
    loop.batches, loop.steps = batches[1:], steps - 1  # the rest of the pass, timed
    t0 = time.perf_counter()
    fit(loop)
    seconds = time.perf_counter() - t0
    ev = evaluate(model, [collate_batch(held_out[i : i + 4], 0) for i in range(0, len(held_out), 4)], "cpu")
    slots = sum(int(b["attention_mask"].numel()) for b in batches)
    real = sum(b["n_tokens"] for b in batches)
    out = {
        "trained_tokens_per_s": trained / seconds,
        "seconds": seconds,
        "steps": steps,
        "padding_fraction": 1 - real / slots,
        "peak_bytes": peak.get("bytes"),
        "eval_loss": ev.loss,
    }
    if packed:
        out["rows"] = packing_stats(rows, width)["rows"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config overrides (default: the tiny model, fp32 on CPU)")
    a = ap.parse_args()

    import torch

    from vramsweep.config import compose

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = compose(["train.dtype=fp32", f"context.max_tokens={a.max_tokens}", "train.lr=1e-3",
                   "train.schedule=constant", *a.overrides])  # fmt: skip
    vocab = int(cfg.model.vocab_size)
    hi = min(2000, a.max_tokens)  # an example never exceeds the context (the product truncates first)
    examples = chat_like(a.examples, 7, vocab, hi=hi)
    held_out = chat_like(16, 8, vocab, hi=hi)
    res: dict[str, list[dict]] = {"padded": [], "packed": []}
    for r in range(a.rounds):
        arms = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        for arm in arms:
            got = run_arm(cfg, examples, held_out, packed=arm == "packed", micro_batch=a.micro_batch, seed=r)
            res[arm].append(got)
            print(f"round {r} {arm:6s}: {got['trained_tokens_per_s']:8.0f} trained tok/s  {got['seconds']:6.1f} s  "
                  f"{got['steps']:3d} steps  padding {got['padding_fraction']:.1%}  "
                  f"peak {got['peak_bytes'] / 2**20:7.1f} MiB  eval_loss {got['eval_loss']:.4f}", flush=True)  # fmt: skip
    ratios = [
        p["trained_tokens_per_s"] / q["trained_tokens_per_s"]
        for p, q in zip(res["packed"], res["padded"], strict=True)
    ]
    mem = [p["peak_bytes"] / q["peak_bytes"] for p, q in zip(res["packed"], res["padded"], strict=True)]
    d_loss = [p["eval_loss"] - q["eval_loss"] for p, q in zip(res["packed"], res["padded"], strict=True)]
    noise = [res["padded"][i]["eval_loss"] - res["padded"][0]["eval_loss"] for i in range(1, a.rounds)]
    print(
        f"\n{a.examples} chat-like examples (log-normal 30-2000 tokens), context {a.max_tokens}, "
        f"micro-batch {a.micro_batch}, {a.rounds} rounds, {torch.get_num_threads()} threads, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"packed / padded trained tokens/s: median {statistics.median(ratios):.2f}x  (per round "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    pad = statistics.mean(x["padding_fraction"] for x in res["padded"])
    print(f"padding fraction: padded {pad:.1%}, packed {res['packed'][0]['padding_fraction']:.1%}")
    print(f"peak memory packed / padded (first step, tracked): {statistics.median(mem):.2f}x")
    print(f"eval loss packed - padded per round: {', '.join(f'{x:+.4f}' for x in d_loss)}; seed noise "
          f"(padded round k - round 0): {', '.join(f'{x:+.4f}' for x in noise) or 'n/a (1 round)'}")  # fmt: skip


if __name__ == "__main__":
    main()
