"""Candidate pre-training recipes for the embedded base: does the model copy facts from earlier sections?

Issue 14 needs a base that copies a fact's value from its first statement (high ``fact_token_acc`` with
the whole document in context, near chance with the stating sections removed). This script pre-trains one
candidate from scratch with the ``model=tiny`` dims and the project's own generator (separate seed stream,
no network), then scores the base (no fine-tuning) on the 6 default eval documents:

* ``full``: whole documents in context (``truncation=none``, ~2-3.3k tokens);
* ``nostmt``: the same documents with every fact-stating section removed (the repeats stay);
* ``head512``/``tail512``/``exp_decay512``/``head1024``: the truncation ablation's budgets.

Rows are whole documents (one per optimizer step by default, cut at ``--max-len`` tokens), so a fact's
statement and its repeat ~2k tokens later are in the same sequence; ``--drill`` mixes in random-token
copy drills (a random segment, then the same segment; loss only on the repeat). One JSON line per run is
printed and appended to ``--out``. It does not touch the cached embedded model.

Run:  python bench/embedded_recipe.py --steps 300 --lr 3e-3 [--drill 0.3] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def score(model, tok, docs, max_tokens: int = 4096, truncation: str = "none") -> dict:
    import torch

    from vramsweep.data.examples import build_examples
    from vramsweep.data_prep import collate_batch
    from vramsweep.measure.eval import evaluate
    from vramsweep.measure.quality import QualityMeter

    ex = build_examples(
        docs,
        tok,
        max_tokens=max_tokens,
        truncation=truncation,
        decay=0.5,
        min_tokens_per_section=16,
        instructions="Write the next section of the report.",
    )
    ex = [e for e in ex if e.fact_spans]  # financial summaries and conclusions
    meter = QualityMeter()
    with torch.no_grad():
        ev = evaluate(
            model,
            [collate_batch(ex[i : i + 4], tok.pad_token_id) for i in range(0, len(ex), 4)],
            "cpu",
            meter=meter,
        )
    keep = ("fact_token_acc", "fact_nll", "control_token_acc", "control_nll", "fact_tokens")
    got = {k: v for k, v in meter.metrics().items() if k in keep}
    got["task_score"] = ev.task_score
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument("--docs-per-step", type=int, default=1, help="whole documents per step (default 1)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate, cosine schedule")
    ap.add_argument("--warmup", type=int, default=15, help="warm-up steps")
    ap.add_argument("--max-len", type=int, default=3400, help="tokens kept per document row")
    ap.add_argument("--drill", type=float, default=0.0, help="fraction of steps that are copy drills")
    ap.add_argument("--drill-len", type=int, default=2048, help="longest drill row (segment + its copy)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tag", default="recipe", help="name printed with the result")
    ap.add_argument("--out", default="", help="append the JSON result line to this file")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    from vramsweep.config import compose
    from vramsweep.data.synthetic import generate_documents, pretrain_texts, without_statements
    from vramsweep.data.tokenizer import train_tokenizer
    from vramsweep.data_prep import EVAL_SEED_OFFSET
    from vramsweep.hfmodel import hf_config

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose([])
    mcfg = cfg.model
    t0 = time.time()
    texts = pretrain_texts(args.steps * args.docs_per_step, 7)
    tok = train_tokenizer(texts[:200], vocab_size=int(mcfg.vocab_size), min_frequency=1)
    rows = [
        (tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[: args.max_len] for t in texts
    ]
    config = hf_config(mcfg)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = get_scheduler(
        "cosine", optimizer=opt, num_warmup_steps=args.warmup, num_training_steps=args.steps
    )
    rng = random.Random(7)
    vocab = len(tok)
    tokens = 0
    for step in range(args.steps):
        if args.drill and rng.random() < args.drill:
            half = rng.randint(64, args.drill_len // 2)
            seg = [rng.randrange(4, vocab) for _ in range(half)]
            x = torch.tensor([seg + seg])
            lab = x.clone()
            lab[0, :half] = -100
            batch = [(x, lab)]
        else:
            xs = [torch.tensor([rows[step * args.docs_per_step + k]]) for k in range(args.docs_per_step)]
            batch = [(x, x) for x in xs]
        total = 0.0
        for x, lab in batch:
            loss = model(input_ids=x, labels=lab).loss / len(batch)
            loss.backward()
            total += float(loss)
            tokens += x.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step} loss {total:.3f} {time.time() - t0:.0f}s {tokens} tokens", flush=True)
    train_s = time.time() - t0
    model.eval()
    docs = generate_documents(int(cfg.data.num_eval_docs), int(cfg.data.seed) + EVAL_SEED_OFFSET)
    out = {"tag": args.tag, "args": vars(args), "train_s": round(train_s), "tokens": tokens}
    out["full"] = score(model, tok, docs)
    out["nostmt"] = score(model, tok, [without_statements(d) for d in docs])
    for trunc in ("head", "tail", "exp_decay"):
        out[f"{trunc}512"] = score(model, tok, docs, 512, trunc)
    out["head1024"] = score(model, tok, docs, 1024, "head")
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
