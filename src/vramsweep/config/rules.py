"""The one rules module: range checks and cross-knob compatibility, run before anything is built.

Two kinds of failure:

* :class:`ConfigError` — the input is wrong whatever the machine (bad value, incompatible knobs).
  ``vramsweep train`` exits 2; the sweeper rejects the search space before any trial starts.
* :class:`UnsupportedError` — valid, but this machine cannot run it (flash-attn on CPU, Liger without
  CUDA, Unsloth not installed). ``vramsweep train`` exits 2; a sweep records the trial as
  ``unsupported`` and moves on.

Every message names the override to change and the allowed values.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.errors import ConfigError
from vramsweep.config.paths import list_options
from vramsweep.config.rope import ROPE_TYPES, documented_base, needed_factor, plan
from vramsweep.config.schema import (
    DTYPES,
    MODEL_FAMILIES,
    MODEL_SOURCES,
    NAMED_GROUPS,
    SCHEDULES,
    TRUNCATIONS,
)
from vramsweep.data.formats import formats


class UnsupportedError(ConfigError):
    """A valid config that this machine cannot run (recorded as ``unsupported`` in sweeps)."""


@contextlib.contextmanager
def refused_point() -> Iterator[None]:
    """Compose or check one point of a sweep: a ``ConfigError`` becomes
    ``UnsupportedError("invalid combination: ...")`` (an ``UnsupportedError`` passes as it is). Each value of
    the point passed the sweep's own checks (:mod:`vramsweep.sweeper.validate`), so the rules refused its
    combination: a grid or a search records that point ``unsupported`` (a result, not a failure counted
    toward ``max_failure_rate``), while a plain ``ConfigError`` is a user's bad input, ``error``
    (:mod:`vramsweep.record.failure`)."""
    try:
        yield
    except UnsupportedError:
        raise
    except ConfigError as exc:
        refused = UnsupportedError(f"invalid combination: {exc}", key=exc.key)
        refused.allowed = exc.allowed
        raise refused from exc


def cuda_available() -> bool:
    """True when CUDA can be used. Never initialises CUDA (safe in a sweeper parent process)."""
    if os.environ.get("VRAMSWEEP_FORCE_NO_CUDA") == "1":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    # broad on purpose: a broken CUDA/driver install means no usable CUDA here, whatever it raises
    except Exception:
        return False


def _module_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _num(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_range(cfg, key, lo, hi, *, integer=False, lo_open=False, hi_open=False):
    v = _num(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{key}={v!r} must be a number", key=key, allowed=[f"{lo}..{hi}"])
    if integer and not float(v).is_integer():
        raise ConfigError(f"{key}={v!r} must be an integer", key=key, allowed=[f"{lo}..{hi}"])
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        raise ConfigError(f"{key}={v} is not a finite number", key=key, allowed=[f"{lo}..{hi}"])
    bad = (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi)
    if bad:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ConfigError(
            f"{key}={v} is out of range {lb}{lo}, {hi}{rb}", key=key, allowed=[f"{lb}{lo}, {hi}{rb}"]
        )


def _check_threads(cfg) -> None:
    """``train.threads``: ``auto`` or a count 0..1024 (0 = torch's default); vramsweep.measure.threads."""
    v = str(cfg.train.get("threads", "auto")).strip()
    if v.lower() == "auto":
        return
    if not re.fullmatch(r"\d+", v) or int(v) > 1024:
        raise ConfigError(
            f"train.threads={v!r} is not auto or a thread count",
            key="train.threads",
            allowed=["auto", "0 (torch's default)", "1..1024"],
        )


def _check_choice(cfg, key, allowed):
    v = _num(cfg, key)
    if v not in allowed:
        raise ConfigError(f"{key}={v!r} is not a known value", key=key, allowed=allowed)


def group_options(group: str) -> tuple[str, ...]:
    """A group's options: its option files across the config search path."""
    return tuple(list_options(group))


def _check_model_values(cfg: DictConfig) -> None:
    """``model.*``: its source and family, its dims, positions and the embedded base's recipe."""
    _check_choice(cfg, "model.source", MODEL_SOURCES)
    _check_choice(cfg, "model.family", MODEL_FAMILIES)
    for k in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        _check_range(cfg, f"model.{k}", 1, 10**7, integer=True)
    # the positions are the model's own: 0 divided (ZeroDivisionError), -1 was blamed on context.max_tokens
    _check_range(cfg, "model.max_position_embeddings", 32, 10**8, integer=True)
    # the embedded base's recipe: a bad value here used to start a new base's pre-training (hours) first
    _check_range(cfg, "model.rope_theta", 0, 10**12, lo_open=True)
    _check_range(cfg, "model.rms_norm_eps", 0, 1, lo_open=True, hi_open=True)
    for k in ("pretrain_drill_steps", "pretrain_steps", "pretrain_task_steps"):
        _check_range(cfg, f"model.{k}", 0, 10**6, integer=True)
    _check_range(cfg, "model.pretrain_seq_len", 32, 10**7, integer=True)
    _check_range(cfg, "model.pretrain_batch", 1, 4096, integer=True)
    if cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={cfg.model.num_kv_heads} must divide model.num_heads={cfg.model.num_heads}",
            key="model.num_kv_heads",
            allowed=[d for d in range(1, cfg.model.num_heads + 1) if cfg.model.num_heads % d == 0],
        )


