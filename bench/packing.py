"""Packing vs padding, at equal optimizer steps and equal tokens: trained tokens/s, padding, peak memory, loss.

Three arms train the embedded tiny model through the product's own path (``collate_batch`` -> ``loop.fit``
with the config's loss, token-weighted accumulation) from the same initial weights, and every optimizer
step of every arm holds the **same examples** (so the same trained tokens and, with token-weighted
accumulation, the same maths): the examples are packed into rows of ``--max-tokens`` (best-fit
decreasing, ``data.packing``), and step k takes the examples of rows ``k*m .. k*m+m-1`` (m =
``--micro-batch``). Per step:

- ``packed``: those m rows, one micro-batch (segment-wise attention, no cross-example attention);
- ``grouped``: the step's examples sorted by length, ``--micro-batch`` per micro-batch, each padded to its
  longest, accumulated (length-grouped padding, what peers use instead of unsorted batches);
- ``padded``: the same in a seeded random order (unsorted padding: the weakest baseline).

Data (``--data``): ``lognormal`` (chat-shaped random-token examples, log-normal lengths clipped to 30-2,000
tokens and the context, the last ~60 % trained like an assistant turn: a long tail) or ``grant_chat`` (the
shipped chat set through the chat template, ``data=grant_chat``). Arm order rotates per round
(``bench/_arms.py``); threads are pinned (``--threads``). Peak memory: the CPU tensor tracker over step 0
(not timed). Quality: the held-out loss after the pass; each round packs with its own seed (other steps), so
the spread of one arm's loss over rounds is the seed noise, and packed - padded / grouped - padded within a
round (same steps) must be far inside it (numerics only: a larger gap is a bug, e.g. attention across
examples).

Run:  python bench/packing.py [--data lognormal|grant_chat] [--examples 160] [--max-tokens 2048]
        [--micro-batch 2] [--rounds 3] [--threads 1] [overrides ...]
Goal: packed >= 1.5x padded and > grouped trained tokens/s on CPU; loss differences within seed noise.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_arms.py, as when run as a script
from _arms import order, paired_ratios, spread  # noqa: E402

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


ARMS = ("padded", "grouped", "packed")


def step_plan(examples, width: int, micro_batch: int, seed: int) -> list[list]:
    """The examples of each optimizer step: the packed rows ``k*m .. k*m+m-1``, unpacked (every arm trains
    the same examples per step)."""
    from dataclasses import replace

    from vramsweep.data.packing import pack_examples

    examples = [replace(e, doc_id=f"e{i}") for i, e in enumerate(examples)]  # unique: rows name their parts
    by_id = {e.doc_id: e for e in examples}
    rows = pack_examples(examples, width, seed)
    steps = [rows[k : k + micro_batch] for k in range(0, len(rows), micro_batch)]
    return [[by_id[d] for row in step for d in row.doc_id.split("+")] for step in steps]


def arm_micro_batches(arm: str, step: list, micro_batch: int, width: int, seed: int) -> list[list]:
    """One step's micro-batches (lists of examples; ``packed``: one micro-batch of packed rows)."""
    from vramsweep.data.packing import pack_examples

    if arm == "packed":
        return [pack_examples(step, width, seed)]
    if arm == "grouped":  # chunked from the shortest (a short last chunk holds the longest), widest first
        ex = sorted(step, key=lambda e: len(e.input_ids))
        return [ex[i : i + micro_batch] for i in range(0, len(ex), micro_batch)][::-1]
    ex = list(step)
    random.Random(seed).shuffle(ex)
    return [ex[i : i + micro_batch] for i in range(0, len(ex), micro_batch)]


def run_arm(cfg, plan, held_out, *, arm: str, micro_batch: int, seed: int, pad_id: int = 0) -> dict:
    import torch

    from vramsweep.data.prep import collate_batch
    from vramsweep.knobs import build_model, build_optimizer, build_scheduler
    from vramsweep.knobs.registry import loss_fn
    from vramsweep.loop import CpuMemoryTracking, Loop, fit
    from vramsweep.measure import TensorMemoryTracker
    from vramsweep.measure.cpu import close_tracker
    from vramsweep.measure.eval import evaluate

    width = int(cfg.context.max_tokens)
    if arm == "packed":  # the packed arm builds the model as data.packing=true does (segment-wise attention)
        cfg = copy.deepcopy(cfg)
        cfg.data.packing = True
    steps = [
        [collate_batch(m, pad_id, width if arm == "packed" else None) for m in
         arm_micro_batches(arm, step, micro_batch, width, seed + k)]
        for k, step in enumerate(plan)
    ]  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).model
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    sched = build_scheduler(cfg, opt)
    peak = {}

    def on_close(tracker):
        peak["bytes"] = close_tracker(tracker, opt)[0]

    def one_step(micro, callbacks=()):
        loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=micro, loss_fn=loss_fn(cfg, model),
                    device=torch.device("cpu"), steps=1, grad_accum=len(micro), params=params,
                    max_grad_norm=1.0)  # fmt: skip
        fit(loop, callbacks)

    tracking = CpuMemoryTracking(TensorMemoryTracker(model, opt), 1, on_close)
    model.train()
    one_step(steps[0], [tracking])  # step 0: tracked (peak memory), not timed
    tracking.close()
    t0 = time.perf_counter()
    for micro in steps[1:]:
        one_step(micro)
    seconds = time.perf_counter() - t0
    batches = [b for micro in steps for b in micro]
    trained = sum(b["n_loss_tokens"] for micro in steps[1:] for b in micro)
    ev = evaluate(
        model, [collate_batch(held_out[i : i + 4], pad_id) for i in range(0, len(held_out), 4)], "cpu"
    )
    slots = sum(int(b["attention_mask"].numel()) for b in batches)
    real = sum(b["n_tokens"] for b in batches)
    return {
        "trained_tokens_per_s": trained / seconds,
        "trained_tokens": trained,
        "seconds": seconds,
        "steps": len(steps),
        "micro_batches": len(batches),
        "padding_fraction": 1 - real / slots,
        "peak_bytes": peak.get("bytes"),
        "eval_loss": ev.loss,
    }


