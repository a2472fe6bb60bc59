"""The embedded default model: a tiny Qwen3-architecture LM + BPE tokenizer, built locally, no network.

Recipe 3 (deterministic, seeded, from the project's own generator; never the fine-tuning or eval documents):

1. **Tokenizer**: byte-level BPE trained on the first :data:`TOKENIZER_DOCS` pre-training documents.
2. **Copy drills** (``model.pretrain_drill_steps``, constant LR :data:`DRILL_LR`, :data:`DRILL_BATCH` rows a
   step): a segment of 8-64 random tokens, then the same segment again, loss on the repeat only. Varied
   lengths matter: with one length the model learns "copy the token N back" instead of content-based
   copying (induction heads), which forms only after ~1,300-1,800 steps (~2M tokens) at this LR
   (docs/measurements/2026-12-01-embedded-recipe-search.md, bench/copy_drill_probe.py); drills of document
   text instead of random tokens delay it past 2,200 steps.
3. **Documents** (``model.pretrain_steps``, cosine LR :data:`DOC_LR`, ``model.pretrain_batch`` documents a
   step, each cut at ``model.pretrain_seq_len`` tokens): whole documents, so a fact's statement and its
   repeat ~2k tokens later share a row. Every step adds a drill batch at loss weight :data:`DRILL_MIX` so
   copying is not forgotten.
4. **Task rows** (``model.pretrain_task_steps`` on new documents, fresh AdamW, cosine LR :data:`TASK_LR`):
   as 3, but with chance :data:`TASK_ROWS` a step trains on the document's task-format rows (instructions,
   a context truncated by a random strategy and budget, the next section), so a cut context is not out of
   distribution (without it, head-truncated rows score control-token accuracy ~0.5 instead of ~0.9).

That takes 970 s on 2 idle CPU cores (measured; 1,522 s while sharing them), so the default ``model=tiny``
base ships as a **committed weights file** (``assets/embedded/``: fp16 safetensors, tokenizer, config;
sha256 in ``vramsweep_embedded.json``) built by this module's own command, bit-for-bit reproducible on the
same torch build, thread count and CPU type (a second full build gave the same five sha256)::

    python -m vramsweep.embedded --write-asset --threads 2      # rebuild it (same sha256)
    python -m vramsweep.embedded --check-asset                  # verify the committed files

:func:`ensure_embedded` copies the asset into ``<cache>/embedded/<key>/`` when the model config matches it
(same dims and recipe keys), and otherwise builds the recipe for the requested dims (with a progress bar).
The folder gets a ``COMPLETE`` marker last; a file lock makes concurrent trials wait for one writer.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from vramsweep.config import compose
from vramsweep.config.schema import DataConfig, ModelConfig
from vramsweep.data.cache import cache_path
from vramsweep.data.documents import document_text
from vramsweep.data.synthetic import pretrain_documents
from vramsweep.data.templates import EMBEDDED_CHAT_TEMPLATE
from vramsweep.hfmodel import cache_root, hf_config

if TYPE_CHECKING:  # torch is imported where a model is built: the pre-flight only needs paths from here
    import torch

# Bump when the generator, tokenizer recipe or pre-training recipe changes (invalidates caches + the asset).
RECIPE_VERSION = 3
PRETRAIN_SEED = 7
TOKENIZER_DOCS = 200
DRILL_LR = 1e-3
DRILL_BATCH = 16
DRILL_SEG = (8, 64)
DOC_LR = 3e-3
DOC_WARMUP = 15
DRILL_MIX = 0.3
TASK_LR = 2e-3
TASK_WARMUP = 5
TASK_ROWS = 0.5
TASK_BUDGETS = (256, 384, 512, 768, 1024, 1536, 2048)
INFO_FILE = "vramsweep_embedded.json"
ASSET_DIR = Path(__file__).resolve().parent / "assets" / "embedded"
ASSET_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class EmbeddedAssetError(RuntimeError):
    """The committed embedded weights are missing or do not match their recorded sha256."""


def _key(mcfg: DictConfig) -> str:
    d = OmegaConf.to_container(mcfg, resolve=True)
    d = {k: d[k] for k in sorted(d) if k not in ("name", "path", "source")}
    d["recipe"] = RECIPE_VERSION
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def embedded_dir(mcfg: DictConfig, root: Path | None = None) -> Path:
    """``<cache>/embedded/<name>-<key>`` (``root``: the cache folder, default created if missing)."""

    return (cache_root() if root is None else root) / "embedded" / f"{mcfg.name}-{_key(mcfg)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def asset_info() -> dict | None:
    """The committed asset's record (``None`` when this install has no asset)."""
    p = ASSET_DIR / INFO_FILE
    return json.loads(p.read_text()) if p.exists() else None


