"""Engine overhead: our trial vs (a) a minimal PEFT loop and (b) a plain TRL SFTTrainer script.

TRL 1.15's SFTTrainer patches a Triton fused LM head that cannot run on CPU; there the bench substitutes
a plain-torch function with the same outputs (log-probs, entropy, top-1 accuracy from the full logits).

All three train the same config (default: embedded tiny Qwen3, bf16, LoRA r16 all-linear, sdpa,
micro-batch 2, context 512) on the same pre-built batches, each in a fresh subprocess with its torch
threads pinned (``--threads``, default 1: the same count in every arm, whatever the machine's load), the
engines' order rotated every round (``bench/_arms.py``) so a drift in load hits each alike. Printed:
tokens/s per engine per round, each ratio vs the minimal loop as the median of the per-round ratios with
their min-max, and the tracked peak memory ratio (ours vs minimal loop, same tracker, same warm-up steps).

Run:  python bench/overhead.py [--steps 20] [--rounds 4] [--threads 1] [overrides ...]
Goal: ours >= 0.95x the minimal loop's tokens/s and <= 1.02x its peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from _arms import child_env, order, paired_ratios, pin_torch, spread
from _child import emit, run_child

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _cfg(overrides):
    from vramsweep.config import compose

    return compose(list(overrides))


def run_ours(overrides, steps):
    from vramsweep.trial import run_trial

    threads = os.environ.get("OMP_NUM_THREADS")
    pinned = [f"train.threads={threads}"] if threads else []
    cfg = _cfg([*overrides, f"train.steps={steps}", "logger=none", *pinned])
    res = run_trial(cfg)
    assert res["status"] == "ok", res["reason"]
    m = res["metrics"]
    return {"tokens_per_s": m["tokens_per_s"], "peak": m["peak_memory_bytes"]}


def _prepared(overrides, steps):
    """Model, optimizer, scheduler and micro-batches built exactly as the trial builds them."""
    import random

    import torch

    from vramsweep.data.prep import build_trial_data, collate_batch, micro_batches
    from vramsweep.knobs import build_model, build_optimizer, build_scheduler
    from vramsweep.knobs.build import model_source

    cfg = _cfg([*overrides, f"train.steps={steps}"])
    random.seed(int(cfg.train.seed))
    torch.manual_seed(int(cfg.train.seed))
    _, tok = model_source(cfg)
    data = build_trial_data(cfg, tok)
    built = build_model(cfg)
    micro = micro_batches(data.train, int(cfg.train.micro_batch), 1, steps, int(cfg.train.seed))
    batches = [collate_batch(b, data.pad_id) for b in micro]
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(cfg, params)
    sched = build_scheduler(cfg, opt)
    return cfg, built.model, opt, sched, params, batches


def run_minimal(overrides, steps):
    import torch

    from vramsweep.measure import TensorMemoryTracker

    cfg, model, opt, sched, params, batches = _prepared(overrides, steps)
    model.train()
    warm = int(cfg.train.measure_warmup_steps)
    tracker = TensorMemoryTracker(model, opt)
    tokens, t0 = 0, None
    for i, b in enumerate(batches):
        if i == warm:
            tracker.close()
            t0 = time.perf_counter()
        ctx = tracker if i < warm else contextlib.nullcontext()
        with ctx:
            loss = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]
            ).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            if i < warm:
                with tracker.optimizer_phase():
                    opt.step()
            else:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if i >= warm:
            tokens += int(b["attention_mask"].sum())
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "peak": tracker.peak_bytes}


class _TorchLogProb:
    """CPU stand-in for TRL 1.15's Triton ``ChunkedLogProbFunction`` (its fused LM head needs a GPU):
    the same outputs (per-token log-probs, entropy, log-sum-sq, mean logit, is-top1) from full logits."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        import torch

        logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        logp = torch.log_softmax(logits, -1)
        tok = logp.gather(-1, targets[:, None]).squeeze(-1)
        with torch.no_grad():
            p = logp.exp()
            ent = -(p * logp).sum(-1) if "entropy" in outputs else None
            lsq = torch.logsumexp(2 * logp, -1) if "log_sum_sq_probs" in outputs else None
            mean = logits.mean(-1) if "mean_logits" in outputs else None
            top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
        return tok, ent, lsq, mean, top1