def check_values(cfg: DictConfig) -> None:
    """Value and range rules of each knob on its own (no cross-knob or machine rules)."""
    for group in NAMED_GROUPS:
        name = cfg[group].name if group in cfg and "name" in cfg[group] else None
        if name is not None and name not in (options := group_options(group)):
            raise ConfigError(f"{group}={name} is not a known option", key=group, allowed=options)
    _check_model_values(cfg)
    _check_quant_adapter_values(cfg)
    _rules_optimizer(cfg)
    _check_choice(cfg, "attention.implementation", group_options("attention"))
    _check_context_vocab_values(cfg)
    _rules_data(cfg)
    _check_hardware_values(cfg)
    if int(cfg.quant.bits) == 4 and int(cfg.quant.blocksize) != 64:
        # transformers builds bitsandbytes' Linear4bit without a block size: 64 is what runs, so another
        # value would change the estimate but not the model
        raise ConfigError(
            f"quant.blocksize={cfg.quant.blocksize}: 4-bit layers are built with bitsandbytes' block size 64 "
            "(transformers passes none)",
            key="quant.blocksize",
            allowed=[64],
        )
    _check_train_values(cfg)
    _check_choice(cfg, "logger.mode", ("auto", "offline", "online"))
    _check_choice(cfg, "adapter.dtype", ("fp32", "compute"))
    _check_range(cfg, "tiling.loss_chunk_tokens", 0, 10**7, integer=True)
    _check_range(cfg, "tiling.mlp_tile_tokens", 0, 10**7, integer=True)
    _check_attention_heads(cfg)


def _check_attention_heads(cfg: DictConfig) -> None:
    """``tiling.attention_heads``: 0 (off) or a divisor of the model's kv heads (GQA-aligned groups)."""
    _check_range(cfg, "tiling.attention_heads", 0, 4096, integer=True)
    groups, kv = int(cfg.tiling.get("attention_heads", 0) or 0), cfg.model.get("num_kv_heads")
    if groups > 1 and kv is not None and int(kv) % groups:
        raise ConfigError(
            f"tiling.attention_heads={groups} must divide model.num_kv_heads={kv} (each group: whole kv "
            "heads and the query heads that share them)",
            key="tiling.attention_heads",
            allowed=[0, *[g for g in range(1, int(kv) + 1) if int(kv) % g == 0]],
        )