def check_asset(folder: Path = ASSET_DIR) -> dict:
    """Verify every asset file against the sha256 recorded in its ``vramsweep_embedded.json``."""
    info_path = folder / INFO_FILE
    if not info_path.exists():
        raise EmbeddedAssetError(f"no {INFO_FILE} in {folder}")
    info = json.loads(info_path.read_text())
    for name, want in info["files_sha256"].items():
        p = folder / name
        if not p.exists():
            raise EmbeddedAssetError(f"embedded asset file {p} is missing; reinstall or rebuild it")
        got = _sha256(p)
        if got != want:
            raise EmbeddedAssetError(
                f"embedded asset file {p} has sha256 {got[:16]}..., expected {want[:16]}... (a Git LFS "
                f"pointer or a corrupted checkout?); rebuild: python -m vramsweep.embedded --write-asset"
            )
    return info


def ensure_embedded(mcfg: DictConfig, *, progress: bool = True) -> Path:
    """Return the cached embedded model folder: the committed asset when it matches ``mcfg``, else built."""
    out = embedded_dir(mcfg)
    if (out / "COMPLETE").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out / "COMPLETE").exists():
                info = asset_info()
                if info is not None and info.get("key") == _key(mcfg):
                    _install_asset(out)
                else:
                    build_embedded(mcfg, out, progress=progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


_PRETRAIN_KEYS = ("pretrain_drill_steps", "pretrain_steps", "pretrain_task_steps")


def _param_count(mcfg: DictConfig) -> int:
    """Weights of a Qwen3/Llama-shaped model from its dims (tied or untied embedding, norms left out)."""
    h, inter, hd = int(mcfg.hidden_size), int(mcfg.intermediate_size), int(mcfg.head_dim)
    attn = 2 * h * int(mcfg.num_heads) * hd + 2 * h * int(mcfg.num_kv_heads) * hd
    embed = int(mcfg.vocab_size) * h * (1 if mcfg.tie_word_embeddings else 2)
    return embed + int(mcfg.num_layers) * (attn + 3 * h * inter)


def build_note(mcfg: DictConfig) -> str | None:
    """One line when the embedded base for ``mcfg`` is neither cached nor the shipped asset (a ``model.*``
    override changed its recipe): the first trial then pre-trains a new base. It names the changed keys and
    the time that takes, scaled from the shipped base's recorded build (steps x weights); ``None``
    otherwise."""
    if str(mcfg.get("source", "embedded")) != "embedded":
        return None

    out = embedded_dir(mcfg, root=cache_path())
    info = asset_info()
    if (out / "COMPLETE").exists() or (info is not None and info.get("key") == _key(mcfg)):
        return None
    shipped = dataclasses.asdict(ModelConfig())  # the schema's defaults are the shipped base's recipe
    changed = [f"{k}={mcfg[k]}" for k in sorted(mcfg) if k in shipped and k not in ("name", "source", "path")]
    changed = [c for c in changed if str(shipped[c.split("=")[0]]) != c.split("=", 1)[1]]
    steps = sum(int(mcfg[k]) for k in _PRETRAIN_KEYS)
    params = _param_count(mcfg)
    took = ""
    if info is not None and info.get("build_s") and info.get("params"):
        rate = float(info["build_s"]) / (sum(int(info[k]) for k in _PRETRAIN_KEYS) * int(info["params"]))
        took = (
            f", roughly {rate * steps * params / 60:,.0f} min on {info.get('threads', '?')} CPU threads (the "
            f"shipped base took {float(info['build_s']) / 60:.0f} min for {int(info['params']) / 1e6:.1f} M)"
        )
    what = f"model.* {' '.join(changed)}" if changed else "these model.* values"
    return (
        f"note: {what}: no embedded base is cached for it, so the first trial pre-trains one "
        f"before it trains ({steps:,} steps, {params / 1e6:.1f} M weights{took}; once, cached in {out})"
    )


def _tmp_for(out: Path) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished ``tmp`` folder to ``out``; the ``COMPLETE`` marker is written last."""
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / "COMPLETE").write_text("ok\n")


def _install_asset(out: Path) -> None:
    check_asset()
    tmp = _tmp_for(out)
    shutil.copytree(ASSET_DIR, tmp)
    _publish(tmp, out)


def weights_digest(model: torch.nn.Module) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Drills:
    """Copy-drill batches: rows of ``segment + segment`` with the loss on the repeat (recipe step 2).

    The draws follow bench/embedded_recipe.py's stream (``--drill-seg-min 8 --drill-seg 64``, with its
    ``--drill-text 0`` and ``--drill-k 0`` draws per row, token ids from 4): the seed matters, since when
    content-based copying forms varies with the stream. With this one it forms at ~1,700 steps (copy
    accuracy 0.04 -> 0.85 between steps 1,500 and 1,700); a stream that differed only in these draws and in
    skipping id 4 still copied 0.04 at step 2,050.
    """

    def __init__(self, rng: random.Random, vocab: int):
        self.rng, self.vocab = rng, vocab

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        rng = self.rng
        seg = rng.randint(*DRILL_SEG)
        out = []
        for _ in range(DRILL_BATCH):
            rng.random()  # the bench's "document-text row?" draw (never, at --drill-text 0)
            rng.choice((0,))  # the bench's token-pool draw (0: the whole vocabulary)
            out.append([rng.randrange(4, self.vocab) for _ in range(seg)])
        s = torch.tensor(out)
        x = torch.cat([s, s], 1)
        lab = x.clone()
        lab[:, :seg] = -100
        return x, lab


def _task_rows(doc: dict, tokenizer, rng: random.Random, instructions: str) -> list[torch.Tensor]:
    """Task-format rows of one document: a random strategy and budget; the two fact-repeating targets
    (financial summary, conclusions) and one other section."""
    import torch

    from vramsweep.data.examples import build_examples

    trunc = rng.choice(("head", "tail", "exp_decay", "none"))
    budget = rng.choice(TASK_BUDGETS) if trunc != "none" else 1 << 20
    ex = build_examples(
        [doc],
        tokenizer,
        max_tokens=budget,
        truncation=trunc,
        decay=0.5,
        min_tokens_per_section=16,
        instructions=instructions,
    )
    pick = ex[-2:] + [ex[rng.randrange(len(ex) - 2)]]
    return [torch.tensor([e.input_ids]) for e in pick]


class _Pretraining:
    """One pre-training run: the model, its optimizer, the documents (token rows and, for task-format
    rows, the documents themselves), the copy drills, the progress bar and the running token count."""

    def __init__(self, model, tokenizer, docs: list[dict], rows: list[list[int]], batch: int, bar) -> None:
        self.model, self.tokenizer, self.bar = model, tokenizer, bar
        self.docs, self.rows, self.batch = docs, rows, batch
        self.rng = random.Random(PRETRAIN_SEED)
        self.drills = _Drills(self.rng, len(tokenizer))
        self.instructions = DataConfig().instructions
        self.tokens = 0
        self.log: dict[str, float] = {}
        self.opt: torch.optim.Optimizer | None = None

    def new_optimizer(self, lr: float) -> None:
        """A fresh AdamW (betas 0.9/0.95, weight decay 0.01) at learning rate ``lr``."""
        import torch

        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    def update(self) -> None:
        """Clip the gradients to norm 1, step the optimizer and zero the gradients."""
        import torch

        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def drill_phase(self, n_steps: int) -> None:
        """Copy drills at the optimizer's constant LR; logs the last measured copy accuracy
        (``drill_copy_acc_last``)."""
        model, bar = self.model, self.bar
        for step in range(n_steps):
            x, lab = self.drills.batch()
            res = model(input_ids=x, labels=lab)
            res.loss.backward()
            self.update()
            self.tokens += x.numel()
            if step % 25 == 0 or step == n_steps - 1:
                n = int((lab[0] == -100).sum())
                acc = float((res.logits[:, n - 1 : -1].argmax(-1) == x[:, n:]).float().mean())
                self.log["drill_copy_acc_last"] = acc
                bar.set_postfix(phase="drills", copy_acc=f"{acc:.2f}")
            bar.update()

    def doc_phase(
        self, n_steps: int, first_doc: int, lr: float, warmup: int, task_rows: float, name: str
    ) -> list:
        """``n_steps`` steps on documents from ``first_doc`` on (a share ``task_rows`` of them as task-format
        rows), each with a drill batch mixed in, at a cosine schedule peaking at ``lr``; returns the
        per-step document losses."""
        from transformers import get_scheduler

        opt, bar = self.opt, self.bar
        for g in opt.param_groups:
            g["lr"] = lr
        sched = get_scheduler(
            "cosine", optimizer=opt, num_warmup_steps=min(warmup, n_steps), num_training_steps=n_steps
        )
        losses = []
        for step in range(n_steps):
            xs = self._doc_rows(first_doc + step * self.batch, task_rows)
            total = self._doc_step(xs)
            sched.step()
            losses.append(total)
            if step % 10 == 0:
                bar.set_postfix(phase=name, loss=f"{total:.3f}")
            bar.update()
        return losses

    def _doc_rows(self, first: int, task_rows: float) -> list[torch.Tensor]:
        """The rows of one step's ``batch`` documents from index ``first`` on: each document's token row,
        or (with probability ``task_rows``) its task-format rows."""
        import torch

        xs: list[torch.Tensor] = []
        for k in range(self.batch):
            i = first + k
            if task_rows and self.rng.random() < task_rows:
                xs += _task_rows(self.docs[i], self.tokenizer, self.rng, self.instructions)
            else:
                xs.append(torch.tensor([self.rows[i]]))
        return xs

    def _doc_step(self, xs: list[torch.Tensor]) -> float:
        """One optimizer step on rows ``xs`` (each loss weighted by its share of the tokens) plus a drill
        batch at weight ``DRILL_MIX``; returns the rows' loss."""
        model = self.model
        mix = self.drills.batch()
        ntok = sum(x.numel() for x in xs)
        total = 0.0
        for x in xs:
            loss = model(input_ids=x, labels=x).loss * x.numel() / ntok
            loss.backward()
            total += float(loss)
            self.tokens += x.numel()
        (model(input_ids=mix[0], labels=mix[1]).loss * DRILL_MIX).backward()
        self.tokens += mix[0].numel()
        self.update()
        return total