def run_trl(overrides, steps):
    import trl.trainer.utils as trl_utils
    from datasets import Dataset

    if trl_utils._ChunkedLogProbFunction is None:  # no Triton (CPU torch wheel)
        trl_utils._ChunkedLogProbFunction = _TorchLogProb
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg, model, opt, sched, params, batches = _prepared(overrides, steps)
    rows = []
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][r].sum())
            ids = b["input_ids"][r, :n].tolist()
            lab = b["labels"][r, :n].tolist()
            rows.append({"input_ids": ids, "completion_mask": [int(x != -100) for x in lab]})
    ds = Dataset.from_list(rows)
    warm = int(cfg.train.measure_warmup_steps)
    state = {"t0": None, "tokens": 0}
    mb = int(cfg.train.micro_batch)

    class Timer(TrainerCallback):
        def on_step_end(self, args, st, control, **kw):
            if st.global_step == warm:
                state["t0"] = time.perf_counter()
            elif st.global_step > warm:
                i = st.global_step - 1
                state["tokens"] += sum(len(r["input_ids"]) for r in rows[i * mb : (i + 1) * mb])

    args = SFTConfig(
        output_dir="/tmp/vramsweep-trl-bench",
        per_device_train_batch_size=mb,
        max_steps=steps,
        learning_rate=float(cfg.train.lr),
        lr_scheduler_type=str(cfg.train.schedule),
        warmup_steps=int(cfg.train.warmup_steps),
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        bf16=cfg.train.dtype == "bf16",
        use_cpu=True,
        completion_only_loss=True,
        max_length=int(cfg.context.max_tokens),
        dataloader_num_workers=0,
        gradient_checkpointing=bool(cfg.checkpointing.enabled),
        shuffle_dataset=False,
        seed=int(cfg.train.seed),
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=ds, optimizers=(opt, sched), callbacks=[Timer()]
    )
    trainer.train()
    return {"tokens_per_s": state["tokens"] / (time.perf_counter() - state["t0"]), "peak": None}


ENGINES = {"ours": run_ours, "minimal": run_minimal, "trl": run_trl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every arm (default 1)")
    ap.add_argument("--engines", default="ours,minimal,trl")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.child:
        pin_torch(a.threads)
        emit(ENGINES[a.child](a.overrides, a.steps))
        return 0
    engines = a.engines.split(",")
    res: dict[str, list[dict | None]] = {e: [None] * a.rounds for e in engines}
    for rnd in range(a.rounds):
        for e in order(engines, rnd):
            argv = [
                sys.executable,
                __file__,
                "--child",
                e,
                "--steps",
                str(a.steps),
                "--threads",
                str(a.threads),
            ]
            r, p = run_child([*argv, *a.overrides], env=child_env(a.threads))
            if p.returncode or r is None:
                print(f"[round {rnd}] {e}: FAILED\n{p.stderr[-2000:]}")
                continue
            res[e][rnd] = r
            print(
                f"[round {rnd}] {e:8s} {r['tokens_per_s']:8.1f} tokens/s  peak {r['peak'] / 2**20 if r['peak'] else float('nan'):7.1f} MiB",
                flush=True,
            )
    print(
        f"\nconfig: defaults {' '.join(a.overrides)}; steps {a.steps}; device cpu, torch threads {a.threads} "
        f"in every arm (pinned), arm order rotated per round; load average {os.getloadavg()[0]:.2f} at the end"
    )
    if "minimal" in res:

        def col(e: str, key: str) -> list:
            return [r[key] if r else None for r in res[e]]

        for e in engines:
            if e == "minimal":
                continue
            line = f"{e}/minimal tokens/s: {spread(paired_ratios(col(e, 'tokens_per_s'), col('minimal', 'tokens_per_s')))}"
            if any(r and r["peak"] for r in res[e]):
                line += f"   peak memory: {spread(paired_ratios(col(e, 'peak'), col('minimal', 'peak')))}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