def _data(a, cfg):
    """(train examples, held-out examples, pad id) of ``--data``."""
    if a.data == "lognormal":
        vocab = int(cfg.model.vocab_size)
        hi = min(2000, a.max_tokens)  # an example never exceeds the context (the product truncates first)
        return chat_like(a.examples, 7, vocab, hi=hi), chat_like(16, 8, vocab, hi=hi), 0
    from vramsweep.data.prep import build_trial_data
    from vramsweep.knobs.build import model_source

    _, tok = model_source(cfg)
    data = build_trial_data(cfg, tok)
    train = [e for e in data.train if len(e.input_ids) <= a.max_tokens][: a.examples]
    return train, list(data.eval)[:16], int(data.pad_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["lognormal", "grant_chat"], default="lognormal")
    ap.add_argument("--examples", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, pinned (default 1)")
    ap.add_argument("overrides", nargs="*", help="config overrides (default: the tiny model, fp32 on CPU)")
    a = ap.parse_args()

    import torch

    from vramsweep.config import compose

    torch.set_num_threads(a.threads)
    data_ov = ["data=grant_chat"] if a.data == "grant_chat" else []
    cfg = compose(["train.dtype=fp32", f"context.max_tokens={a.max_tokens}", "train.lr=1e-3",
                   "train.schedule=constant", f"train.threads={a.threads}", *data_ov, *a.overrides])  # fmt: skip
    examples, held_out, pad_id = _data(a, cfg)
    res: dict[str, list] = {arm: [None] * a.rounds for arm in ARMS}
    for r in range(a.rounds):
        plan = step_plan(examples, a.max_tokens, a.micro_batch, seed=r)
        for arm in order(list(ARMS), r):
            got = run_arm(cfg, plan, held_out, arm=arm, micro_batch=a.micro_batch, seed=r, pad_id=pad_id)
            res[arm][r] = got
            print(f"round {r} {arm:7s}: {got['trained_tokens_per_s']:8.0f} trained tok/s  {got['seconds']:6.1f} s  "
                  f"{got['steps']:3d} steps ({got['micro_batches']} micro-batches, {got['trained_tokens']} "
                  f"trained tokens)  padding {got['padding_fraction']:.1%}  peak {got['peak_bytes'] / 2**20:7.1f} "
                  f"MiB  eval_loss {got['eval_loss']:.5f}", flush=True)  # fmt: skip
    _summary(a, res, torch.get_num_threads())


def _summary(a, res: dict, threads: int) -> None:
    def col(arm: str, key: str) -> list:
        return [x[key] if x else None for x in res[arm]]

    print(
        f"\n{a.data}: {a.examples} examples, context {a.max_tokens}, micro-batch {a.micro_batch}, {a.rounds} "
        f"rounds (arm order rotated), {threads} threads (pinned), load {os.getloadavg()[0]:.1f}; every arm "
        f"trains the same examples per optimizer step"
    )
    for arm in ("padded", "grouped"):
        print(f"packed / {arm} trained tokens/s: {spread(paired_ratios(col('packed', 'trained_tokens_per_s'), col(arm, 'trained_tokens_per_s')))}")  # fmt: skip
        print(f"peak memory packed / {arm} (step 0, tracked): {spread(paired_ratios(col('packed', 'peak_bytes'), col(arm, 'peak_bytes')))}")  # fmt: skip
    for arm in ARMS:
        pads = [x for x in col(arm, "padding_fraction") if x is not None]
        print(f"padding fraction {arm}: {statistics.mean(pads):.1%}" if pads else f"{arm}: n/a")
    base = col("padded", "eval_loss")
    noise = [abs(x - base[0]) for x in base[1:] if x is not None and base[0] is not None]
    for arm in ("packed", "grouped"):
        d = [
            abs(x - y)
            for x, y in zip(col(arm, "eval_loss"), base, strict=True)
            if x is not None and y is not None
        ]
        verdict = "n/a (1 round)" if not noise else ("PASS" if max(d, default=0) < max(noise) else "FAIL")
        print(f"|eval loss {arm} - padded| at equal steps: max {max(d, default=float('nan')):.2e}; seed noise "
              f"(|padded round k - round 0|): max {max(noise, default=float('nan')):.2e} -> within noise: {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