def _tokenizer_and_model(mcfg: DictConfig, texts: list[str], seq: int) -> tuple:
    """Train the tokenizer on the first ``TOKENIZER_DOCS`` texts, tokenise every text (EOS-terminated, at
    most ``seq`` tokens) and build the randomly initialised fp32 model; returns (tokenizer, rows, model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vramsweep.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(texts[:TOKENIZER_DOCS], vocab_size=int(mcfg.vocab_size), min_frequency=1)
    if len(tokenizer) != int(mcfg.vocab_size):
        # Like real checkpoints, the embedding may have more rows than the tokenizer has tokens; say so.
        print(f"note: the tokenizer has {len(tokenizer)} tokens, the model {mcfg.vocab_size} embedding rows")
    eos = tokenizer.eos_token_id
    rows = [(tokenizer(t, add_special_tokens=False)["input_ids"] + [eos])[:seq] for t in texts]
    config = hf_config(mcfg)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, eos
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(PRETRAIN_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return tokenizer, rows, model


def build_embedded(mcfg: DictConfig, out: Path, *, progress: bool = True) -> dict:
    """Build tokenizer + pre-trained tiny model into ``out`` (atomic: tmp dir, then rename). Recipe 3
    above."""
    from tqdm import tqdm

    t0 = time.time()
    drill_steps, steps = int(mcfg.pretrain_drill_steps), int(mcfg.pretrain_steps)
    task_steps = int(mcfg.pretrain_task_steps)
    batch, seq = int(mcfg.pretrain_batch), int(mcfg.pretrain_seq_len)
    n_docs = max(TOKENIZER_DOCS, (steps + task_steps) * batch)
    docs = pretrain_documents(n_docs, PRETRAIN_SEED)
    texts = [document_text(d) for d in docs]
    tokenizer, rows, model = _tokenizer_and_model(mcfg, texts, seq)
    bar = tqdm(
        total=drill_steps + steps + task_steps,
        desc="pre-training embedded base model (once, cached)",
        disable=not progress,
    )
    run = _Pretraining(model, tokenizer, docs, rows, batch, bar)
    run.new_optimizer(DRILL_LR)
    run.drill_phase(drill_steps)  # 2. copy drills, constant LR
    if drill_steps and run.log["drill_copy_acc_last"] < 0.5:
        print(
            f"warning: copy drills end at copy accuracy {run.log['drill_copy_acc_last']:.2f}: content-based "
            "copying has not formed; raise model.pretrain_drill_steps",
            file=sys.stderr,
        )
    # 3. whole documents + a drill batch; 4. fresh optimizer: half the steps on task-format rows
    losses = run.doc_phase(steps, 0, DOC_LR, DOC_WARMUP, 0.0, "documents")
    run.new_optimizer(TASK_LR)
    losses += run.doc_phase(task_steps, steps * batch, TASK_LR, TASK_WARMUP, TASK_ROWS, "task rows")
    bar.close()
    info = {
        "recipe_version": RECIPE_VERSION,
        "key": _key(mcfg),
        "params": int(sum(p.numel() for p in model.parameters())),
        "pretrain_docs": n_docs,
        "pretrain_drill_steps": drill_steps,
        "pretrain_steps": steps,
        "pretrain_task_steps": task_steps,
        "pretrain_tokens": run.tokens,
        "tokenizer_tokens": len(tokenizer),
        "loss_first": losses[0] if losses else None,
        "loss_last_10_mean": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
    }
    _save_built(model, tokenizer, out, info, run.log, t0)
    return info


def _save_built(model, tokenizer, out: Path, info: dict, log: dict, t0: float) -> None:
    """Save the model (eval mode), the tokenizer with the embedded chat template and the info file into a
    tmp dir next to ``out``, then publish it as ``out``; ``info`` gains the weights' digest, the build
    time, the torch version and thread count, and the pre-training ``log``."""
    import torch

    tmp = _tmp_for(out)
    model.eval()
    model.save_pretrained(tmp)
    tokenizer.chat_template = EMBEDDED_CHAT_TEMPLATE  # written as chat_template.jinja
    tokenizer.save_pretrained(tmp)
    info.update(
        {
            "weights_sha256": weights_digest(model),
            "build_s": round(time.time() - t0, 1),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            **log,
        }
    )
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    _publish(tmp, out)


def write_asset(folder: Path = ASSET_DIR, *, progress: bool = True) -> dict:
    """Build the default ``model=tiny`` base and store it as the committed asset (fp16 weights)."""
    import torch
    from safetensors.torch import load_file, save_file

    mcfg = compose([]).model
    work = folder.with_name(folder.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    info = build_embedded(mcfg, work, progress=progress)
    weights = load_file(str(work / "model.safetensors"))
    save_file(
        {k: v.to(torch.float16).contiguous() for k, v in sorted(weights.items())},
        str(work / "model.safetensors"),
        metadata={"format": "pt"},
    )
    info["stored_dtype"] = "float16"
    info["files_sha256"] = {name: _sha256(work / name) for name in ASSET_FILES}
    (work / "COMPLETE").unlink()
    (work / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)
    return info


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(
        prog="python -m vramsweep.embedded",
        description="Build or verify the committed embedded base model (model=tiny, recipe 3).",
    )
    ap.add_argument("--write-asset", action="store_true", help=f"rebuild {ASSET_DIR} (~16 min on 2 cores)")
    ap.add_argument("--check-asset", action="store_true", help="verify the asset files' sha256")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for --write-asset (default 2)")
    ap.add_argument(
        "--out", type=Path, default=ASSET_DIR, help="where --write-asset writes (default: the asset)"
    )
    args = ap.parse_args(argv)
    if not (args.write_asset or args.check_asset):
        ap.error("choose --write-asset or --check-asset")
    try:
        if args.write_asset:
            torch.set_num_threads(args.threads)
            before = asset_info() if args.out == ASSET_DIR else None
            info = write_asset(args.out)
            sha = info["files_sha256"]["model.safetensors"]
            same = before is not None and before["files_sha256"] == info["files_sha256"]
            print(f"wrote {args.out} in {info['build_s']} s: model.safetensors sha256 {sha}")
            if before is not None:
                print(
                    "bit-for-bit identical to the previous asset"
                    if same
                    else "differs from the previous asset"
                )
        if args.check_asset:
            info = check_asset(args.out)
            print(f"ok: {args.out} matches its recorded sha256 (recipe {info['recipe_version']})")
    except EmbeddedAssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