def _check_quant_adapter_values(cfg: DictConfig) -> None:
    """``quant.*`` (bits, 4-bit type, compute dtype) and ``adapter.*`` (method, rank, alpha, dropout,
    targets: ``all-linear`` or a non-empty list of module names)."""
    _check_choice(cfg, "quant.bits", (4, 8, 16))
    if cfg.quant.bits == 4:
        _check_choice(cfg, "quant.quant_type", ("nf4", "fp4"))
    _check_choice(cfg, "quant.compute_dtype", DTYPES)
    _check_choice(cfg, "adapter.method", ("lora", "full"))
    _check_range(cfg, "adapter.r", 1, 4096, integer=True)
    _check_range(cfg, "adapter.alpha", 0, 1e6, lo_open=True)
    _check_range(cfg, "adapter.dropout", 0.0, 1.0, hi_open=True)
    targets = cfg.adapter.targets
    if isinstance(targets, str):
        if not targets:
            raise ConfigError(
                "adapter.targets is empty",
                key="adapter.targets",
                allowed=["all-linear", "[q_proj,v_proj,...]"],
            )
    elif not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(
            f"adapter.targets={list(targets) if targets is not None else targets} must be "
            "'all-linear' or a non-empty list of module names",
            key="adapter.targets",
            allowed=["all-linear", "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
        )


def _check_context_vocab_values(cfg: DictConfig) -> None:
    """``context.*`` (length, truncation and its decay, section minimum) and ``vocab.*``."""
    _check_range(cfg, "context.max_tokens", 32, 10**7, integer=True)
    _check_choice(cfg, "context.truncation", TRUNCATIONS)
    _check_range(cfg, "context.decay", 0.0, 1.0, lo_open=True)
    _check_range(cfg, "context.min_tokens_per_section", 0, 10**7, integer=True)
    _check_choice(cfg, "vocab.mode", ("full", "corpus", "top_k"))
    _check_choice(cfg, "vocab.fallback", ("error", "unk"))
    _check_range(cfg, "vocab.reserve", 0, 10**7, integer=True)
    if cfg.vocab.mode == "top_k":
        _check_range(cfg, "vocab.top_k", 1, 10**7, integer=True)
    _check_vocab_rows(cfg)


def _check_vocab_rows(cfg: DictConfig) -> None:
    """``vocab.rows``: a sliced vocabulary's row count for estimates without a corpus (``vocab=sliced``,
    ``vocab.mode=corpus``), at most the model's vocabulary."""
    rows = cfg.vocab.get("rows", 0)
    _check_range(cfg, "vocab.rows", 0, 10**7, integer=True)
    if not int(rows):
        return
    if cfg.vocab.mode != "corpus":
        raise ConfigError(
            f"vocab.rows={rows} sizes a corpus slice before there is a corpus; it needs vocab=sliced "
            f"(vocab.mode=corpus), got vocab.mode={cfg.vocab.mode}"
            + (" (vocab.top_k already gives the rows)" if cfg.vocab.mode == "top_k" else ""),
            key="vocab.rows",
            allowed=["0", "vocab=sliced vocab.rows=<n>"],
        )
    full = cfg.model.get("vocab_size")
    if full is not None and int(rows) > int(full):
        raise ConfigError(
            f"vocab.rows={rows} exceeds model.vocab_size={full}",
            key="vocab.rows",
            allowed=[f"1..{full}"],
        )


def _rules_trial_only(cfg: DictConfig) -> None:
    """What only an estimate may ask for: ``vocab.rows`` (a trial keeps the rows its corpus uses)."""
    if int(cfg.vocab.get("rows", 0) or 0):
        raise ConfigError(
            f"vocab.rows={cfg.vocab.rows} only sizes an estimate (vramsweep estimate) without a corpus; a "
            "trial keeps the rows its training data uses: drop vocab.rows",
            key="vocab.rows",
            allowed=["0"],
        )


def _check_hardware_values(cfg: DictConfig) -> None:
    """``hardware.*``: device, budget and memory (the budget within the card's memory when that is known),
    peak FLOP/s, bandwidth and overhead."""
    _check_choice(cfg, "hardware.device", ("cpu", "cuda"))
    _check_range(cfg, "hardware.budget_gib", 0.0, 1e5)
    _check_range(cfg, "hardware.memory_gib", 0.0, 1e5)
    _check_range(cfg, "hardware.peak_bf16_flops", 0.0, 1e18)  # 0 = no peak known (MFU null, with why)
    _check_range(cfg, "hardware.bandwidth_bytes_per_s", 0.0, 1e16)
    _check_range(cfg, "hardware.overhead_bytes", 0, 1e16, integer=True)
    mem, budget = float(cfg.hardware.memory_gib), float(cfg.hardware.budget_gib)
    if mem > 0 and budget > mem:
        raise ConfigError(
            f"hardware.budget_gib={budget:g} is above the card's memory (hardware.memory_gib={mem:g})",
            key="hardware.budget_gib",
            allowed=[f"[0, {mem:g}]"],
        )


def _check_train_values(cfg: DictConfig) -> None:
    """``train.*`` and the seeds: steps, batch, schedule, clipping, evaluation, the measured window (at
    least one measured step), threads, seeds, and the production run's epochs, saving and resuming."""
    _check_range(cfg, "train.steps", 1, 10**7, integer=True)
    _check_range(cfg, "train.micro_batch", 1, 4096, integer=True)
    _check_range(cfg, "train.grad_accum", 1, 4096, integer=True)
    _check_range(cfg, "train.lr", 0.0, 1.0, lo_open=True)
    _check_choice(cfg, "train.schedule", SCHEDULES)
    _check_range(cfg, "train.warmup_steps", 0, cfg.train.steps, integer=True)
    _check_range(cfg, "train.max_grad_norm", 0.0, 1e6)
    _check_choice(cfg, "train.dtype", (*DTYPES, "auto"))  # auto is resolved at compose (config.fit)
    _check_range(cfg, "train.eval_every", 0, 10**7, integer=True)
    _check_range(cfg, "train.eval_batches", 1, 10**5, integer=True)
    _check_range(cfg, "train.measure_warmup_steps", 0, 10**7, integer=True)
    if cfg.train.measure_warmup_steps >= cfg.train.steps:
        raise ConfigError(
            f"train.measure_warmup_steps={cfg.train.measure_warmup_steps} leaves no measured step "
            f"with train.steps={cfg.train.steps}",
            key="train.measure_warmup_steps",
            allowed=[f"0..{cfg.train.steps - 1}"],
        )
    _check_threads(cfg)
    for key in ("train.seed", "data.seed"):  # torch, numpy and random all take 0 .. 2**32 - 1
        if OmegaConf.select(cfg, key) is not None:
            _check_range(cfg, key, 0, 2**32 - 1, integer=True)
    _check_range(cfg, "train.epochs", 0.0, 1e4)  # production run (docs/RUNS.md)
    _check_choice(cfg, "train.save_adapter", ("auto", "always", "never"))
    _check_range(cfg, "train.save_every", 0, 10**7, integer=True)
    _check_range(cfg, "train.keep_checkpoints", 1, 10**4, integer=True)
    _check_choice(cfg, "train.resume", ("never", "auto"))


TARGET_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _target_package(target: str) -> str:
    return str(target).split(".", 1)[0]


def optimizer_targets() -> dict[str, str]:
    """``{option: _target_}`` of every optimizer option file (the options are the files: no other list)."""
    from omegaconf import OmegaConf

    from vramsweep.config.paths import find_option

    out = {}
    for name in group_options("optimizer"):
        path = find_option("optimizer", name)
        out[name] = str(OmegaConf.load(path).get("_target_", "")) if path else ""
    return out


def _rules_optimizer(cfg: DictConfig) -> None:
    """``optimizer``: a class path, the ranges of the common constructor keywords where the option passes
    them (``optimizer.kwargs.*``; a keyword the class does not take fails at build, naming it), and the
    state spec the estimator reads."""
    o = cfg.optimizer
    target = o["_target_"]
    if not TARGET_RE.match(str(target)):
        raise ConfigError(
            f"optimizer._target_={target!r} must name a class (package.module.Class)",
            key="optimizer._target_",
            allowed=sorted(set(optimizer_targets().values())),
        )
    kw = o.kwargs
    if "weight_decay" in kw:
        _check_range(cfg, "optimizer.kwargs.weight_decay", 0.0, 1.0)
    if "eps" in kw and not isinstance(kw.eps, Sequence):  # Adafactor's eps is a pair
        _check_range(cfg, "optimizer.kwargs.eps", 0.0, 1.0, lo_open=True)
    if "betas" in kw:
        if not isinstance(kw.betas, Sequence) or len(kw.betas) != 2:
            raise ConfigError(
                f"optimizer.kwargs.betas={kw.betas} needs two values",
                key="optimizer.kwargs.betas",
                allowed=["[b1, b2] in [0, 1)"],
            )
        for i, b in enumerate(kw.betas):
            if not (0.0 <= float(b) < 1.0):
                raise ConfigError(
                    f"optimizer.kwargs.betas[{i}]={b} is out of range",
                    key="optimizer.kwargs.betas",
                    allowed=["[0, 1)"],
                )
    if "min_8bit_size" in kw:
        _check_range(cfg, "optimizer.kwargs.min_8bit_size", 0, 10**9, integer=True)
    _check_range(cfg, "optimizer.state.moments", 0, 16, integer=True)
    _check_choice(cfg, "optimizer.state.bytes", (0, 1, 2, 4, 8))
    _check_range(cfg, "optimizer.state.block", 1, 10**9, integer=True)
    _check_range(cfg, "optimizer.state.qmap", 0, 10**6, integer=True)
    _check_range(cfg, "optimizer.state.min_8bit_size", 0, 10**9, integer=True)
    _check_range(cfg, "optimizer.state.scalar_bytes", 0, 1024, integer=True)
    _check_range(cfg, "optimizer.state.temporaries", 0, 64)


def _rules_combinations(cfg: DictConfig) -> None:
    """Cross-knob rules (checkpointing, tiling, packing, kernels, adapter with quant and device, attention
    with dtype) and the local paths a config names (model folder, data files)."""
    _rules_checkpointing(cfg)
    _rules_tiling(cfg)
    _rules_packing(cfg)
    if cfg.kernels.liger and cfg.kernels.unsloth:
        raise ConfigError(
            "kernels: Liger and Unsloth cannot both be on (Unsloth patches the same modules)",
            key="kernels",
            allowed=group_options("kernels"),
        )
    _rules_adapter(cfg)
    if cfg.attention.implementation == "flash_attention_2" and cfg.train.dtype == "fp32":
        raise ConfigError(
            "attention=flash_attention_2 needs fp16/bf16 compute, got train.dtype=fp32",
            key="train.dtype",
            allowed=["bf16", "fp16"],
        )
    if cfg.model.source == "embedded" and cfg.model.name != "tiny":
        pass  # other embedded sizes are allowed (custom dims)
    # context.max_tokens against the model's positions: _rules_rope (after model.path is checked)
    arch = cfg.model.source == "arch" and not cfg.model.get("path")
    if cfg.vocab.mode != "full" and arch and not int(cfg.vocab.get("rows", 0) or 0):
        raise ConfigError(
            "vocab=sliced needs a tokenizer and corpus: it works with the embedded model or model.path, not "
            f"architecture-only model={cfg.model.name}; to estimate a slice there, give its row count: "
            "vramsweep estimate ... vocab=sliced vocab.rows=<n>",
            key="vocab",
            allowed=["full", "sliced with vocab.rows=<n> (estimate only)"],
        )
    _rules_model_path(cfg)
    _rules_data_paths(cfg)


def _rules_checkpointing(cfg: DictConfig) -> None:
    """``checkpointing=offload`` is a way to checkpoint: it needs ``enabled`` and no reentrant checkpoint."""
    offload = cfg.checkpointing.name == "offload"
    if offload and not cfg.checkpointing.enabled:
        raise ConfigError(
            "checkpointing=offload needs checkpointing.enabled=true (offload is a way to checkpoint)",
            key="checkpointing",
            allowed=group_options("checkpointing"),
        )
    if offload and cfg.checkpointing.use_reentrant:
        raise ConfigError(
            "checkpointing=offload runs its own checkpoint function: checkpointing.use_reentrant "
            "must be false",
            key="checkpointing.use_reentrant",
            allowed=["false"],
        )


def _rules_tiling(cfg: DictConfig) -> None:
    """Tiling against the kernels: not with Unsloth, and the chunked loss not with Liger's fused loss."""
    tiled = (
        int(cfg.tiling.loss_chunk_tokens) > 0
        or int(cfg.tiling.mlp_tile_tokens) > 0
        or int(cfg.tiling.get("attention_heads", 0) or 0) > 1
    )
    if tiled and cfg.kernels.unsloth:
        raise ConfigError(
            f"tiling={cfg.tiling.name} cannot be combined with kernels=unsloth: Unsloth replaces "
            "the MLP, the loss and the attention with its own kernels (its fused loss is already chunked)",
            key="tiling",
            allowed=["off"],
        )
    if (
        int(cfg.tiling.loss_chunk_tokens) > 0
        and cfg.kernels.liger
        and bool(cfg.kernels.get("liger_fused_linear_cross_entropy", True))
    ):
        # one owner of the loss: our chunked loss would bypass Liger's fused linear cross-entropy while the
        # build notes and the estimate say FLCE runs
        raise ConfigError(
            f"tiling={cfg.tiling.name} (chunked loss, "
            f"tiling.loss_chunk_tokens={int(cfg.tiling.loss_chunk_tokens)}) cannot be combined "
            "with kernels=liger's fused linear cross-entropy: both replace the loss",
            key="tiling",
            allowed=[
                "kernels=liger tiling=mlp (Liger's fused loss + the tiled MLP)",
                "kernels=liger kernels.liger_fused_linear_cross_entropy=false tiling=on",
                "kernels=none tiling=on",
            ],
        )


def _rules_adapter(cfg: DictConfig) -> None:
    """The adapter against quant and device: full fine-tuning needs unquantised weights, DoRA on 8-bit
    does not run on CPU, rsLoRA is a LoRA option."""
    if cfg.adapter.method == "full" and cfg.quant.bits != 16:
        raise ConfigError(
            f"quant={cfg.quant.name} ({cfg.quant.bits}-bit) cannot be combined with adapter=full: quantised "
            "base weights are frozen; train an adapter or use quant=none",
            key="quant",
            allowed=["quant=none with adapter=full", "adapter=lora|rslora|dora with any quant"],
        )
    if bool(cfg.adapter.get("use_dora")) and int(cfg.quant.bits) == 8 and cfg.hardware.device == "cpu":
        raise ConfigError(  # PEFT's DoRA weight norm reads bitsandbytes' int8 state, which CPU layers lack
            f"adapter={cfg.adapter.name} (DoRA) with quant={cfg.quant.name} (8-bit) does not run on "
            "hardware.device=cpu: PEFT's DoRA cannot dequantise bitsandbytes' int8 layers there",
            key="adapter",
            allowed=["adapter=lora|rslora with quant=int8", "adapter=dora with quant=none|nf4"],
        )
    if cfg.adapter.use_rslora and cfg.adapter.method != "lora":
        raise ConfigError(
            "adapter.use_rslora needs adapter.method=lora", key="adapter.use_rslora", allowed=[False]
        )


def _rules_model_path(cfg: DictConfig) -> None:
    """``model.source=path``: ``model.path`` is a local folder with a ``config.json``."""
    if cfg.model.source == "path":
        p = cfg.model.path
        if not p:
            raise ConfigError(
                f"model={cfg.model.name} needs model.path=<folder>: the local Hugging Face model folder to "
                "fine-tune (config.json, weights, tokenizer; nothing is downloaded)",
                key="model.path",
                allowed=["<local HF folder with config.json>"],
            )
        if not os.path.isdir(str(p)):
            raise ConfigError(
                f"model.path={p!r} is not a local folder (nothing is downloaded)",
                key="model.path",
                allowed=["<local HF folder with config.json>"],
            )
        if not os.path.isfile(os.path.join(str(p), "config.json")):
            raise ConfigError(
                f"model.path={p!r} has no config.json",
                key="model.path",
                allowed=["<local HF folder with config.json>"],
            )


def _rules_data_paths(cfg: DictConfig) -> None:
    """A file data source: ``data.path`` (and ``data.eval_path`` when set) is a regular file or a folder."""
    if cfg.data.source in ("jsonl", "file"):
        for key in ("path", "eval_path"):
            p = cfg.data[key]
            if key == "eval_path" and p is None:
                continue
            if not p and key == "path":
                raise ConfigError(
                    f"data={cfg.data.name} needs data.path=<file>: your records (.jsonl, .json, .parquet or "
                    "a datasets folder; formats in docs/DATA.md)",
                    key="data.path",
                    allowed=["<path to .jsonl / .json / .parquet / folder>"],
                )
            if not (os.path.isfile(str(p)) or os.path.isdir(str(p))):
                odd = bool(p) and os.path.exists(str(p))  # a FIFO or a device: reading it would block
                raise ConfigError(
                    f"data.{key}={p!r} is not a readable data file or dataset folder"
                    + (" (not a regular file: a FIFO or device is never read)" if odd else ""),
                    key=f"data.{key}",
                    allowed=["<path to .jsonl / .json / .parquet>", "<datasets save_to_disk folder>"],
                )


def _rules_packing(cfg: DictConfig) -> None:
    if not bool(cfg.data.get("packing", False)):
        return
    if cfg.data.source == "random":
        raise ConfigError(
            "data.packing=true with data=random: random rows are already exactly context.max_tokens long",
            key="data.packing",
            allowed=["false"],
        )
    if cfg.kernels.unsloth:
        raise ConfigError(
            "data.packing=true cannot be combined with kernels=unsloth: Unsloth's forward builds its own "
            "attention masks and would attend across the packed examples",
            key="data.packing",
            allowed=["false", "kernels=none", "kernels=liger"],
        )
    # no length cap: eager/sdpa packed rows run segment-wise attention (knobs/packed_attention.py), no
    # T x T mask; FlashAttention-2 runs varlen, but only for one row per forward:
    _rules_packing_flash(cfg)


def _rules_packing_flash(cfg: DictConfig) -> None:
    """transformers 5.x (``modeling_flash_attention_utils``) takes FA2's varlen path for packed rows
    (``position_ids`` restarting) only when the batch holds one row; with more rows FA2 runs causal
    attention over each whole row, so the packed examples attend to each other (emulated on CPU: loss off
    by 3.4e-2 relative). Refused before anything is built, naming the overrides that fix it."""
    mb = int(cfg.train.micro_batch)
    if str(cfg.attention.implementation) == "flash_attention_2" and mb > 1:
        raise ConfigError(
            f"data.packing=true with attention=flash_attention_2 needs train.micro_batch=1, not {mb}: "
            "transformers runs FlashAttention-2 per packed example only for one row per forward, so the "
            f"examples of {mb} rows would attend to each other; set train.micro_batch=1 (and "
            f"train.grad_accum={mb * int(cfg.train.grad_accum)} for the same step), or attention=sdpa",
            key="train.micro_batch",
            allowed=["1", "attention=sdpa", "attention=eager", "data.packing=false"],
        )


DATA_SOURCES = ("embedded", "embedded_chat", "file", "jsonl", "random")
TRAIN_ON = ("auto", "assistant", "last_assistant", "completion", "all")
TOO_LONG = ("truncate", "drop", "error")


def _rules_data(cfg: DictConfig) -> None:
    """``data.*``: choices, and the settings that apply only to some sources refused elsewhere."""
    d = cfg.data
    _check_choice(cfg, "data.source", DATA_SOURCES)
    _check_choice(cfg, "data.format", ("auto", *formats()))  # the format table's names
    _check_choice(cfg, "data.train_on", TRAIN_ON)
    _check_choice(cfg, "data.too_long", TOO_LONG)
    generated = str(d.source) in ("embedded", "embedded_chat", "random")
    for key in ("num_docs", "num_eval_docs"):
        if generated:
            if d.get(key) is None:
                raise ConfigError(
                    f"data.{key} is unset: data.source={d.source} generates its records",
                    key=f"data.{key}",
                    allowed=["an integer in [1, 1000000]"],
                )
            _check_range(cfg, f"data.{key}", 1, 10**6, integer=True)
        elif d.get(key) is not None:
            raise ConfigError(
                f"data.{key}={d.get(key)} does not apply to data.source={d.source} (your records come from "
                "data.path; the held-out ones from data.eval_path, the folder's test split or the last 10 %)",
                key=f"data.{key}",
                allowed=["null (leave it out)"],
            )
    if str(d.source) not in ("jsonl", "file"):
        for key in ("path", "eval_path"):
            if d.get(key):
                raise ConfigError(
                    f"data.{key}={d.get(key)!r} does not apply to data.source={d.source}",
                    key=f"data.{key}",
                    allowed=["data=file (or data=jsonl) to read your own records"],
                )
    fixed = {"embedded": "documents", "embedded_chat": "messages"}.get(str(d.source))
    if fixed and str(d.format) not in ("auto", fixed):
        raise ConfigError(
            f"data.format={d.format} does not apply to data.source={d.source} (its records are {fixed})",
            key="data.format",
            allowed=["auto", fixed],
        )
    tpl = d.get("chat_template")
    if tpl not in (None, "", "auto", "chatml", "embedded") and not os.path.isfile(
        os.path.expanduser(str(tpl))
    ):
        raise ConfigError(
            f"data.chat_template={tpl!r} is neither a built-in template (chatml, embedded) nor a "
            "readable Jinja file",
            key="data.chat_template",
            allowed=["chatml", "embedded", "<path to a .jinja file>", "null (the tokenizer's own)"],
        )
    if str(d.too_long) != "truncate" and (
        str(d.source) == "embedded" or str(d.format) == "documents" or str(d.source) == "random"
    ):
        raise ConfigError(
            f"data.too_long={d.too_long} does not apply to data.source={d.source} data.format={d.format} "
            "(sectioned documents are cut by context.truncation; random tokens are max_tokens long)",
            key="data.too_long",
            allowed=["truncate"],
        )
    if str(d.source) == "embedded" and str(d.train_on) != "auto":
        raise ConfigError(
            f"data.train_on={d.train_on} does not apply to sectioned documents (the target section "
            "is trained)",
            key="data.train_on",
            allowed=["auto"],
        )


#: closes every "needs X" message: the one command that lists what runs on this machine and why
ENV_HINT = "`vramsweep env` lists what runs here"
#: how to get each optional package a knob option needs
INSTALL_HINTS = {
    "liger_kernel": "pip install 'vramsweep[gpu]' (from a checkout: pip install -e '.[gpu]')",
    "unsloth": "make unsloth (pip install --no-deps unsloth==2026.10.9 unsloth_zoo==2026.10.9)",
    "flash_attn": "pip install flash-attn --no-build-isolation (CUDA only)",
    "bitsandbytes": "pip install bitsandbytes",
}


def kernels_here(has_cuda: bool) -> list[str]:
    """The ``kernels`` options this machine can run (what an allowed list may offer)."""
    here = ["none"]
    if has_cuda and _module_available("liger_kernel"):
        here.append("liger")
    if _module_available("unsloth"):
        here.append("unsloth")
    return here


def _machine_attention(cfg: DictConfig, has_cuda: bool) -> None:
    """``attention=flash_attention_2`` needs a CUDA device and the flash-attn package."""
    if cfg.attention.implementation != "flash_attention_2":
        return
    if not has_cuda:
        raise UnsupportedError(
            "attention=flash_attention_2 needs a CUDA device (hardware=<gpu profile>)",
            key="attention",
            allowed=["eager", "sdpa"],
        )
    if not _module_available("flash_attn"):
        raise UnsupportedError(
            "attention=flash_attention_2 needs the flash-attn package, not installed: "
            f"{INSTALL_HINTS['flash_attn']}; attention=sdpa uses PyTorch's FlashAttention-2 "
            "kernel on CUDA",
            key="attention",
            allowed=["eager", "sdpa"],
        )


def _machine_kernels(cfg: DictConfig, has_cuda: bool) -> None:
    """``kernels=liger`` needs CUDA and liger-kernel; ``kernels=unsloth`` needs what
    :func:`check_unsloth` accepts, then the unsloth package."""
    if cfg.kernels.liger:
        if not has_cuda:
            raise UnsupportedError(
                f"kernels=liger needs CUDA (Triton kernels) and a hardware=<gpu profile>; {ENV_HINT}",
                key="kernels",
                allowed=[k for k in kernels_here(False) if k != "liger"],
            )
        if not _module_available("liger_kernel"):
            raise UnsupportedError(
                "kernels=liger needs liger-kernel, not installed: "
                f"{INSTALL_HINTS['liger_kernel']}; {ENV_HINT}",
                key="kernels",
                allowed=[k for k in kernels_here(has_cuda) if k != "liger"],
            )
    if cfg.kernels.unsloth:
        # arch-only model, fp4, vocab slicing, attention != sdpa: what Unsloth cannot honour
        check_unsloth(cfg)
        if not _module_available("unsloth"):
            raise UnsupportedError(
                f"kernels=unsloth needs unsloth, not installed: {INSTALL_HINTS['unsloth']}; {ENV_HINT}",
                key="kernels",
                allowed=[k for k in kernels_here(has_cuda) if k != "unsloth"],
            )


def _machine_packages(cfg: DictConfig) -> None:
    """A quantized ``quant`` needs bitsandbytes; the ``optimizer`` needs the package its ``_target_``
    names (the options offered are the optimizers whose package is installed)."""
    if cfg.quant.bits != 16 and not _module_available("bitsandbytes"):
        raise UnsupportedError(
            f"quant={cfg.quant.name} needs bitsandbytes, not installed: {INSTALL_HINTS['bitsandbytes']}; "
            f"{ENV_HINT}",
            key="quant",
            allowed=["none"],
        )
    package = _target_package(cfg.optimizer["_target_"])
    if not _module_available(package):
        raise UnsupportedError(
            f"optimizer={cfg.optimizer.name} needs {package} ({cfg.optimizer['_target_']}), not installed: "
            f"{INSTALL_HINTS.get(package, f'pip install {package}')}; {ENV_HINT}",
            key="optimizer",
            allowed=[
                name
                for name, target in optimizer_targets().items()
                if _module_available(_target_package(target))
            ],
        )


def check_machine(cfg: DictConfig, *, has_cuda: bool | None = None) -> None:
    """Environment-dependent rules: raise :class:`UnsupportedError`.

    ``has_cuda`` (default: :func:`cuda_available`, asked only for a CUDA profile) lets ``vramsweep env``
    ask what a GPU profile would need without importing torch. Checked in order: the CUDA device, then
    attention, kernels, quant and optimizer packages."""
    # only a CUDA profile asks torch (importing it costs seconds of a pre-flight that should take one)
    if cfg.hardware.device != "cuda":
        has_cuda = False
    elif has_cuda is None:
        has_cuda = cuda_available()
    if cfg.hardware.device == "cuda" and not has_cuda:
        raise UnsupportedError(
            f"hardware={cfg.hardware.name} needs CUDA and none is available here; {ENV_HINT}",
            key="hardware",
            allowed=["cpu"],
        )
    _machine_attention(cfg, has_cuda)
    _machine_kernels(cfg, has_cuda)
    _machine_packages(cfg)


def _rope_proposal(cfg: Any, tokens: int, native: int) -> str:
    """The smallest YaRN setting that reaches ``tokens``, over the length the model's recipe scales from
    (:func:`vramsweep.config.rope.documented_base`: Qwen3's 32,768, else the model's positions)."""
    base = documented_base(cfg.model.family, native)
    extra = f" rope.original_max_position_embeddings={base}" if base != native else ""
    return f"rope=yarn{extra} rope.factor={needed_factor(tokens, base)}"


def _rules_rope(cfg: DictConfig) -> None:
    """``rope`` values, and ``context.max_tokens`` within the positions: the model's own, or original x factor
    with rope scaling (:mod:`vramsweep.config.rope`)."""

    _check_choice(cfg, "rope.type", ROPE_TYPES)
    r = cfg.rope
    scaled = r.type != "none"
    if not scaled and (float(r.factor) != 1.0 or r.original_max_position_embeddings is not None):
        raise ConfigError(
            f"rope.factor={r.factor} / rope.original_max_position_embeddings="
            f"{r.original_max_position_embeddings} have no effect with rope=none",
            key="rope",
            allowed=[o for o in group_options("rope") if o != "none"],
        )
    if scaled:
        _check_range(cfg, "rope.factor", 1.0, 1024.0)
        if r.original_max_position_embeddings is not None:
            _check_range(cfg, "rope.original_max_position_embeddings", 32, 10**7, integer=True)
    if scaled and cfg.kernels.unsloth:
        raise UnsupportedError(
            f"kernels=unsloth sets RoPE scaling itself from its max_seq_length: rope={r.name} "
            "cannot be applied",
            key="rope",
            allowed=["none"],
        )
    p = plan(cfg)
    native = p["native_positions"]
    where = (
        f"{cfg.model.path}/config.json max_position_embeddings={native}"
        if cfg.model.source == "path"
        else f"model.max_position_embeddings={native}"
    )
    if scaled and p["existing"] is not None:
        raise ConfigError(
            f"rope={r.name}: model.path's config.json already scales RoPE ({p['existing']}); keep "
            "it with rope=none or remove it from config.json",
            key="rope",
            allowed=["none"],
        )
    if native is None:
        return  # unreadable config.json: the loader names the file
    orig = int(p["original_max_position_embeddings"])
    if scaled and orig > native:
        raise ConfigError(
            f"rope.original_max_position_embeddings={orig} is longer than the model's positions ({where})",
            key="rope.original_max_position_embeddings",
            allowed=[f"32..{native}", "null (= the model's positions)"],
        )
    tokens = int(cfg.context.max_tokens)
    if tokens <= int(p["positions"]):
        return
    if not scaled:
        fix = _rope_proposal(cfg, tokens, native)
        raise ConfigError(
            f"context.max_tokens={tokens} is longer than the model's positions ({where}); a fine-tune beyond "
            f"them needs RoPE scaling: {fix} (or a shorter context.max_tokens)",
            key="context.max_tokens",
            allowed=[f"32..{p['positions']}", fix],
        )
    k = needed_factor(tokens, orig)
    raise ConfigError(
        f"context.max_tokens={tokens} is longer than rope={r.name}'s positions ({orig} x "
        f"rope.factor={r.factor} = {p['positions']}); raise it: rope.factor={k}",
        key="context.max_tokens",
        allowed=[f"32..{p['positions']}", f"rope.factor={k}"],
    )


RULES: tuple[Callable[[DictConfig], None], ...] = (check_values, _rules_combinations, _rules_rope)


#: Smallest ``model.vocab_size`` for the byte-level tokenizer written next to random architecture weights
#: (5 specials + 256 byte tokens; :mod:`vramsweep.knobs.arch_weights`).
ARCH_MIN_VOCAB = 261


def check_arch_vocab(cfg: DictConfig) -> None:
    """``model.source=arch`` weights folders (what ``kernels=unsloth`` loads) carry a byte-level tokenizer."""
    if int(cfg.model.vocab_size) < ARCH_MIN_VOCAB:
        raise UnsupportedError(
            f"model.vocab_size={cfg.model.vocab_size} is too small for a byte-level tokenizer "
            f"(needs >= {ARCH_MIN_VOCAB}) in the weights folder kernels=unsloth loads",
            key="model.vocab_size",
        )


def check_unsloth(cfg: DictConfig) -> None:
    """Raise :class:`UnsupportedError` for what Unsloth cannot do faithfully with our knobs.

    Pure config checks (no import of unsloth): they run before anything is built.
    """
    if cfg.model.source == "arch":
        check_arch_vocab(cfg)
    q = cfg.quant
    if q.bits == 4 and not (q.quant_type == "nf4" and q.double_quant):
        raise UnsupportedError(
            f"kernels=unsloth always quantises 4-bit as NF4 + double quantisation: quant={q.name} would be "
            "measured as nf4_dq",
            key="quant",
            allowed=["nf4_dq", "int8", "none"],
        )
    if q.bits == 4 and q.compute_dtype != cfg.train.dtype:
        raise UnsupportedError(
            f"kernels=unsloth computes 4-bit matmuls in train.dtype={cfg.train.dtype}, not "
            f"quant.compute_dtype={q.compute_dtype}",
            key="quant.compute_dtype",
            allowed=[str(cfg.train.dtype)],
        )
    if cfg.vocab.mode != "full":
        raise UnsupportedError(
            "kernels=unsloth patches the embedding and lm_head itself: vocab slicing is not applied to it",
            key="vocab",
            allowed=["full"],
        )
    if cfg.attention.implementation != "sdpa":
        raise UnsupportedError(
            f"kernels=unsloth chooses its own attention kernel (xformers / flash-attn / SDPA); "
            f"attention={cfg.attention.name} cannot be applied: use attention=sdpa with it",
            key="attention",
            allowed=["sdpa"],
        )


FAULT_KINDS = ("oom", "nan", "error")
FAULT_RE = re.compile(r"^(oom|nan|error)@(\d+)$")


def check_fault_env(environ: dict[str, str] | None = None) -> None:
    """``VRAMSWEEP_FAULT`` (test hook) must be ``oom@<step>``, ``nan@<step>`` or ``error@<step>``."""
    env = os.environ if environ is None else environ
    spec = env.get("VRAMSWEEP_FAULT")
    if spec is None or spec == "":
        return
    if not FAULT_RE.match(spec.strip()):
        raise ConfigError(
            f"VRAMSWEEP_FAULT={spec!r} is not a fault spec",
            key="VRAMSWEEP_FAULT",
            allowed=[f"{k}@<step>" for k in FAULT_KINDS] + ["unset"],
        )


def _rules_module_names(cfg: DictConfig) -> None:
    """Values that name model modules (``adapter.targets``, ``quant.skip_modules``) against the modules
    the architecture has (:mod:`vramsweep.config.modules`)."""
    from vramsweep.config.modules import check_module_names

    check_module_names(cfg)


def validate(cfg: DictConfig, *, machine: bool = True) -> None:
    """Run every rule; raise the first :class:`ConfigError` (or :class:`UnsupportedError`).

    Args:
        cfg: a composed trial config.
        machine: also check what this machine can run (CUDA, optional packages).
    """
    for rule in RULES:
        rule(cfg)
    _rules_module_names(cfg)
    if machine:
        _rules_trial_only(cfg)
        check_machine(cfg)
