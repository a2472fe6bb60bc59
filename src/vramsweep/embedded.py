"""The embedded default model: a tiny Qwen3-architecture LM + BPE tokenizer, built locally, no network.

Built deterministically (seeded) from the synthetic grant-report corpus: train a byte-level BPE
tokenizer on whole documents, initialise the model, pre-train it on *condensed* documents
(:func:`vramsweep.data.synthetic.copy_pretrain_texts`: fact statements and their repeats a few hundred
tokens apart, so one window holds both and the model learns to copy fact values from earlier in the
document), all from seed streams separate from the fine-tuning and eval documents. Saved to
``<cache>/embedded/<key>/`` with a ``COMPLETE`` marker written last. A file lock makes concurrent
trials/workers wait for one build instead of racing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

# Bump when the generator, tokenizer recipe or pre-training recipe changes (invalidates caches).
RECIPE_VERSION = 3
PRETRAIN_SEED = 7
PRETRAIN_LR = 5e-3
TOKENIZER_DOCS = 64  # whole documents the BPE tokenizer is trained on


def _key(mcfg: DictConfig) -> str:
    d = OmegaConf.to_container(mcfg, resolve=True)
    d = {k: d[k] for k in sorted(d) if k not in ("name", "path", "source")}
    d["recipe"] = RECIPE_VERSION
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def embedded_dir(mcfg: DictConfig) -> Path:
    from vramsweep.hfmodel import cache_root

    return cache_root() / "embedded" / f"{mcfg.name}-{_key(mcfg)}"


def ensure_embedded(mcfg: DictConfig, *, progress: bool = True) -> Path:
    """Return the cached embedded model folder, building it first if needed."""
    out = embedded_dir(mcfg)
    if (out / "COMPLETE").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out / "COMPLETE").exists():
                build_embedded(mcfg, out, progress=progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _pretrain_rows(tokenizer, texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack whole texts (+ EOS) into rows of ``seq_len`` without splitting one across rows (a copy task
    needs the statement and the repeat in one row); the rest of a row is EOS with label -100. A text
    longer than a row keeps its last ``seq_len - 1`` tokens."""
    eos = int(tokenizer.eos_token_id)
    rows: list[list[int]] = []
    row: list[int] = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"][-(seq_len - 1) :] + [eos]
        if len(row) + len(ids) > seq_len:
            rows.append(row)
            row = []
        row = row + ids
    if row:
        rows.append(row)
    x = torch.full((len(rows), seq_len), eos, dtype=torch.long)
    y = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r)
        y[i, : len(r)] = torch.tensor(r)
    return x, y


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_embedded(mcfg: DictConfig, out: Path, *, progress: bool = True) -> dict:
    """Build tokenizer + pre-trained tiny model into ``out`` (atomic: tmp dir, then rename)."""
    import shutil

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vramsweep.data.synthetic import copy_pretrain_texts, pretrain_texts
    from vramsweep.data.tokenizer import train_tokenizer
    from vramsweep.hfmodel import hf_config

    t0 = time.time()
    steps, batch, seq = int(mcfg.pretrain_steps), int(mcfg.pretrain_batch), int(mcfg.pretrain_seq_len)
    tokenizer = train_tokenizer(
        pretrain_texts(TOKENIZER_DOCS, PRETRAIN_SEED), vocab_size=int(mcfg.vocab_size), min_frequency=1
    )
    if len(tokenizer) != int(mcfg.vocab_size):
        # Like real checkpoints, the embedding may have more rows than the tokenizer has tokens; say so.
        print(f"note: the tokenizer has {len(tokenizer)} tokens, the model {mcfg.vocab_size} embedding rows")
    # Condensed documents average ~450 tokens: enough for one pass over fresh documents.
    n_docs = max(16, math.ceil(steps * batch * seq / 450))
    x_all, y_all = _pretrain_rows(tokenizer, copy_pretrain_texts(n_docs, PRETRAIN_SEED), seq)
    config = hf_config(mcfg)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(PRETRAIN_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, betas=(0.9, 0.95), weight_decay=0.01)
    from transformers import get_scheduler

    sched = get_scheduler(
        "cosine", optimizer=opt, num_warmup_steps=max(1, steps // 20), num_training_steps=steps
    )
    losses = []
    model.train()
    bar = tqdm(range(steps), desc="pre-training embedded base model (once, cached)", disable=not progress)
    for step in bar:
        idx = (torch.arange(batch) + step * batch) % x_all.shape[0]
        loss = model(input_ids=x_all[idx], labels=y_all[idx]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "recipe_version": RECIPE_VERSION,
        "params": int(sum(p.numel() for p in model.parameters())),
        "pretrain_docs": n_docs,
        "pretrain_tokens": int(steps * batch * seq),
        "pretrain_rows": int(x_all.shape[0]),
        "tokenizer_tokens": len(tokenizer),
        "loss_first": losses[0],
        "loss_last_10_mean": sum(losses[-10:]) / len(losses[-10:]),
        "weights_sha256": weights_digest(model),
        "build_s": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }
    (tmp / "vramsweep_embedded.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / "COMPLETE").write_text("ok\n")
    return info
