"""The training loop's own host work per step, before vs after a change, interleaved in one process.

Loads :mod:`vramsweep.loop` twice: as committed at ``--before`` (a git revision) and as in the working
tree, and runs them in alternating rounds (``--rounds``, ``--steps`` each) on the same model, so
machine load hits both alike (CPU timings swing many-fold with load: compare only within one run).
Per round it records, with each version's own :class:`StepClock` running from the round's first step:

- ``loop_s``: the loop's own host seconds per step = ``h2d + sync_wait + other`` (callbacks,
  bookkeeping, the loss read), i.e. the step minus the model's forward, backward and the optimizer;
- ``step_s``: the whole step;
- ``reads``: host reads of tensor values per step by where they happen (``.item()``/``float()``/
  ``bool()``), counted with a dispatch mode in a separate, untimed round. On CUDA a read of a device
  tensor is a sync; the optimizer's (CPU step counters) and the new loop's (``take``: the pinned host
  copy of the previous step's loss) are not.

Models: ``null`` (a 1x1 linear: the step is nearly all loop) and ``tiny`` (the embedded tiny model
with LoRA at ``--tokens`` tokens per sequence, fp32, one thread: host/dispatch-bound like a GPU step).

Run:  python bench/loop_host.py [--before HEAD~1] [--rounds 6] [--steps 40] [--model null,tiny]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]


def load_loop(rev: str | None):
    """vramsweep.loop at git revision ``rev`` (None: the working tree) as a separate module."""
    if rev is None:
        import vramsweep.loop as mod

        return mod
    src = subprocess.run(
        ["git", "show", f"{rev}:src/vramsweep/loop.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "loop_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("loop_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["loop_before"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def callbacks(mod, steps: int) -> list:
    """A trial's per-step callbacks in ``mod``'s API: timing, a per-step loss consumer, periodic eval
    (off: every step checks and returns), as trial._train_steps installs them."""
    from vramsweep.measure.steps import StepClock

    losses: list[float] = []
    timing = mod.Timing(StepClock(), timed_from=10**9)  # the window itself is this bench's clock
    if hasattr(mod, "OnLoss"):
        per_step = mod.OnLoss(lambda s, v: losses.append(v))
    else:
        per_step = mod.OnStepEnd(lambda s, v: losses.append(v))
    return [timing, per_step, mod.Every(0, steps, lambda s: None)]


def make(model_name: str, tokens: int, steps: int):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "null":
        model = torch.nn.Linear(1, 1)
        vocab = 8

        def loss_fn(ids, mask, labels):
            return model(ids[:, :1].float()).mean()
    else:
        from vramsweep.config import compose
        from vramsweep.knobs import build_model
        from vramsweep.knobs.registry import loss_fn as knob_loss

        cfg = compose(["train.dtype=fp32", "logger=none"])
        model = build_model(cfg).model
        model.train()
        vocab = int(model.config.vocab_size)
        loss_fn = knob_loss(cfg, model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (1, tokens), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                        "no_padding": True, "n_tokens": tokens, "n_targets": tokens - 1,
                        "n_loss_tokens": tokens - 1})  # fmt: skip
    return model, loss_fn, params, opt, sched, batches


def round_once(mod, parts, steps: int, count_reads: bool = False) -> dict:
    import torch

    from vramsweep.measure.steps import StepClock

    model, loss_fn, params, opt, sched, batches = parts
    clock = StepClock()
    loop = mod.Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn,
                    device=torch.device("cpu"), steps=steps, grad_accum=1, max_grad_norm=1.0, clock=clock,
                    params=params)  # fmt: skip
    cbs = callbacks(mod, steps)
    if count_reads:
        import collections
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        by: collections.Counter = collections.Counter()
        read = torch.ops.aten._local_scalar_dense.default

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is read:  # label: the innermost frame outside torch's internals (optim and nn kept)
                    for fr in reversed(traceback.extract_stack()[:-1]):
                        f = fr.filename
                        if "/torch/" not in f or "/torch/optim/" in f or "/torch/nn/" in f:
                            by[f"{Path(fr.filename).name}:{fr.name}"] += 1
                            break
                return func(*args, **(kwargs or {}))

        with Reads():
            mod.fit(loop, cbs)
        return {"reads": {k: v / steps for k, v in by.most_common()}}
    clock.start()
    mod.fit(loop, cbs)
    ph = clock.per_step(steps)
    return {"loop_s": ph["h2d"] + ph["sync_wait"] + ph["other"], "step_s": ph["step"], **ph}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD~1", help="git revision of the 'before' loop.py")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", default="null,tiny")
    args = ap.parse_args(argv)
    versions = {"before": load_loop(args.before), "after": load_loop(None)}
    for name in args.model.split(","):
        parts = make(name, args.tokens, args.steps)
        for v, mod in versions.items():  # warm-up (allocator, lazy init) + host reads, untimed
            round_once(mod, parts, args.steps)
            reads = round_once(mod, parts, 4, count_reads=True)["reads"]
            print(f"{name:>5} {v:>6}: host reads per step by origin: {reads}")
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for v in order:
                runs[v].append(round_once(versions[v], parts, args.steps))
        for v in ("before", "after"):
            lo = statistics.median(x["loop_s"] for x in runs[v]) * 1e6
            st = statistics.median(x["step_s"] for x in runs[v]) * 1e6
            print(f"{name:>5} {v:>6}: loop's own host time {lo:8.1f} us/step of {st:10.1f} us/step "
                  f"(median of {args.rounds} interleaved rounds x {args.steps} steps)")  # fmt: skip
        pairs = [b["loop_s"] - a["loop_s"] for b, a in zip(runs["before"], runs["after"], strict=True)]
        print(
            f"{name:>5} paired before-after loop host time: median {statistics.median(pairs) * 1e6:+.1f} us/step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
