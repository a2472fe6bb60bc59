"""Random weights for an architecture-only model, written once to a cached Hugging Face folder.

``kernels=unsloth`` loads through ``FastLanguageModel.from_pretrained(<folder>)``, so it needs weights on
disk, and ``model=qwen3_8b`` (``source=arch``) has none. :func:`ensure_arch_weights` writes them:

* ``config.json`` (the architecture of ``cfg.model``, ``dtype=train.dtype``), sharded ``*.safetensors``
  with ``model.safetensors.index.json``, and a small byte-level BPE tokenizer trained offline on the
  project's synthetic documents (:func:`vramsweep.data.tokenizer.train_tokenizer`; fewer tokens than
  embedding rows, like real checkpoints). Trials on ``source=arch`` feed random token ids over the full
  vocabulary, so the tokenizer is only there because loaders insist on one.
* Written shard by shard, one shard per decoder layer (plus one for the embedding and one for the final
  norm + ``lm_head``), so host memory peaks at the largest shard: for Qwen3-8B in bf16 the 1.24 GB
  embedding (a decoder layer is 0.39 GB), never the 16.4 GB model.
* Deterministic: every tensor comes from its own generator seeded by ``sha256(seed, tensor name)``
  (N(0, ``initializer_range``) for matrices, ones for norms, zeros for biases), so the same architecture,
  seed and dtype give byte-identical files whatever the write order.
* Cached under ``$VRAMSWEEP_CACHE/arch_weights/<model name>-<key>/``, the key a hash of the architecture
  (``cfg.model`` without its name), seed (``train.seed``), dtype (``train.dtype``) and
  :data:`RECIPE_VERSION`. A file lock makes concurrent trials wait for one writer; the folder is written
  as ``<key>.tmp``, renamed, and ``COMPLETE`` is written last: a folder without it is never used (it is
  deleted and rewritten). A progress line goes to stderr every few seconds while writing.

Cost (docs/GPU.md, "Unsloth on architecture-only models"): bytes = parameters x dtype size (Qwen3-8B bf16:
8,190,735,360 parameters, 16,381,470,720 bytes, 38 shards); the time is measured and recorded in the folder's
``vramsweep_arch_weights.json`` and in each trial's ``meta.build.arch_weights``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from vramsweep.config import compose
from vramsweep.config.rules import UnsupportedError, check_arch_vocab
from vramsweep.data.synthetic import pretrain_texts
from vramsweep.hfmodel import cache_root, hf_config
from vramsweep.knobs.common import torch_dtype

#: Bump when the initialisation, file layout or tokenizer recipe changes (invalidates cached folders).
RECIPE_VERSION = 1
#: The tokenizer's target vocabulary (capped by the model's ``vocab_size``) and its training documents.
TOKENIZER_VOCAB = 1024
TOKENIZER_DOCS = 8
TOKENIZER_SEED = 11
INFO_FILE = "vramsweep_arch_weights.json"
MARKER = "COMPLETE"
#: Seconds between progress lines while writing.
PROGRESS_EVERY_S = 5.0
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def arch_key(cfg: DictConfig) -> str:
    """Hash of what the weights depend on: architecture, seed, dtype and the recipe."""
    m = OmegaConf.to_container(cfg.model, resolve=True)
    d: dict[str, Any] = {k: m[k] for k in sorted(m) if k not in ("name", "path", "source")}
    d.update(seed=int(cfg.train.seed), dtype=str(cfg.train.dtype), recipe=RECIPE_VERSION)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def arch_weights_dir(cfg: DictConfig) -> Path:
    return cache_root() / "arch_weights" / f"{cfg.model.name}-{arch_key(cfg)}"


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _skeleton(cfg: DictConfig, tokenizer: Any) -> torch.nn.Module:
    """The model on the meta device (no storage), its config carrying the tokenizer's special ids."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg.model)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype(cfg.train.dtype))


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What ``save_pretrained`` would save: parameters (tied ones once) and persistent buffers."""
    persistent = set(model.state_dict().keys())
    out = list(model.named_parameters())  # remove_duplicate=True: a tied lm_head is listed once
    out += [(n, b) for n, b in model.named_buffers() if n in persistent]
    return out


def _groups(tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs by decoder layer: [embedding], [layer 0], ..., [layer N-1], [final norm, lm_head]."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    last: object = object()
    for name, t in tensors:
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        if layer != last or not groups:
            groups.append([])
            last = layer
        groups[-1].append((name, t))
    return groups


def _init(name: str, meta: torch.Tensor, seed: int, std: float) -> torch.Tensor:
    """The tensor's deterministic random value on the CPU (only this one tensor is allocated)."""
    t = torch.empty(tuple(meta.shape), dtype=meta.dtype)
    if t.dim() >= 2:
        t.normal_(mean=0.0, std=std, generator=torch.Generator().manual_seed(_tensor_seed(seed, name)))
    elif "norm" in name:
        t.fill_(1.0)
    else:
        t.zero_()
    return t


