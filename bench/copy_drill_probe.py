"""Does the embedded model's architecture learn to copy? Copy drills alone, from scratch, no documents.

Each step is a batch of drill rows: a random segment, an optional random gap, then the segment again; the loss
is on the repeat only. Every ``--log`` steps the script prints the drill loss and the copy accuracy (argmax
hits on the repeat). At the end it scores fresh rows at each ``--eval-gaps`` gap, which tells a content-based
copy (an induction head: find the earlier occurrence of the current token, predict what followed it) from a
positional shortcut (predict the token ``L`` back, which only works with no gap and one segment length ``L``).

Examples (issue 14; CPU, one thread):
  python bench/copy_drill_probe.py --seg 32 --steps 250               # fixed length: copies, positionally
  python bench/copy_drill_probe.py --seg 8-64 --steps 900             # varied length: the real task
  python bench/copy_drill_probe.py --seg 8-64 --set model.family=llama --steps 400
  python bench/copy_drill_probe.py --seg 8-64 --rows 256 --steps 5000 --device cuda   # a GPU-sized search
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
    ap.add_argument("--rows", type=int, default=16, help="drill rows per step (default 16)")
    ap.add_argument("--seg", default="32", help="segment length, N or LO-HI drawn per step (default 32)")
    ap.add_argument("--gap", default="0", help="random tokens between segment and repeat, N or LO-HI")
    ap.add_argument("--vocab", type=int, default=0, help="draw drill tokens from the first N ids (0: all)")
    ap.add_argument("--lr", type=float, default=1e-3, help="constant AdamW learning rate (default 1e-3)")
    ap.add_argument("--qk-gain", type=float, default=1.0, help="initial q_norm/k_norm weight (Qwen3)")
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. model.family=llama")
    ap.add_argument("--eval-gaps", default="0,32", help="gaps scored at the end (default 0,32)")
    ap.add_argument("--log", type=int, default=25, help="print every N steps")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    seg_lo, seg_hi = _range(args.seg)
    gap_lo, gap_hi = _range(args.gap)
    if not (1 <= seg_lo <= seg_hi and 0 <= gap_lo <= gap_hi):
        ap.error(f"--seg {args.seg!r} / --gap {args.gap!r}: need 1 <= LO <= HI (gap: 0 <= LO <= HI)")

    import torch
    from transformers import AutoModelForCausalLM

    from vramsweep.config import compose
    from vramsweep.hfmodel import hf_config

    torch.set_num_threads(args.threads)
    cfg = compose(args.set)
    vocab = args.vocab or int(cfg.model.vocab_size)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(
        hf_config(cfg.model), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(args.device)
    if args.qk_gain != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(args.qk_gain)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    def rows(n_seg: int, n_gap: int) -> tuple[torch.Tensor, int]:
        seg = torch.randint(4, vocab, (args.rows, n_seg), generator=gen)
        gap = torch.randint(4, vocab, (args.rows, n_gap), generator=gen)
        return torch.cat([seg, gap, seg], 1), n_seg + n_gap

    def copy_acc(logits: torch.Tensor, x: torch.Tensor, start: int) -> float:
        return float((logits.detach()[:, start:-1].argmax(-1).cpu() == x[:, start + 1 :]).float().mean())

    t0 = time.time()
    model.train()
    for step in range(args.steps):
        x, start = rows(rng.randint(seg_lo, seg_hi), rng.randint(gap_lo, gap_hi))
        labels = x.clone()
        labels[:, :start] = -100
        out = model(input_ids=x.to(args.device), labels=labels.to(args.device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log == 0 or step == args.steps - 1:
            print(
                f"step {step} seg {x.shape[1] - start} loss {out.loss.item():.3f} "
                f"copy acc {copy_acc(out.logits, x, start):.3f} {time.time() - t0:.0f}s",
                flush=True,
            )
    model.eval()
    result = {"args": vars(args), "train_s": round(time.time() - t0), "copy_acc_at_gap": {}}
    with torch.no_grad():
        for g in (int(v) for v in args.eval_gaps.split(",")):
            x, start = rows(seg_hi, g)
            result["copy_acc_at_gap"][g] = round(
                copy_acc(model(input_ids=x.to(args.device)).logits, x, start), 3
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
