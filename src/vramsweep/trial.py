"""One trial: build -> data -> train N optimizer steps -> measure -> record.

The engine is a minimal PEFT loop (forward, backward, clip, optimizer step, scheduler) rather than
TRL's SFTTrainer: not for speed (``bench/overhead.py``, 2026-12-01, CPU: ours / minimal loop 1.009, TRL 1.15
SFTTrainer / minimal 1.084 tokens/s) but for what a trainer hides: tracked warm-up steps, the longest
batch first, per-step pruning hooks and failures turned into statuses. Libraries still do what they
do well: optimizers by name (torch/bitsandbytes/transformers), schedules (``transformers.get_scheduler``),
gradient checkpointing (``gradient_checkpointing_enable``), adapters (PEFT) and tracking (W&B).

Failures never raise out of :func:`run_trial`: they become statuses (docs/CONTRACTS.md) with a reason, and
whatever was measured before the failure is kept.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep import determinism
from vramsweep.config.compose import ConfigError, check_rules, compose
from vramsweep.config.fit import cpu_bf16
from vramsweep.config.rules import refused_point, validate
from vramsweep.data.evalset import eval_set
from vramsweep.data.packing import pack_examples, packing_stats
from vramsweep.data.prep import collate_batch, eval_batches, micro_batches, trial_data
from vramsweep.estimate import estimate
from vramsweep.knobs import build_model, build_optimizer, build_scheduler
from vramsweep.knobs.build import model_source
from vramsweep.knobs.registry import loss_fn
from vramsweep.knobs.vocab_slice import kept_ids, remap_examples
from vramsweep.longctx.loss import causal_lm_of
from vramsweep.loop import Callback, CpuMemoryTracking, Diverged, Every, Loop, Pruned, Timing, fit
from vramsweep.measure import TensorMemoryTracker
from vramsweep.measure.cpu import close_tracker, model_state_tensors, optimizer_state_tensors, tensor_bytes
from vramsweep.measure.cuda import CudaMemoryMonitor
from vramsweep.measure.eval import evaluate
from vramsweep.measure.flops import device_peak, trial_mfu
from vramsweep.measure.initial_eval import for_trial as shared_initial_eval
from vramsweep.measure.quality import QualityMeter
from vramsweep.measure.steps import StepClock, count_cuda_synchronize, install_sync_point
from vramsweep.measure.threads import apply as apply_threads
from vramsweep.preflight import check_host_memory
from vramsweep.production.checkpoint import (
    Checkpointer,
    Resume,
    check_same_config,
    load_newest,
    saved_wandb_id,
)
from vramsweep.production.fingerprint import (
    check_pinned,
    check_resume_data,
    data_fingerprints,
    unverified_line,
)
from vramsweep.production.length import apply_epochs
from vramsweep.production.outputs import LossLog, RunFolder, run_folder_for, save_outputs, write_config
from vramsweep.production.progress import ProgressLines
from vramsweep.record.diskfull import disk_full_reason
from vramsweep.record.failure import classify_exception
from vramsweep.record.hostmem import HostMemoryError, process_rss
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.provenance import collect_meta
from vramsweep.record.result import new_result, write_result
from vramsweep.record.schema import Meta, ResultSchemaError, TrialResult
from vramsweep.record.status import Status
from vramsweep.report.wandb_run import start_logger

Reporter = Callable[[int, float], bool]


def _check_host_memory(cfg: DictConfig, estimated: dict | None) -> None:
    try:
        check_host_memory(cfg, estimated=estimated)  # the trial's own estimate: not computed twice
    except ConfigError as exc:
        raise HostMemoryError(f"not run: {exc}") from None


def _fault(kind: str, step: int) -> None:
    """Test hook: ``VRAMSWEEP_FAULT=oom@1`` / ``nan@2`` / ``error@0`` injects a failure at a step."""
    spec = os.environ.get("VRAMSWEEP_FAULT", "")
    if not spec or "@" not in spec:
        return
    what, at = spec.split("@", 1)
    if what == kind and int(at) == step:
        import torch

        raise {
            "oom": torch.cuda.OutOfMemoryError("CUDA out of memory (injected by VRAMSWEEP_FAULT)"),
            "error": RuntimeError("injected error (VRAMSWEEP_FAULT)"),
        }[kind]


#: the longest run name in UTF-8 bytes (the run folder adds a 23-byte time stamp; a name holds 255 bytes)
RUN_NAME_BYTES = 120


def run_name(overrides: list[str] | tuple[str, ...]) -> str:
    """A run's folder-safe name from its overrides: separators replaced, at most :data:`RUN_NAME_BYTES`
    bytes of UTF-8 (an 80-character CJK file name is 240 bytes: cut at characters, it was ``File name too
    long`` at the result write); a cut name ends in ``-`` and 8 hex digits of the full name's SHA-1, so two
    long names that share a prefix stay two folders."""
    if not overrides:
        return "default"
    keep = [o.replace("/", "_").replace("\\", "_").replace("=", "-").replace(",", "_") for o in overrides]
    name = "".join(c if c.isprintable() and c != "\x00" else "_" for c in "_".join(keep))
    raw = name.encode("utf-8")  # surrogates are not printable: already replaced
    if len(raw) <= RUN_NAME_BYTES:
        return name
    import hashlib

    digest = hashlib.sha1(raw).hexdigest()[:8]
    head = raw[: RUN_NAME_BYTES - 9].decode("utf-8", "ignore")  # "ignore": never half a character
    return f"{head}-{digest}"


def default_result_path(cfg: DictConfig, overrides) -> Path:
    """``<run folder>/result.json``: ``train.output_dir`` when set; with ``train.resume=auto``, the newest
    ``<results_dir>/runs/*_<name>`` of the same overrides (``train.resume`` aside); else a new stamped folder.
    Resuming checks the run's pinned config first (``ConfigError`` naming the keys that differ)."""

    same = [o for o in overrides if not o.lstrip("+").startswith("train.resume=")]
    runs = Path(str(cfg.results_dir)) / "runs"
    folder = None
    if cfg.train.get("output_dir"):
        folder = Path(str(cfg.train.output_dir))
    elif str(cfg.train.get("resume", "never")) == "auto" and runs.is_dir():
        mine = sorted(p for p in runs.iterdir() if p.is_dir() and p.name.endswith(f"_{run_name(same)}"))
        folder = mine[-1] if mine else None
    if folder is not None and str(cfg.train.get("resume", "never")) == "auto":
        check_same_config(folder, OmegaConf.to_container(cfg, resolve=True))
    if folder is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        folder = runs / f"{stamp}_{run_name(same)}"
    return folder / "result.json"


def _peak_key(device: str) -> str | None:
    """A device's row in the FLOP-peak table (``meta.hardware_emulation.physical_key``), or None."""
    row = device_peak(device)
    return row.key if row else None


class _TrialProgress(Callback):
    """A live line for a single trial on a terminal (step k/N, loss, tokens/s, peak, ETA); silent when
    stderr is not a TTY (sweep trials log to files; CI logs stay short) or ``VRAMSWEEP_PROGRESS=0``."""

    def __init__(self, steps: int, cfg: DictConfig, timing: Timing, peak: _PeakRecorder, initial: int = 0):
        import sys

        self.bar = None
        self.cuda = cfg.hardware.device == "cuda"
        self.timing, self.peak = timing, peak
        if sys.stderr.isatty() and os.environ.get("VRAMSWEEP_PROGRESS", "1") != "0":
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=steps, initial=initial, desc="train", unit="step", leave=False, dynamic_ncols=True
            )

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def on_loss(self, step: int, loss: float) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{loss:.3f}"}
        if (tps := self.timing.tokens_per_s()) is not None:
            post["tok/s"] = f"{tps:,.0f}"
        peak = self.peak.bytes
        if self.cuda:
            import torch

            peak = torch.cuda.max_memory_reserved()
        if peak:
            post["peak"] = f"{peak / 2**20:,.1f} MiB"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _WandbRows(Callback):
    """Per-step W&B history: loss, lr, tokens/s so far (timed steps), the step's wall time, memory."""

    def __init__(self, logger, scheduler, timing: Timing, peak: _PeakRecorder):
        self.logger, self.scheduler, self.timing, self.peak = logger, scheduler, timing, peak

    def on_loss(self, step: int, loss: float) -> None:
        row = {"train/loss": loss, "train/lr": self.scheduler.get_last_lr()[0]}
        if self.timing.step_s is not None:
            row[f"train/{M.STEP_TIME_S}"] = self.timing.step_s
        if (tps := self.timing.tokens_per_s()) is not None:
            row[f"train/{M.TOKENS_PER_S}"] = tps
        if self.timing.clock.cuda:
            import torch

            row["memory/allocated_bytes"] = torch.cuda.memory_allocated()
            row["memory/peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        elif self.peak.bytes:
            row["memory/peak_tracked_bytes"] = self.peak.bytes
        self.logger.log(row, step=step + 1)


class _Figures:
    """A callback that owns figures of the result: the metrics and meta entries it measured so far, which
    the trial merges into the result (:func:`_keep_figures`; also when the trial fails)."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def meta(self) -> dict[str, Any]:
        return {}


class _TrainLoss(Callback, _Figures):
    """``metrics.train_loss``: the mean of the last 5 step losses, kept from step 0 and in the timed
    window."""

    def __init__(self, timing: Timing):
        self.timing, self.losses = timing, []
        self.value: float | None = None  # None: no loss kept yet

    def on_loss(self, step: int, loss: float) -> None:
        self.losses.append(loss)
        if self.timing.t_start is not None or step == 0:
            last = self.losses[-5:]
            self.value = sum(last) / len(last)

    def metrics(self) -> dict[str, Any]:
        return {} if self.value is None else {M.TRAIN_LOSS: self.value}


class _PeakRecorder(_Figures):
    """Records the CPU tensor tracker's peak and breakdown when :class:`CpuMemoryTracking` closes it.
    ``bytes``: that peak, or until then ``so_far`` (a resumed run's peak), for the progress line and W&B."""

    def __init__(self, optimizer, so_far: int | None = None):
        self.optimizer, self.bytes = optimizer, so_far
        self.breakdown: dict | None = None  # None: the tracker was not closed
        self.note: str | None = None

    def __call__(self, tracker) -> None:
        self.bytes, self.breakdown, self.note = close_tracker(tracker, self.optimizer)

    def metrics(self) -> dict[str, Any]:
        if self.breakdown is None:
            return {}
        return {
            M.PEAK_MEMORY_BYTES: self.bytes,
            M.MEMORY_BREAKDOWN_BYTES: self.breakdown,
            M.MEMORY_KIND: "cpu_tracked",
        }

    def meta(self) -> dict[str, Any]:
        return {"memory_note": self.note} if self.note else {}


class _PeriodicEval(Every, _Figures):
    """Evaluation every ``train.eval_every`` steps: ``intermediate_eval``, ``eval_loss``/``eval_ppl`` so far,
    W&B ``eval/loss``; a non-finite loss is :class:`Diverged`, the sweeper's verdict may :class:`Pruned`."""

    def __init__(self, cfg: DictConfig, run_eval, timing: Timing, progress, logger, reporter, so_far=()):
        super().__init__(int(cfg.train.eval_every), int(cfg.train.steps), self.evaluate)
        self.run_eval, self.timing, self.progress = run_eval, timing, progress
        self.logger, self.reporter = logger, reporter
        self.say = False  # a production run prints an eval line (stderr) at every evaluation
        self.steps = int(cfg.train.steps)
        self.intermediate: list[dict] = list(so_far)  # a resumed run's: those before its checkpoint
        self.loss: float | None = None  # the last evaluation's loss; None: none yet

    def evaluate(self, step: int) -> None:
        te = time.perf_counter()
        self.progress.phase("eval")
        ev = self.run_eval()
        self.progress.phase("train")
        if self.timing.t_start is not None:
            self.timing.eval_s += time.perf_counter() - te
        self.intermediate.append({"step": step, M.EVAL_LOSS: ev.loss, M.TASK_SCORE: ev.task_score})
        self.loss = ev.loss
        if self.logger is not None:
            self.logger.log({"eval/loss": ev.loss}, step=step)
        if self.say:
            import sys

            line = f"step {step}/{self.steps}  eval_loss {ev.loss:.4f}"
            if self.progress.bar is not None:
                self.progress.bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        if not math.isfinite(ev.loss):
            raise Diverged(f"eval loss is {ev.loss} at optimizer step {step}")
        if self.reporter is not None and self.reporter(step, ev.loss):
            raise Pruned(f"pruned by the sweeper after {step} steps (eval_loss {ev.loss:.4f})")

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {M.INTERMEDIATE_EVAL: self.intermediate}
        if self.loss is not None:
            m[M.EVAL_LOSS], m[M.EVAL_PPL] = self.loss, math.exp(min(self.loss, 50.0))
        return m


def _train(
    cfg: DictConfig, result: dict, reporter: Reporter | None, logger, run: RunFolder | None = None
) -> None:
    """Run :func:`_train_steps` under the CUDA memory monitor (cap, reset, NVML) on CUDA profiles; the
    monitor's meta (cap, allocator settings, per-phase peaks) is recorded even when the trial fails."""
    cuda_mon = None
    if cfg.hardware.device == "cuda":
        cuda_mon = CudaMemoryMonitor(cfg)
        cuda_mon.start()
        result["meta"]["cuda"] = cuda_mon.meta()
    try:
        _train_steps(cfg, result, reporter, logger, cuda_mon, run)
    finally:
        if cuda_mon is not None:
            cuda_mon.stop()
            result["meta"]["cuda"] = cuda_mon.meta()


@dataclass
class Prepared:
    """What :func:`prepare` gives a trial: the built model (``built.model``, ``built.device``, notes), the
    collated training micro-batches and the eval batches."""

    built: Any
    batches: list[dict]
    evals: list
    tokenizer: Any = None  # the base tokenizer (saved with the run's outputs)
    base_path: Any = None  # the weights folder the model was loaded from (None: random weights)


def _kept_vocab(cfg: DictConfig, tokenizer, data) -> list[int] | None:
    """``vocab.mode != full``: the ids the model will actually see (every train and eval example as built,
    after truncation), as the vocab knob keeps them; None for the full vocabulary."""
    if cfg.vocab.mode == "full":
        return None

    seen = [e.input_ids for e in data.train] + [e.input_ids for e in data.eval]
    v = cfg.vocab
    return kept_ids(tokenizer, seen, mode=str(v.mode), top_k=int(v.top_k), reserve=int(v.reserve))


def _remap(cfg: DictConfig, built, data, tokenizer) -> int:
    """Remap the examples to a sliced vocabulary (when the build sliced it); returns the pad id to use."""
    if built.id_map is None:
        return data.pad_id

    fallback, names = str(cfg.vocab.fallback), tokenizer.convert_ids_to_tokens
    data.train = remap_examples(data.train, built.id_map, fallback=fallback, id_to_token=names)
    data.eval = remap_examples(data.eval, built.id_map, fallback=fallback, id_to_token=names)
    return int(built.id_map.encode([data.pad_id])[0])


def _reestimate(cfg: DictConfig, result: dict, first_batch) -> None:
    """Re-estimate at the real longest batch (``micro[0]``) when the config-level estimate succeeded."""
    if result.get("estimate") is None:
        return
    try:
        result["estimate"] = estimate(cfg, seq_len=max(len(e.input_ids) for e in first_batch))
    except Exception as exc:
        result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"


def _rows(cfg: DictConfig, train: list) -> tuple[list, int | None]:
    """The training rows: the examples, or (``data.packing``) the examples packed into rows padded to
    ``context.max_tokens`` (the width); evaluation stays unpacked."""
    if not bool(cfg.data.get("packing", False)):
        return train, None
    width = int(cfg.context.max_tokens)
    return pack_examples(train, width, int(cfg.train.seed)), width


def prepare(cfg: DictConfig, result: dict) -> Prepared:
    """Data -> (vocab slice) -> model -> collated micro-batches and eval batches, as the config says."""

    t = cfg.train
    source = model_source(cfg)  # (weights dir, tokenizer): the tokenizer is loaded once per trial
    tokenizer = source[1]
    data = trial_data(cfg, tokenizer)
    result["meta"]["eval_set"] = eval_set(data.eval, int(t.eval_batches), data.stats)  # before any remap
    n_rows = len(_rows(cfg, data.train)[0])  # examples, or packed rows (data.packing): what an epoch covers
    if (steps := apply_epochs(cfg, n_rows)) is not None:  # train.epochs: the run's length
        result["meta"]["steps_from_epochs"] = {"epochs": float(t.epochs), "steps": steps}
    built = build_model(cfg, keep_ids=_kept_vocab(cfg, tokenizer, data), source=source)
    result["meta"]["build"] = built.notes
    result["meta"]["data"] = data.stats
    pad_id = _remap(cfg, built, data, tokenizer)
    rows, width = _rows(cfg, data.train)
    if width is not None:
        result["meta"]["data"]["packing"] = packing_stats(rows, width)
    micro = micro_batches(rows, int(t.micro_batch), int(t.grad_accum), int(t.steps), int(t.seed))
    _reestimate(cfg, result, micro[0])
    batches = [collate_batch(b, pad_id, width) for b in micro]  # collated up front, like a prefetching loader
    slots = sum(int(b["attention_mask"].numel()) for b in batches)
    result["meta"]["data"]["padding_fraction"] = round(1 - sum(b["n_tokens"] for b in batches) / slots, 4)
    if built.device.type == "cuda":  # pinned host copies: the per-step host->device copy is asynchronous
        for b in batches:
            for k in ("input_ids", "attention_mask", "labels", "position_ids"):
                if k in b:
                    b[k] = b[k].pin_memory()
    evals = eval_batches(data.eval, int(t.eval_batches), pad_id)
    return Prepared(built, batches, evals, tokenizer=tokenizer, base_path=source[0])


class _Faults(Callback):
    """Test hook: ``VRAMSWEEP_FAULT=oom@1`` / ``error@0`` raise before a micro-batch of that step,
    ``nan@2`` makes that step's loss NaN (wraps the loss function)."""

    def __init__(self):
        self.step = -1

    def on_step_start(self, step: int) -> None:
        self.step = step

    def on_micro_batch(self, step: int, batch: dict) -> None:
        _fault("oom", step)
        _fault("error", step)

    def wrap(self, loss_fn):
        def fn(ids, mask, labels, **kw):
            loss = loss_fn(ids, mask, labels, **kw)
            return loss * float("nan") if os.environ.get("VRAMSWEEP_FAULT") == f"nan@{self.step}" else loss

        return fn


class _Grads(Callback):
    """Gradient bytes after step 0's backward (the grads term of ``metrics.state_bytes``)."""

    def __init__(self, params):
        self.params, self.bytes = params, 0

    def on_grads(self, step: int) -> None:
        if step == 0:
            self.bytes = tensor_bytes(p.grad for p in self.params if p.grad is not None)


def liger_sync_point(cfg: DictConfig, model, clock: StepClock):
    """With Liger's fused linear cross-entropy, which calls ``.item()`` as its forward starts (liger-kernel
    0.8.5: a host sync each micro-batch), mark that point on ``clock`` after each decoder forward, so the
    host's wait there is counted as ``loss_sync`` (a wait for the device) instead of forward work; and
    one as each backward starts (its backward's ``torch.equal`` on the incoming gradient: ``backward_sync``).
    Returns the hook's handle, or None."""
    k = cfg.kernels
    if not (bool(k.get("liger", False)) and bool(k.get("liger_fused_linear_cross_entropy", False))):
        return None
    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_decoder = getattr(lm, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None:
        return None
    clock.backward_sync_point = True
    return install_sync_point(clock, decoder)


def _record_throughput(cfg: DictConfig, result: dict, built, timing: Timing) -> None:
    """The timed window's figures: tokens/s, step time, token counts, MFU, per-phase step seconds."""

    m, meta, steps = result["metrics"], result["meta"], int(cfg.train.steps)
    timing.clock.sync()
    measured_steps = steps - timing.timed_from
    if measured_steps > 0:
        meta["step_phases_s"] = timing.clock.per_step(measured_steps, exclude_s=timing.eval_s)
    if timing.timed_from != int(cfg.train.measure_warmup_steps):
        meta["timed_from_step"] = timing.timed_from
    measured_s = timing.train_seconds()
    if measured_s and measured_steps > 0:
        m[M.TOKENS_PER_S] = timing.tokens / measured_s
        m[M.STEP_TIME_S] = measured_s / measured_steps
        m[M.MEASURED_STEPS] = measured_steps
        m[M.TOKENS_TRAINED] = timing.tokens
        m[M.PADDING_TOKENS] = timing.pad_tokens
        m[M.TARGET_TOKENS] = timing.target_tokens
        tps, seq = m[M.TOKENS_PER_S], timing.mean_seq()
        tiled = timing.share_longer_than(int(cfg.tiling.get("mlp_tile_tokens", 0) or 0))
        m[M.MFU] = trial_mfu(cfg, built.notes, tps, seq, meta, model=built.model, tiled_share=tiled)


def _record_memory(result: dict, model, optimizer, grads: _Grads, cuda_mon) -> None:
    """Host memory of offloaded activations, the state bytes (params, grads, optimizer), CUDA peaks."""

    m, meta = result["metrics"], result["meta"]
    offload = getattr(model, "_vramsweep_offload", None)
    if offload is not None:  # checkpointing=offload: the host side of the memory (longctx/offload.py)
        meta["host_memory"] = {
            "pool_bytes": offload.pool_bytes,
            "peak_offloaded_bytes": offload.peak_host_bytes,
            "pinned": offload.cuda,
            "definition": "pool_bytes: the exact-size host pool for the layer inputs (page-locked with "
            "cudaHostRegister on CUDA); peak_offloaded_bytes: the most layer-input bytes held at once",
        }
    m[M.STATE_BYTES] = {
        "params": tensor_bytes(model_state_tensors(model)),
        "grads": grads.bytes,
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)),
    }
    if cuda_mon is not None:
        cuda_mon.stop()
        m.update(cuda_mon.metrics(m[M.STATE_BYTES]))


def _final_eval(result: dict, run_eval, eval_s: float) -> None:
    """The final evaluation: eval loss/ppl, task score, fact vs control quality; ``meta.eval_s``."""

    m = result["metrics"]
    te = time.perf_counter()
    quality = QualityMeter()  # fact vs control token accuracy/NLL (measure/quality.py)
    final = run_eval(quality)
    m.update(quality.metrics())
    eval_s += time.perf_counter() - te
    m[M.EVAL_LOSS], m[M.EVAL_PPL] = final.loss, math.exp(min(final.loss, 50.0))
    m[M.TASK_SCORE], m[M.TASK_SPANS] = final.task_score, final.task_spans
    result["meta"]["eval_s"] = round(eval_s, 3)
    if not math.isfinite(final.loss):
        raise Diverged(f"final eval loss is {final.loss}")


def _data_sources(cfg: DictConfig) -> dict:
    """The hashes ``pick`` pinned beside the data paths checked; the sha256 of every data file (recorded in
    the result and every checkpoint, docs/RUNS.md)."""
    check_pinned(cfg)
    return data_fingerprints(cfg)


def _train_steps(
    cfg: DictConfig, result: dict, reporter: Reporter | None, logger, cuda_mon, run: RunFolder | None = None
) -> None:
    """Prepare, evaluate, :func:`vramsweep.loop.fit` with the trial's callbacks, measure, evaluate; with a
    run folder, log the losses and save the adapter (docs/RUNS.md)."""
    m, meta, t = result["metrics"], result["meta"], cfg.train
    _seed_and_threads(t)
    meta["data_sources"] = _data_sources(cfg)
    prep = prepare(cfg, result)
    model, device = prep.built.model, prep.built.device

    def run_eval(meter=None):
        return evaluate(model, prep.evals, device, causal_lm=causal_lm_of, meter=meter)

    resume = _resume_point(cfg, run, result)
    # one initial eval per sweep and base model (vramsweep.measure.initial_eval)
    eval_s = _initial_eval(m, run_eval, resume, cuda_mon, shared_initial_eval(cfg, prep.evals, result), meta)
    start = resume.next_step if resume is not None else 0

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, meta["optimizer"] = build_optimizer(cfg, params)
    tracker, tracked, timing = _start_training(t, model, optimizer, device, cuda_mon, start)
    steps = int(t.steps)
    liger_sync_point(cfg, model, timing.clock)
    scheduler = build_scheduler(cfg, optimizer)
    if resume is not None:
        resume.apply(model, optimizer, scheduler)
    faults, grads, peak = _Faults(), _Grads(params), _PeakRecorder(optimizer, m.get(M.PEAK_MEMORY_BYTES))
    tracking = CpuMemoryTracking(tracker, tracked, peak)
    progress = _TrialProgress(steps, cfg, timing, peak, initial=start)
    lines = _progress_lines(cfg, run, progress, timing, peak, start)  # no terminal: plain lines (a log)
    wandb_rows = [_WandbRows(logger, scheduler, timing, peak)] if logger is not None else []
    evals = _PeriodicEval(cfg, run_eval, timing, progress, logger, reporter, m.get(M.INTERMEDIATE_EVAL) or ())
    train_loss = _TrainLoss(timing)
    owners, trained, ckpt = (train_loss, evals, peak), (model, optimizer, scheduler), None
    restore_sync = count_cuda_synchronize(timing.clock)  # bitsandbytes' per-parameter syncs: optimizer_sync
    try:
        outputs, ckpt = _run_outputs(cfg, run, resume, train_loss, evals, trained, logger, result, owners)
        step_loss = faults.wrap(loss_fn(cfg, model))  # the model's own, or chunked (tiling.loss_chunk_tokens)
        loop = _trial_loop(
            cfg, prep, trained, loss_fn=step_loss, clock=timing.clock, params=params, start=start
        )
        if resume is not None:
            resume.restore_rng()  # last: nothing from here to the first resumed step draws a random number
        fit(
            loop,
            [tracking, timing, faults, grads, progress, *lines, *wandb_rows, train_loss, evals, *outputs],
        )
        tracking.close()  # every step was a tracked one: keep the tracked peak anyway
    finally:
        restore_sync()
        progress.close()
        if ckpt is not None:
            ckpt.close()
        _keep_figures(result, owners)  # what the callbacks measured, also when the trial failed
    _record_throughput(cfg, result, prep.built, timing)
    _record_memory(result, model, optimizer, grads, cuda_mon)
    _final_eval(result, run_eval, eval_s)
    if run is not None and run.save_adapter:
        meta["outputs"] = save_outputs(run, cfg, model, prep.tokenizer, prep.built.id_map, prep.base_path)


def _start_training(t: DictConfig, model, optimizer, device, cuda_mon, start: int) -> tuple:
    """Train mode, the CUDA monitor's train phase, and the CPU tensor tracker (``None`` on CUDA or resuming),
    how many steps it tracks, and the step timing. Step 0 is always tracked on CPU (so there is a peak however
    ``measure_warmup_steps`` is set); timing starts after the tracked steps (and at the resumed step)."""
    model.train()
    if cuda_mon is not None:
        cuda_mon.phase("train")  # peak_memory_bytes = the training steps' reserved peak
    warm = int(t.measure_warmup_steps)
    tracker = TensorMemoryTracker(model, optimizer) if device.type == "cpu" and start == 0 else None
    tracked = max(warm, 1) if tracker is not None else 0
    return (
        tracker,
        tracked,
        Timing(StepClock(cuda=device.type == "cuda"), timed_from=max(warm, tracked, start)),
    )


def _progress_lines(cfg: DictConfig, run, progress: _TrialProgress, timing: Timing, peak, start: int) -> list:
    """A production run without a progress bar (its output is a log): :class:`ProgressLines`."""
    if run is None or not run.production or progress.bar is not None:
        return []
    if os.environ.get("VRAMSWEEP_PROGRESS", "1") == "0":
        return []

    def peak_bytes() -> int | None:
        if progress.cuda:
            import torch

            return int(torch.cuda.max_memory_reserved())
        return peak.bytes

    t = cfg.train
    every_steps, every_s = int(t.get("progress_every_steps", 0)), float(t.get("progress_every_s", 60))
    return [
        ProgressLines(
            int(t.steps),
            start,
            every_steps=every_steps,
            every_s=every_s,
            tokens_per_s=timing.tokens_per_s,
            peak_bytes=peak_bytes,
        )
    ]


def _trial_loop(
    cfg: DictConfig, prep: Prepared, trained: tuple, *, loss_fn, clock: StepClock, params: list, start: int
) -> Loop:
    """The trial's :class:`~vramsweep.loop.Loop`: ``trained`` (model, optimizer, scheduler) over the prepared
    micro-batches, ``train.steps`` steps of ``train.grad_accum`` micro-batches from step ``start``."""
    model, optimizer, scheduler = trained
    t = cfg.train
    return Loop(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=prep.batches,
        loss_fn=loss_fn,
        device=prep.built.device,
        steps=int(t.steps),
        grad_accum=int(t.grad_accum),
        max_grad_norm=float(t.max_grad_norm),
        clock=clock,
        params=params,
        start_step=start,
    )


def _with_figures(m: dict, owners: tuple[_Figures, ...]) -> dict:
    """The metrics so far: the trial's own, with those its callbacks own."""
    out = dict(m)
    for owner in owners:
        out.update(owner.metrics())
    return out


def _keep_figures(result: dict, owners: tuple[_Figures, ...]) -> None:
    """Merge the figures the callbacks own into the result's metrics and meta."""
    result["metrics"].update(_with_figures({}, owners))
    for owner in owners:
        result["meta"].update(owner.meta())


def _seed_and_threads(t: DictConfig) -> None:
    """``train.seed`` for Python's and torch's generators (``train.threads`` was applied at trial start,
    :func:`vramsweep.measure.threads.apply`)."""
    import torch

    random.seed(int(t.seed))
    torch.manual_seed(int(t.seed))


def _initial_eval(m: dict, run_eval, resume: Resume | None, cuda_mon, shared=(None, ""), meta=None) -> float:
    """The eval before the first step (or, resuming, the run's metrics so far); its seconds. ``shared``:
    the sweep's store of initial evals (:mod:`vramsweep.measure.initial_eval`) and why there is none; what
    happened goes to ``meta["initial_eval"]``."""
    if cuda_mon is not None:
        cuda_mon.phase("initial_eval")  # the build's peak stays in meta.cuda.phases.setup
    t_eval = time.perf_counter()
    store, why_not = shared
    if resume is None:
        stored = store.load() if store is not None else None
        if stored is not None:
            m[M.INITIAL_EVAL_LOSS], m[M.INITIAL_TASK_SCORE] = stored["loss"], stored.get("score")
        else:
            first = run_eval()
            m[M.INITIAL_EVAL_LOSS], m[M.INITIAL_TASK_SCORE] = first.loss, first.task_score
            if store is not None:
                store.store(first.loss, first.task_score, time.perf_counter() - t_eval)
        if meta is not None:
            meta["initial_eval"] = {
                "shared": stored is not None,
                "key": None if store is None else store.key,
                "computed_by_trial": stored.get("trial") if stored is not None else None,
                "not_shared_because": why_not or None,
            }
    else:  # the metrics so far (initial eval, peak of the first steps, intermediate evals) are the run's
        m.update(resume.state["metrics"])
    return time.perf_counter() - t_eval


def _run_outputs(
    cfg: DictConfig,
    run: RunFolder | None,
    resume: Resume | None,
    train_loss: _TrainLoss,
    evals: _PeriodicEval,
    trained: tuple,
    logger,
    result: dict,
    owners: tuple[_Figures, ...],
) -> tuple[list[Callback], Checkpointer | None]:
    """A run folder's callbacks: the loss log, and in a production run the checkpointer (docs/RUNS.md)."""
    if run is None:
        return [], None
    rows = resume.state["losses"] if resume is not None else []
    train_loss.losses = [r["loss"] for r in rows]
    log = LossLog(run, trained[2], rows)
    if not run.production:
        return [log], None
    evals.say = True
    t = cfg.train
    ckpt = Checkpointer(
        run.path,
        int(t.save_every),
        int(t.keep_checkpoints),
        *trained,
        _state_so_far(log, lambda: _with_figures(result["metrics"], owners), logger, result),
        int(t.steps),
        stats=result["meta"].setdefault("checkpoints", {}),
    )
    return [log, ckpt], ckpt


def _resumed_wandb_id(cfg: DictConfig, run: RunFolder | None) -> str | None:
    """The W&B run id to reopen: ``train.resume=auto`` in a production run folder with a checkpoint."""
    if run is None or not run.production or str(cfg.train.resume) != "auto":
        return None
    return saved_wandb_id(run.path)


def _resume_point(cfg: DictConfig, run: RunFolder | None, result: dict) -> Resume | None:
    """``train.resume=auto`` in a run folder with a complete checkpoint: that checkpoint, loaded."""
    if run is None or not run.production or str(cfg.train.resume) != "auto":
        return None
    resume, broken = load_newest(run.path)  # a checkpoint that fails to load: named, the older one used
    for path, why in broken:
        older = f"resuming from {resume.path}" if resume is not None else "no older complete one"
        _say(f"checkpoint {path} cannot be loaded ({why}); moved aside; {older}")
    if resume is None:
        if broken:
            raise RuntimeError(
                f"train.resume=auto: no checkpoint of {run.path} loads (newest: {broken[0][0]})"
            )
        result["meta"]["resumed_from"] = None
        return None
    path = resume.path
    keep_run_threads(cfg, resume.state, result["meta"])
    changes = check_resume_data(path, cfg)  # changed data: refused unless train.resume_on_changed_data
    result["meta"]["resumed_from"] = {"checkpoint": str(path), "next_step": resume.next_step}
    _say(f"resumed from step {resume.next_step} of {int(cfg.train.steps)} (checkpoint {path})")
    if (note := unverified_line(path, changes)) is not None:  # a checkpoint from before data hashes
        _say(note)
    if broken:
        result["meta"]["resumed_from"]["skipped"] = [{"checkpoint": str(p), "why": w} for p, w in broken]
    earlier = list(resume.state.get("data_changes") or [])
    if changes or earlier:  # the opt-in's record: what changed, at which step (kept by later checkpoints)
        now = [{**c, "at_step": resume.next_step} for c in changes]
        result["meta"]["data_changed_on_resume"] = earlier + now
    return resume


def keep_run_threads(cfg: DictConfig, state: dict, meta: dict) -> int | None:
    """A resumed run with ``train.threads=auto`` runs on the torch thread count its checkpoint recorded, not
    on what the load at this start suggests: another count can change the order of float reductions, and a
    resume on CPU is bitwise only on the same count (docs/RUNS.md). Returns the count set, None if nothing
    changed (a fixed ``train.threads``, a checkpoint without the count, or the same count already)."""
    import torch

    n = state.get("threads")
    if str(cfg.train.get("threads", "auto")) != "auto" or not n or torch.get_num_threads() == int(n):
        return None
    why = f"resumed: the run's own count ({int(n)}), not this start's choice ({torch.get_num_threads()})"
    torch.set_num_threads(int(n))
    meta["threads"] = {**(meta.get("threads") or {}), "threads": int(n), "why": why}
    if isinstance(meta.get("timing_conditions"), dict):
        meta["timing_conditions"]["torch_threads"] = int(n)
    return int(n)


def _say(line: str) -> None:
    """One line on stderr for the person watching a production run."""
    import sys

    print(f"vramsweep train: {line}", file=sys.stderr, flush=True)


def _state_so_far(log: LossLog, metrics: Callable[[], dict], logger, result: dict) -> Callable[[], dict]:
    """What a checkpoint keeps besides tensors: the loss rows, the metrics so far, the W&B run id, the run's
    config and its data fingerprints (a resume checks both against them, docs/RUNS.md)."""

    def state() -> dict:
        run_id = getattr(getattr(logger, "run", None), "id", None)
        meta = result["meta"]
        return {
            "losses": list(log.rows),
            "metrics": json.loads(json.dumps(metrics(), default=str)),
            "wandb_run_id": run_id,
            "config": result["config"],
            "data": meta.get("data_sources"),
            "data_changes": meta.get("data_changed_on_resume") or [],
            "threads": (meta.get("threads") or {}).get("threads"),  # a resume with threads=auto keeps it
        }

    return state


def _start_meta(cfg: DictConfig, result: dict, started: datetime) -> Any:
    """Deterministic kernels (first: cuBLAS sizes its workspace at the process's first CUDA use), the torch
    threads (before the meta: it records the count used), then the meta; returns the determinism setting
    (the trial restores it at its end)."""
    det = determinism.apply(cfg)
    threads = apply_threads(cfg.train.get("threads", "auto"))
    result["meta"] = collect_meta(cfg, _peak_key)
    result["meta"]["threads"] = threads.to_json()
    if cfg.hardware.device == "cpu":  # what train.dtype=auto read; bf16 without it is emulated
        result["meta"]["cpu_bf16"] = cpu_bf16()
    result["meta"]["deterministic"] = det.meta
    result["meta"]["started"] = started.isoformat()
    return det


def run_trial(
    cfg: DictConfig,
    *,
    result_path: str | os.PathLike | None = None,
    sweep: str | None = None,
    trial: int | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    reporter: Reporter | None = None,
    design: dict | None = None,
) -> dict:
    """Run one trial: its :class:`~vramsweep.record.schema.TrialResult` is written atomically to
    ``result_path`` and returned as the result dict (``to_json()``; plus ``meta.result_path``).

    A ``train`` run (no ``sweep``/``trial``) keeps its run folder, ``result_path``'s parent: config,
    loss log, adapter, tokenizer (:mod:`vramsweep.production.outputs`).

    Args:
        cfg: the composed trial config (validated here before anything is built).
        result_path: where the result JSON is written; None: written nowhere, only returned (and no run
            folder is kept).
        sweep: the sweep's name: the result's ``sweep`` and the W&B group; with ``trial``, the W&B run is
            named ``<sweep>-<trial:04d>``.
        trial: the trial number within the sweep (None: a ``train`` run, named after its overrides).
        overrides: the Hydra overrides the config was composed from, recorded in the result.
        reporter: called with ``(step, eval_loss)`` after each intermediate evaluation; returning True
            prunes the trial (status ``pruned``).
        design: the sweep design's description of this point (e.g. its role), recorded as ``meta.design``.

    Returns:
        The result dict; a failure is its ``status`` and ``reason``, not an exception (KeyboardInterrupt
        aside).
    """

    started = datetime.now(UTC)
    t0 = time.perf_counter()
    result = new_result(
        sweep=sweep, trial=trial, overrides=list(overrides), config=OmegaConf.to_container(cfg, resolve=True)
    )
    det = _start_meta(cfg, result, started)
    if design is not None:
        result["meta"]["design"] = design
    try:
        result["estimate"] = estimate(cfg)
    except Exception as exc:  # the estimator must never cost a measurement
        result["estimate"] = None
        result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"

    logger = None
    status, reason = Status.OK, None
    try:
        _check_host_memory(
            cfg, result["estimate"]
        )  # before anything is built: a pool that cannot fit is host_oom, not run
        validate(cfg)

        run = run_folder_for(cfg, result_path, sweep_trial=sweep is not None or trial is not None)
        logger = start_logger(
            cfg,
            name=run_name(overrides) if trial is None else f"{sweep}-{trial:04d}",
            group=sweep,
            result=result,
            resume_id=_resumed_wandb_id(cfg, run),
        )
        if run is not None:
            write_config(run, result["config"])
        _train(cfg, result, reporter, logger, run)
    except BaseException as exc:  # noqa: BLE001 - failures are data
        if isinstance(exc, KeyboardInterrupt):
            raise
        status, reason, unexpected = classify_exception(exc)
        if unexpected:  # a bug or a crash: where it happened
            result["meta"]["traceback"] = traceback.format_exc()[-4000:]
    finally:
        det.restore()
    # Recover memory outside the except block (a live traceback pins the tensors).
    return _finish(result, status, reason, logger, t0, result_path)


def _finish(
    result: dict, status: Status, reason: str | None, logger, t0: float, result_path: str | os.PathLike | None
) -> dict:
    """End the trial: collect garbage (and empty the CUDA cache after an OOM), set its status and reason,
    record the process's memory, the load average, wall time and end time, finish the W&B run (when one
    was started), and write the result (when ``result_path`` is given); returns the result dict."""
    gc.collect()
    if status == Status.OOM:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
    result["status"], result["reason"] = status, reason
    _record_rss(result["meta"])
    with contextlib.suppress(OSError, AttributeError, KeyError, TypeError):
        result["meta"]["timing_conditions"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 3)
    result["meta"]["finished"] = datetime.now(UTC).isoformat()
    if logger is not None:
        logger.finish(result)
    record = _record(result)
    if result_path is not None:
        _write(record, result_path)
    return record.to_json()


def _record_rss(meta: dict) -> None:
    """The trial process's resident set at its end and its peak, beside the host pool's figures (the
    headroom the pre-flight keeps for the process, docs/LONG_CONTEXT.md, is checked against this)."""
    host = dict(meta.get("host_memory") or {})
    host.update(process_rss())
    host["rss_definition"] = (
        "peak_rss_bytes: the trial process's peak resident set (VmHWM; a forked trial's starts at the pages "
        "it shares with its fork server); rss_bytes: its resident set when the trial ended (VmRSS)"
    )
    meta["host_memory"] = host


def _record(result: dict) -> TrialResult:
    """The trial's working dict as the typed result that is written and returned (docs/CONTRACTS.md). A
    measurement that breaks the contract is a bug here, not a property of the config: the trial becomes
    ``error`` with a reason naming the key, and keeps its provenance (``meta``) but not its figures."""
    try:
        return TrialResult.from_json(result)
    except ResultSchemaError as exc:
        was = f"; the trial ended {result.get('status')}" + (
            f": {result['reason']}" if result.get("reason") else ""
        )
        record = TrialResult.new(
            status=Status.ERROR,
            reason=f"the result breaks the result contract (docs/CONTRACTS.md): {exc}{was}",
            sweep=result.get("sweep"),
            trial=result.get("trial"),
            overrides=result.get("overrides"),
            config=result.get("config"),
        )
        with contextlib.suppress(ResultSchemaError):
            record.meta = Meta.from_json(result.get("meta"))
        return record


def _write(record: TrialResult, result_path: str | os.PathLike) -> None:
    """Write the result atomically; a full disk turns it into ``error`` with a one-line reason (the
    measurement is lost with the file; the caller gets the status and the reason)."""
    try:
        write_result(result_path, record)
        record.meta.result_path = str(result_path)
    except OSError as exc:  # the measurement is lost with the file: say so, never a traceback
        full = disk_full_reason(exc, result_path)
        why = full or f"cannot write the result {result_path}: {exc.strerror or type(exc).__name__}"
        record.status, record.reason = Status.ERROR, why
        record.meta.result_path = None


def run_trial_overrides(
    overrides: list[str] | tuple[str, ...] = (), *, cfg: DictConfig | None = None, **kw: Any
) -> dict:
    """Compose + validate, then :func:`run_trial` (the sweeper's default trial function).

    A config the rules refuse raises: ``UnsupportedError`` as it is, any other ``ConfigError`` as
    ``UnsupportedError("invalid combination: ...")`` (:func:`~vramsweep.config.rules.refused_point`: a sweep
    records such a point ``unsupported``).

    ``cfg``: the config already composed from ``overrides`` (the sweeper's pre-flight composed it): only
    the rules run, it is not composed again.
    """

    with refused_point():
        if cfg is None:
            cfg = compose(overrides, rules="all")
        else:
            check_rules(cfg, "all")
    return run_trial(cfg, overrides=list(overrides), **kw)