def plan_bytes(cfg: DictConfig) -> dict[str, int]:
    """Parameters, bytes and shards of the folder ``cfg`` would write (no tokenizer training, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch_dtype(cfg.train.dtype))
    tensors = _tensors(model)
    groups = _groups(tensors)
    return {
        "params": int(sum(t.numel() for _, t in tensors)),
        "bytes": int(sum(t.numel() * t.element_size() for _, t in tensors)),
        "shards": len(groups),
        "largest_shard_bytes": int(max(sum(t.numel() * t.element_size() for _, t in g) for g in groups)),
    }


def _progress(msg: str) -> None:
    print(f"vramsweep: {msg}", file=sys.stderr, flush=True)


def write_arch_weights(
    cfg: DictConfig, out: Path, *, progress: bool = True, workers: int = 1
) -> dict[str, Any]:
    """Write the folder for ``cfg`` into ``out`` (which must not exist). Returns the info dict.

    ``workers`` shards are generated and written at once (threads: ``normal_`` and the file write release
    the GIL); host memory peaks at ``workers`` x the largest shard.
    """
    import safetensors.torch
    import tokenizers
    import transformers

    from vramsweep.data.tokenizer import train_tokenizer

    t0 = time.perf_counter()
    seed = int(cfg.train.seed)
    vocab = min(TOKENIZER_VOCAB, int(cfg.model.vocab_size))
    check_arch_vocab(cfg)
    tokenizer = train_tokenizer(
        pretrain_texts(TOKENIZER_DOCS, TOKENIZER_SEED), vocab_size=vocab, min_frequency=1
    )
    model = _skeleton(cfg, tokenizer)
    std = float(getattr(model.config, "initializer_range", 0.02))
    tensors = _tensors(model)
    groups = _groups(tensors)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    n = len(groups)
    out.mkdir(parents=True)
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if progress:
        _progress(
            f"writing random {cfg.model.name} weights once ({total / 1e9:.2f} GB in {n} shards, "
            f"{cfg.train.dtype}, seed {seed}) -> {out}"
        )
    weight_map = {
        name: f"model-{i:05d}-of-{n:05d}.safetensors" for i, g in enumerate(groups, 1) for name, _ in g
    }
    largest = _write_shards(groups, out, seed, std, total, t0, progress=progress, workers=workers)
    index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_s = time.perf_counter() - t0
    info = {
        "recipe_version": RECIPE_VERSION,
        "key": out.name.rsplit("-", 1)[-1],
        "model": str(cfg.model.name),
        "family": str(cfg.model.family),
        "seed": seed,
        "dtype": str(cfg.train.dtype),
        "init": f"N(0, {std}) matrices, ones for norms, zeros for biases; per-tensor seed sha256(seed:name)",
        "params": int(sum(t.numel() for _, t in tensors)),
        "weight_bytes": int(total),
        "shards": n,
        "largest_shard_bytes": int(largest),
        "tokenizer_tokens": len(tokenizer),
        "write_s": round(write_s, 3),
        "write_mb_per_s": round(total / max(write_s, 1e-9) / 1e6, 1),
        "workers": int(workers),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": getattr(safetensors, "__version__", "?"),
        "tokenizers": tokenizers.__version__,
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_shards(
    groups: list, out: Path, seed: int, std: float, total: int, t0: float, *, progress: bool, workers: int
) -> int:
    """Generate and write each shard ``i`` of ``groups`` as ``model-<i>-of-<n>.safetensors`` in ``out``,
    ``workers`` at once (threads), reporting progress (with ``progress``, more than one shard) at most every
    ``PROGRESS_EVERY_S`` and at the end; returns the largest shard's bytes."""
    import safetensors.torch

    n = len(groups)
    state = {"written": 0, "done": 0, "largest": 0, "last_print": time.perf_counter()}
    lock = threading.Lock()

    def write_shard(i: int) -> None:
        group = groups[i - 1]
        shard = {name: _init(name, meta, seed, std) for name, meta in group}
        size = sum(t.numel() * t.element_size() for t in shard.values())
        safetensors.torch.save_file(
            shard, str(out / f"model-{i:05d}-of-{n:05d}.safetensors"), metadata={"format": "pt"}
        )
        del shard
        with lock:
            state["written"] += size
            state["done"] += 1
            state["largest"] = max(state["largest"], size)
            now = time.perf_counter()
            if progress and n > 1 and (now - state["last_print"] >= PROGRESS_EVERY_S or state["done"] == n):
                rate = state["written"] / max(now - t0, 1e-9)
                _progress(
                    f"  {state['done']}/{n} shards, {state['written'] / 1e9:.2f}/{total / 1e9:.2f} GB, "
                    f"{now - t0:.0f} s ({rate / 1e6:.0f} MB/s, "
                    f"~{(total - state['written']) / max(rate, 1):.0f} s left)"
                )
                state["last_print"] = now

    if workers <= 1:
        for i in range(1, n + 1):
            write_shard(i)
    else:  # each shard has its own generator: the bytes do not depend on the order or the thread
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(write_shard, range(1, n + 1)))
    return state["largest"]


