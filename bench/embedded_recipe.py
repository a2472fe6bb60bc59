"""Candidate pre-training recipes for the embedded base: does the model copy facts from earlier sections?

Issue 14 needs a base that copies a fact's value from its first statement (high ``fact_token_acc`` with
the whole document in context, near chance with the stating sections removed). This script pre-trains one
candidate from scratch with the ``model=tiny`` dims and the project's own generator (separate seed stream,
no network), then scores the base (no fine-tuning) on the 6 default eval documents:

* ``full``: whole documents in context (``truncation=none``, ~2-3.3k tokens);
* ``nostmt``: the same documents with every fact-stating section removed (the repeats stay);
* ``head512``/``tail512``/``exp_decay512``/``head1024``: the truncation ablation's budgets.

Rows are whole documents (one per optimizer step by default, cut at ``--max-len`` tokens), so a fact's
statement and its repeat ~2k tokens later are in the same sequence. Copy drills (a random segment, then the
same segment; loss only on the repeat) come in three forms: ``--drill-steps N`` short drills first (batches
of ``--drill-batch`` rows; ``--drill-k 8,16,32,0`` draws each row from a few token ids so one token is
ambiguous and longer prefixes must match), ``--gap-steps N`` gapped drills (up to ``--gap-max`` tokens of
document text between the segment and its repeat), and ``--drill-mix W`` a drill batch added to every
document step with loss weight W. ``--recap``/``--drop``/``--cut``/``--cards`` vary the documents (fact
recaps, dropped middle sections, random starts, short fact cards). One JSON line per run is printed and
appended to ``--out``; ``--save`` keeps the model. It does not touch the cached embedded model.

Run:  python bench/embedded_recipe.py --steps 300 --drill-steps 400 --drill-k 8,16,32,0 --drill-mix 0.3
      [--threads 1] [--save DIR] [--out F]
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


def score(model, tok, docs, max_tokens: int = 4096, truncation: str = "none", device: str = "cpu") -> dict:
    import torch

    from vramsweep.data.examples import build_examples
    from vramsweep.data.prep import collate_batch
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
            device,
            meter=meter,
        )
    keep = ("fact_token_acc", "fact_nll", "control_token_acc", "control_nll", "fact_tokens")
    got = {k: v for k, v in meter.metrics().items() if k in keep}
    got["task_score"] = ev.task_score
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}


RECAPS = (
    "As stated above, {acronym} is coordinated by {prefix} {coordinator}.",
    "{acronym} is coordinated by {prefix} {coordinator} and starts on {start_date}.",
    "The project starts on {start_date} and is organised in {num_work_packages} work packages.",
    "The consortium brings together {partner_count} partners.",
    "The total budget of EUR {budget_total} is shared among the {partner_count} partners.",
    "In summary, {acronym} is coordinated by {prefix} {coordinator}, starts on {start_date} "
    "and is organised in {num_work_packages} work packages.",
    "Recall that {acronym} has a total budget of EUR {budget_total}.",
    "The coordinator, {prefix} {coordinator}, leads the {partner_count} partners of {acronym}.",
)


def card_text(i, seed):
    """A short row: each stating section cut to its fact-stating lines, 0-2 full middle sections, then the
    financial summary and conclusions (which repeat the facts)."""
    from vramsweep.data.documents import document_text
    from vramsweep.data.synthetic import STATING_SECTIONS, _document

    rng = random.Random(f"card:{seed}:{i}")
    doc = _document(random.Random(f"card-doc:{seed}:{i}"), i, seed)
    secs = doc["sections"]
    keep = []
    coord = next(f["value"] for f in doc["facts"] if f["key"] == "coordinator")
    summary = secs[0]["text"]
    keep.append(
        {"heading": secs[0]["heading"], "text": summary[: summary.index(".", summary.index(coord)) + 1]}
    )
    for s in secs[1:3]:
        keep.append({"heading": s["heading"], "text": s["text"].split("\n")[0]})
    middle = [s for s in secs[3:-2] if s["heading"] not in STATING_SECTIONS]
    keep += rng.sample(middle, rng.randint(0, min(2, len(middle))))
    for s in secs:
        if s["heading"] == "Budget":
            keep.append(
                {"heading": "Budget", "text": [ln for ln in s["text"].split("\n") if "TOTAL" in ln][0]}
            )
        if s["heading"] == "Timeline and milestones":
            keep.append({"heading": s["heading"], "text": s["text"].split(". ")[0] + "."})
    keep += secs[-2:]
    return document_text({"sections": keep})


def variant_texts(n, seed, recap, drop, cut):
    import re

    from vramsweep.data.documents import document_text
    from vramsweep.data.synthetic import STATING_SECTIONS, _document

    out = []
    for i in range(n):
        rng = random.Random(f"variant:{seed}:{i}")
        doc = _document(random.Random(f"pretrain:{seed}:{i}"), i, seed)
        vals = {f["key"]: f["value"] for f in doc["facts"]}
        vals["prefix"] = re.search(r"coordinated by (Dr|Prof\.) ", doc["sections"][0]["text"]).group(1)
        secs = []
        for j, s in enumerate(doc["sections"]):
            middle = s["heading"] not in STATING_SECTIONS and j < len(doc["sections"]) - 2
            if middle and rng.random() < drop:
                continue
            text = s["text"]
            if j > 0 and rng.random() < recap:
                text = text + "\n" + rng.choice(RECAPS).format(**vals)
            secs.append({"heading": s["heading"], "text": text})
        if rng.random() < cut:
            secs = secs[rng.randint(1, len(secs) - 2) :]
        out.append(document_text({"sections": secs}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument("--docs-per-step", type=int, default=1, help="whole documents per step (default 1)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate, cosine schedule")
    ap.add_argument("--warmup", type=int, default=15, help="warm-up steps")
    ap.add_argument("--max-len", type=int, default=3400, help="tokens kept per document row")
    ap.add_argument("--drill", type=float, default=0.0, help="fraction of steps that are copy drills")
    ap.add_argument("--drill-len", type=int, default=2048, help="longest drill row (segment + its copy)")
    ap.add_argument(
        "--recap", type=float, default=0.0, help="chance of a fact recap after each later section"
    )
    ap.add_argument("--drop", type=float, default=0.0, help="chance of dropping each middle section")
    ap.add_argument("--cut", type=float, default=0.0, help="chance a row starts at a random section")
    ap.add_argument("--step-tokens", type=int, default=0, help="pack rows per step up to this many tokens")
    ap.add_argument("--cards", type=float, default=0.0, help="fraction of rows that are short fact cards")
    ap.add_argument("--drill-steps", type=int, default=0, help="steps of short copy drills before --steps")
    ap.add_argument("--drill-lr", type=float, default=1e-3, help="constant learning rate of the drill steps")
    ap.add_argument("--drill-batch", type=int, default=16, help="rows per short-drill batch")
    ap.add_argument("--drill-seg", type=int, default=32, help="drill segment length (see --drill-seg-min)")
    ap.add_argument(
        "--drill-seg-min",
        type=int,
        default=0,
        help="random short-drill segment lengths from this up to --drill-seg (0: always --drill-seg)",
    )
    ap.add_argument(
        "--drill-mix",
        type=float,
        default=0.0,
        help="add a drill batch (gapped with "
        "--gap-mix, else short) to every document step with this loss weight",
    )
    ap.add_argument(
        "--drill-k",
        default="0",
        help="comma list: each drill row draws from k random tokens "
        "(0: the whole vocabulary); small k forces matching on longer prefixes",
    )
    ap.add_argument("--drill-text", type=float, default=0.0, help="fraction of drill rows that are doc spans")
    ap.add_argument(
        "--mix-text",
        type=float,
        default=None,
        help="--drill-text for the --drill-mix batches (default: same)",
    )
    ap.add_argument(
        "--gap-max",
        type=int,
        default=0,
        help="gapped drills: segment, up to this many tokens "
        "of document text, the segment again (teaches copying from far back)",
    )
    ap.add_argument("--gap-mix", action="store_true", help="--drill-mix batches are gapped drills")
    ap.add_argument("--gap-batch", type=int, default=2, help="rows per gapped-drill batch")
    ap.add_argument("--gap-steps", type=int, default=0, help="gapped-drill steps after the short drills")
    ap.add_argument(
        "--gap-curriculum",
        action="store_true",
        help="gapped drills: the longest gap grows from 64 to --gap-max over --gap-steps",
    )
    ap.add_argument(
        "--gap-tokens",
        type=int,
        default=0,
        help="gapped-drill steps: rows per batch fill this many tokens (0: --gap-batch rows)",
    )
    ap.add_argument("--init", default="", help="start from this saved model folder (its tokenizer too)")
    ap.add_argument("--save-drills", default="", help="also save the model after the drill phases here")
    ap.add_argument("--doc-offset", type=int, default=0, help="first pre-training document index")
    ap.add_argument(
        "--task-rows",
        type=float,
        default=0.0,
        help="chance a document step trains on task-format rows (instructions, a truncated context at a "
        "random budget and strategy, the next section) instead of the whole document",
    )
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. model.rope_theta=1e8")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--save", default="", help="save the pre-trained model and tokenizer to this folder")
    ap.add_argument("--tag", default="recipe", help="name printed with the result")
    ap.add_argument("--out", default="", help="append the JSON result line to this file")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    from vramsweep.config import compose
    from vramsweep.data.prep import EVAL_SEED_OFFSET
    from vramsweep.data.synthetic import generate_documents, pretrain_texts, without_statements
    from vramsweep.data.tokenizer import train_tokenizer
    from vramsweep.hfmodel import hf_config

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose(args.set)
    mcfg = cfg.model
    t0 = time.time()
    n_docs = args.steps * args.docs_per_step * (4 if args.step_tokens else 1)
    if args.recap or args.drop or args.cut:
        texts = variant_texts(n_docs, 7, args.recap, args.drop, args.cut)
    else:
        texts = pretrain_texts(n_docs + args.doc_offset, 7)[args.doc_offset :]
    if args.cards:
        crng = random.Random(11)
        texts = [card_text(i, 7) if crng.random() < args.cards else t for i, t in enumerate(texts)]
        n_extra = int(n_docs * 4 * args.cards)
        texts += [card_text(n_docs + i, 7) for i in range(n_extra)]
        crng.shuffle(texts)
    if args.init:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.init)
    else:
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
    if args.init:
        model = AutoModelForCausalLM.from_pretrained(
            args.init, dtype=torch.float32, attn_implementation="sdpa"
        )
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.to(args.device)

    def fwd(x, lab):
        return model(input_ids=x.to(args.device), labels=lab.to(args.device))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(7)
    vocab = len(tok)
    tokens = 0
    cursor = 0
    drill_k = [int(k) for k in args.drill_k.split(",")]

    def segment(n):
        """``n`` random tokens drawn from ``k`` random ids (``k`` from --drill-k; 0: the whole vocabulary)."""
        k = rng.choice(drill_k)
        pool = rng.sample(range(4, vocab), k) if k else None
        return [rng.choice(pool) if pool else rng.randrange(4, vocab) for _ in range(n)]

    def short_drills(text=None):
        seg = rng.randint(args.drill_seg_min, args.drill_seg) if args.drill_seg_min else args.drill_seg
        text = args.drill_text if text is None else text
        rows_ = []
        for _ in range(args.drill_batch):
            if rng.random() < text:
                r = rows[rng.randrange(len(rows))]
                a = rng.randrange(0, max(1, len(r) - seg))
                rows_.append(r[a : a + seg])
            else:
                rows_.append(segment(seg))
        s = torch.tensor(rows_)
        x = torch.cat([s, s], 1)
        lab = x.clone()
        lab[:, :seg] = -100
        return x, lab

    def gapped_drills(gap_max=None, budget=0):
        """Rows of segment, filler, segment; with ``budget``, as many rows as fit that many tokens."""
        xs, labs = [], []
        gap = rng.randint(0, args.gap_max if gap_max is None else gap_max)
        n_rows = max(1, budget // (2 * args.drill_seg + gap)) if budget else args.gap_batch
        for _ in range(n_rows):
            seg = segment(args.drill_seg)
            r = rows[rng.randrange(len(rows))]
            a = rng.randrange(0, max(1, len(r) - gap))
            fill = r[a : a + gap]
            fill = fill + [tok.eos_token_id] * (gap - len(fill))
            xs.append(seg + fill + seg)
            labs.append([-100] * (len(seg) + gap) + seg)
        return torch.tensor(xs), torch.tensor(labs)

    def task_rows(i):
        """Task-format rows of pre-training document ``i`` (vramsweep.embedded's recipe step 4)."""
        from vramsweep.data.synthetic import _document
        from vramsweep.embedded import _task_rows

        doc = _document(random.Random(f"pretrain:7:{i}"), i, 7)
        return [(x, x) for x in _task_rows(doc, tok, rng, "Write the next section of the report.")]

    def drill_step(x, lab):
        nonlocal tokens
        out = fwd(x, lab)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        n = int((lab[0] == -100).sum())  # the repeat starts here
        acc = (out.logits[:, n - 1 : -1].argmax(-1).cpu() == x[:, n:]).float().mean()
        return float(out.loss), float(acc)

    for g in opt.param_groups:
        g["lr"] = args.drill_lr
    for step in range(args.drill_steps):
        loss, acc = drill_step(*short_drills())
        if step % 25 == 0 or step == args.drill_steps - 1:
            print(f"drill {step} loss {loss:.3f} copy acc {acc:.3f} {time.time() - t0:.0f}s", flush=True)
    for step in range(args.gap_steps):
        grow = args.gap_max * (step + 1) // args.gap_steps if args.gap_curriculum else args.gap_max
        x, lab = gapped_drills(max(64, grow), args.gap_tokens)
        loss, acc = drill_step(x, lab)
        if step % 25 == 0 or step == args.gap_steps - 1:
            print(
                f"gapped {step} row {x.shape[1]} loss {loss:.3f} copy acc {acc:.3f} {time.time() - t0:.0f}s",
                flush=True,
            )
    if args.save_drills:
        model.save_pretrained(args.save_drills)
        tok.save_pretrained(args.save_drills)
    for g in opt.param_groups:
        g["lr"] = args.lr
    sched = get_scheduler(
        "cosine", optimizer=opt, num_warmup_steps=args.warmup, num_training_steps=args.steps
    )
    for step in range(args.steps):
        mix = None
        if args.drill and rng.random() < args.drill:
            half = rng.randint(64, args.drill_len // 2)
            seg = [rng.randrange(4, vocab) for _ in range(half)]
            x = torch.tensor([seg + seg])
            lab = x.clone()
            lab[0, :half] = -100
            batch = [(x, lab)]
        elif args.step_tokens:
            batch = []
            while sum(x.numel() for x, _ in batch) < args.step_tokens:
                x = torch.tensor([rows[cursor % len(rows)]])
                cursor += 1
                batch.append((x, x))
        elif args.task_rows and rng.random() < args.task_rows:
            batch = task_rows(args.doc_offset + step)
        else:
            xs = [torch.tensor([rows[step * args.docs_per_step + k]]) for k in range(args.docs_per_step)]
            batch = [(x, x) for x in xs]
        if args.drill_mix:
            mix = gapped_drills() if args.gap_mix else short_drills(args.mix_text)
        total = 0.0
        ntok = sum(x.numel() for x, _ in batch)
        for x, lab in batch:
            loss = fwd(x, lab).loss * x.numel() / ntok
            loss.backward()
            total += float(loss)
            tokens += x.numel()
        if mix is not None:
            (fwd(*mix).loss * args.drill_mix).backward()
            tokens += mix[0].numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step} loss {total:.3f} {time.time() - t0:.0f}s {tokens} tokens", flush=True)
    train_s = time.time() - t0
    model.eval()
    if args.save:
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)
    docs = generate_documents(int(cfg.data.num_eval_docs), int(cfg.data.seed) + EVAL_SEED_OFFSET)
    out = {"tag": args.tag, "args": vars(args), "train_s": round(train_s), "tokens": tokens}
    out["full"] = score(model, tok, docs, device=args.device)
    out["nostmt"] = score(model, tok, [without_statements(d) for d in docs], device=args.device)
    for trunc in ("head", "tail", "exp_decay"):
        out[f"{trunc}512"] = score(model, tok, docs, 512, trunc, device=args.device)
    out["head1024"] = score(model, tok, docs, 1024, "head", device=args.device)
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
