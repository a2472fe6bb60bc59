"""The embedded default model: a tiny Qwen3-architecture LM + BPE tokenizer, built locally, no network.

Built deterministically (seeded) from the synthetic grant-report corpus: train a byte-level BPE
tokenizer, initialise the model, pre-train it briefly on documents from a separate seed stream (never
the fine-tuning or eval documents), save to ``<cache>/embedded/<key>/`` with a ``COMPLETE`` marker
written last. A file lock makes concurrent trials/workers wait for one build instead of racing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

# Bump when the generator, tokenizer recipe or pre-training recipe changes (invalidates caches).
RECIPE_VERSION = 2
PRETRAIN_SEED = 7
PRETRAIN_LR = 4e-3


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


def _pretrain_blocks(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


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

    from vramsweep.data.synthetic import pretrain_texts
    from vramsweep.data.tokenizer import train_tokenizer
    from vramsweep.hfmodel import hf_config

    t0 = time.time()
    steps, batch, seq = int(mcfg.pretrain_steps), int(mcfg.pretrain_batch), int(mcfg.pretrain_seq_len)
    n_docs = max(16, math.ceil(steps * batch * seq / 2500))  # ~1 epoch of ~2.5k-token documents
    texts = pretrain_texts(n_docs, PRETRAIN_SEED)
    tokenizer = train_tokenizer(texts, vocab_size=int(mcfg.vocab_size), min_frequency=1)
    if len(tokenizer) != int(mcfg.vocab_size):
        # Like real checkpoints, the embedding may have more rows than the tokenizer has tokens; say so.
        print(f"note: the tokenizer has {len(tokenizer)} tokens, the model {mcfg.vocab_size} embedding rows")
    blocks = _pretrain_blocks(tokenizer, texts, seq)
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
    gen = torch.Generator().manual_seed(PRETRAIN_SEED)
    order = torch.randperm(blocks.shape[0], generator=gen)
    losses = []
    model.train()
    bar = tqdm(range(steps), desc="pre-training embedded base model (once, cached)", disable=not progress)
    for step in bar:
        idx = order[(torch.arange(batch) + step * batch) % blocks.shape[0]]
        x = blocks[idx]
        loss = model(input_ids=x, labels=x).loss
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
        "pretrain_blocks": int(blocks.shape[0]),
        "tokenizer_tokens": len(tokenizer),
        "loss_first": losses[0],
        "loss_last_10_mean": sum(losses[-10:]) / len(losses[-10:]),
        "weights_sha256": weights_digest(model),
        "build_s": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    (tmp / "vramsweep_embedded.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / "COMPLETE").write_text("ok\n")
    return info