def _check_disk(cfg: DictConfig, parent: Path) -> None:
    need = plan_bytes(cfg)["bytes"] + 64 * 2**20
    free = shutil.disk_usage(parent).free
    if free < need:
        raise UnsupportedError(
            f"kernels=unsloth on model={cfg.model.name} writes {need / 1e9:.1f} GB of random weights to "
            f"{parent} (VRAMSWEEP_CACHE), which has {free / 1e9:.1f} GB free",
            key="kernels",
            allowed=["none", "liger"],
        )


def folder_bytes(path: Path) -> int:
    return int(sum(p.stat().st_size for p in path.iterdir() if p.is_file()))


def ensure_arch_weights(
    cfg: DictConfig, *, progress: bool = True, workers: int = 1
) -> tuple[Path, dict[str, Any]]:
    """The cached weights folder for ``cfg`` (``model.source=arch``), writing it first if needed.

    Returns:
        ``(folder, notes)``; notes (for ``meta.build.arch_weights``) say whether this call wrote the folder
        and carry its size and the measured write time.
    """
    out = arch_weights_dir(cfg)
    t0 = time.perf_counter()
    wrote = False
    if not (out / MARKER).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if progress:
                    _progress(f"waiting for another process writing {out}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not (out / MARKER).exists():
                    tmp = out.with_name(out.name + ".tmp")
                    shutil.rmtree(tmp, ignore_errors=True)  # a writer that died half-way
                    shutil.rmtree(out, ignore_errors=True)  # renamed but never marked complete
                    _check_disk(cfg, out.parent)
                    try:
                        write_arch_weights(cfg, tmp, progress=progress, workers=workers)
                    except BaseException:
                        shutil.rmtree(tmp, ignore_errors=True)
                        raise
                    tmp.rename(out)
                    (out / MARKER).write_text("ok\n")  # last: only now is the folder usable
                    wrote = True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    info = json.loads((out / INFO_FILE).read_text())
    notes = {
        "path": str(out),
        "written_now": wrote,
        "disk_bytes": folder_bytes(out),
        "weight_bytes": info["weight_bytes"],
        "params": info["params"],
        "shards": info["shards"],
        "largest_shard_bytes": info["largest_shard_bytes"],
        "write_s": info["write_s"],
        "write_mb_per_s": info["write_mb_per_s"],
        "ensure_s": round(time.perf_counter() - t0, 3),
        "seed": info["seed"],
        "dtype": info["dtype"],
        "recipe_version": info["recipe_version"],
    }
    return out, notes


def iter_weight_files(path: Path) -> Iterator[Path]:
    """The files whose bytes are deterministic (everything but the timing info and the marker)."""
    for p in sorted(path.iterdir()):
        if p.is_file() and p.name not in (INFO_FILE, MARKER):
            yield p


def folder_digest(path: Path) -> str:
    """sha256 over the deterministic files of a weights folder (names and bytes)."""
    h = hashlib.sha256()
    for p in iter_weight_files(path):
        h.update(p.name.encode())
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """``python -m vramsweep.knobs.arch_weights [--workers N] [overrides...]``: write (or find) the folder
    that ``kernels=unsloth`` would load for these overrides; prints its notes as JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vramsweep.knobs.arch_weights", description=main.__doc__)
    p.add_argument(
        "--workers", type=int, default=1, help="shards written at once (host RAM: N x largest shard)"
    )
    p.add_argument("overrides", nargs="*", help="e.g. model=qwen3_8b train.dtype=bf16")
    args = p.parse_args(argv)
    cfg = compose(list(args.overrides), rules="none")
    if cfg.model.source != "arch":
        print(
            f"error: model={cfg.model.name} is not architecture-only (model.source={cfg.model.source})",
            file=sys.stderr,
        )
        return 2
    _, notes = ensure_arch_weights(cfg, workers=max(1, args.workers))
    print(json.dumps(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
