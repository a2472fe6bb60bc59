"""One trial, the recipe: compose -> data -> build -> batches -> fit N optimizer steps -> measure -> record.

* compose: :func:`run_trial_overrides` (the rules), :func:`run_trial` (meta, estimate, host memory, W&B);
* data -> build -> batches: :func:`prepare` (the knobs' ``data`` hooks: vocab's remap, packing once);
* fit: :func:`_train_steps` with the callbacks of :mod:`vramsweep.training.callbacks` (a production run's
  resume, checkpoints and loss log: :mod:`vramsweep.production.run`);
* measure: the knobs' ``measure`` hooks and :mod:`vramsweep.training.figures`;
* record: :func:`_finish` (status, the typed result, written atomically).

The engine is a minimal PEFT loop (forward, backward, clip, optimizer step, scheduler) rather than
TRL's SFTTrainer: not for speed (``bench/overhead.py``, 2026-12-06, idle CPU, 8 rounds: ours / minimal loop
0.907 [0.644-1.311], TRL 1.15 SFTTrainer / minimal 0.951 [0.653-1.196] tokens/s, within the machine's
round-to-round spread: docs/TRIAL.md) but for what a trainer hides: tracked warm-up steps, the longest
batch first, per-step pruning hooks and failures turned into statuses. Libraries still do what they
do well: optimizers by name (torch/bitsandbytes/transformers), schedules (``transformers.get_scheduler``),
gradient checkpointing (``gradient_checkpointing_enable``), adapters (PEFT) and tracking (W&B).

Failures never raise out of :func:`run_trial`: they become statuses (docs/CONTRACTS.md) with a reason, and
whatever was measured before the failure is kept.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep import determinism
from vramsweep.config.compose import ConfigError, check_rules, compose
from vramsweep.config.fit import cpu_bf16
from vramsweep.config.rules import refused_point, validate
from vramsweep.data.evalset import eval_set
from vramsweep.data.prep import collate_batch, eval_batches, micro_batches, trial_data
from vramsweep.estimate import estimate
from vramsweep.knobs import build_model, build_optimizer, build_scheduler
from vramsweep.knobs.build import model_source
from vramsweep.knobs.registry import Batching, Measuring, loss_fn, run_data, run_measure
from vramsweep.longctx.loss import causal_lm_of
from vramsweep.loop import CpuMemoryTracking, fit
from vramsweep.measure.cuda import CudaMemoryMonitor
from vramsweep.measure.eval import evaluate
from vramsweep.measure.flops import device_peak
from vramsweep.measure.initial_eval import for_trial as shared_initial_eval
from vramsweep.measure.steps import count_cuda_synchronize
from vramsweep.measure.threads import apply as apply_threads
from vramsweep.preflight import check_host_memory
from vramsweep.production import run as production
from vramsweep.production.length import apply_epochs
from vramsweep.production.outputs import RunFolder, run_folder_for, save_outputs, write_config
from vramsweep.production.run import (  # noqa: F401 - re-exported (cli, sweeper.production_run)
    RUN_NAME_BYTES,
    default_result_path,
    keep_run_threads,
    run_name,
)
from vramsweep.record.diskfull import disk_full_reason
from vramsweep.record.failure import classify_exception
from vramsweep.record.hostmem import HostMemoryError
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.provenance import collect_meta
from vramsweep.record.result import new_result, write_result
from vramsweep.record.schema import Meta, ResultSchemaError, TrialResult
from vramsweep.record.status import Status
from vramsweep.report.wandb_run import start_logger
from vramsweep.training import callbacks as cb
from vramsweep.training import figures
from vramsweep.training import fit as training_fit

Reporter = Callable[[int, float], bool]


# ---- compose: the config's rules, the trial's meta and estimate, the host-memory check, W&B, the run folder
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
            resume_id=production.resumed_wandb_id(cfg, run),
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


def _peak_key(device: str) -> str | None:
    """A device's row in the FLOP-peak table (``meta.hardware_emulation.physical_key``), or None."""
    row = device_peak(device)
    return row.key if row else None


def _check_host_memory(cfg: DictConfig, estimated: dict | None) -> None:
    try:
        check_host_memory(cfg, estimated=estimated)  # the trial's own estimate: not computed twice
    except ConfigError as exc:
        raise HostMemoryError(f"not run: {exc}") from None


# --------------------------- the trial under the CUDA memory monitor: data -> build -> batches, fit, measure
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


def _train_steps(
    cfg: DictConfig, result: dict, reporter: Reporter | None, logger, cuda_mon, run: RunFolder | None = None
) -> None:
    """Data -> build -> batches (:func:`prepare`), the initial eval, fit (:func:`_fit`), measure (the knobs'
    ``measure`` hooks, throughput, memory), the final eval; with a run folder, save the adapter
    (docs/RUNS.md)."""
    m, meta = result["metrics"], result["meta"]
    training_fit.seed(cfg.train)
    meta["data_sources"] = production.data_sources(cfg)
    prep = prepare(cfg, result)
    model, device = prep.built.model, prep.built.device

    def run_eval(meter=None):
        return evaluate(model, prep.evals, device, causal_lm=causal_lm_of, meter=meter)

    resume = production.resume_point(cfg, run, result)
    # one initial eval per sweep and base model (vramsweep.measure.initial_eval)
    shared = shared_initial_eval(cfg, prep.evals, result)
    eval_s = figures.initial_eval(m, run_eval, resume, cuda_mon, shared, meta)
    optimizer, timing, grads = _fit(cfg, result, prep, run_eval, resume, (reporter, logger, cuda_mon, run))
    ends = run_measure(cfg, Measuring("train_end", model, timing.clock, timing, meta))  # offload, tiling
    figures.record_throughput(cfg, result, prep.built, timing, **ends.mfu)
    figures.record_memory(result, model, optimizer, grads, cuda_mon)
    figures.final_eval(result, run_eval, eval_s)
    if run is not None and run.save_adapter:
        meta["outputs"] = save_outputs(run, cfg, model, prep.tokenizer, prep.built.id_map, prep.base_path)


# ---------------------------------------------------------------------------------- data -> build -> batches
@dataclass
class Prepared:
    """What :func:`prepare` gives a trial: the built model (``built.model``, ``built.device``, notes), the
    collated training micro-batches and the eval batches."""

    built: Any
    batches: list[dict]
    evals: list
    tokenizer: Any = None  # the base tokenizer (saved with the run's outputs)
    base_path: Any = None  # the weights folder the model was loaded from (None: random weights)


def prepare(cfg: DictConfig, result: dict) -> Prepared:
    """Data -> build -> batches: the trial's examples; the model built for them (vocab slicing keeps the ids
    they use); the examples as the loop reads them (the knobs' data hooks: vocab's remap, then packing,
    once); the run's length (``train.epochs`` over those rows); the collated micro-batches and eval
    batches."""
    t, meta = cfg.train, result["meta"]
    path, tokenizer = source = model_source(cfg)  # the tokenizer is loaded once per trial
    data = trial_data(cfg, tokenizer)
    meta["eval_set"] = eval_set(data.eval, int(t.eval_batches), data.stats)  # before any remap
    built = build_model(cfg, corpus=[*data.train, *data.eval], source=source)
    meta["build"], meta["data"] = built.notes, data.stats
    rows = Batching(data.train, data.eval, data.pad_id, tokenizer=tokenizer, id_map=built.id_map)
    meta["data"].update(run_data(cfg, rows))  # meta.data.packing: the packed rows
    if (steps := apply_epochs(cfg, len(rows.train))) is not None:  # train.epochs: examples or packed rows
        meta["steps_from_epochs"] = {"epochs": float(t.epochs), "steps": steps}
    batches = _batches(cfg, result, rows, built.device)
    evals = eval_batches(rows.eval, int(t.eval_batches), rows.pad_id)
    return Prepared(built, batches, evals, tokenizer=tokenizer, base_path=path)


def _batches(cfg: DictConfig, result: dict, rows: Batching, device) -> list[dict]:
    """The training micro-batches, collated up front like a prefetching loader (pinned host copies on CUDA:
    the per-step host->device copy is asynchronous); the estimate at the real longest batch;
    ``meta.data.padding_fraction``."""
    t = cfg.train
    micro = micro_batches(rows.train, int(t.micro_batch), int(t.grad_accum), int(t.steps), int(t.seed))
    _reestimate(cfg, result, micro[0])
    batches = [collate_batch(b, rows.pad_id, rows.width) for b in micro]
    slots = sum(int(b["attention_mask"].numel()) for b in batches)
    result["meta"]["data"]["padding_fraction"] = round(1 - sum(b["n_tokens"] for b in batches) / slots, 4)
    if device.type == "cuda":
        for b in batches:
            for k in ("input_ids", "attention_mask", "labels", "position_ids"):
                if k in b:
                    b[k] = b[k].pin_memory()
    return batches


def _reestimate(cfg: DictConfig, result: dict, first_batch) -> None:
    """Re-estimate at the real longest batch (``micro[0]``) when the config-level estimate succeeded."""
    if result.get("estimate") is None:
        return
    try:
        result["estimate"] = estimate(cfg, seq_len=max(len(e.input_ids) for e in first_batch))
    except Exception as exc:
        result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------------------------- fit
def _fit(
    cfg: DictConfig, result: dict, prep: Prepared, run_eval, resume: production.Resume | None, around: tuple
):
    """Fit: the optimizer and schedule (a resumed run's state applied), the trial's callbacks, then
    :func:`vramsweep.loop.fit`. ``around``: (reporter, W&B logger, CUDA monitor, run folder). Returns
    (optimizer, step timing, gradient bytes) for the measure phase; the callbacks' figures are kept in
    ``result`` also when training fails."""
    reporter, logger, cuda_mon, run = around
    m, meta, t, model = result["metrics"], result["meta"], cfg.train, prep.built.model
    start = resume.next_step if resume is not None else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, meta["optimizer"] = build_optimizer(cfg, params)
    tracker, tracked, timing = figures.start_training(t, model, optimizer, prep.built.device, cuda_mon, start)
    run_measure(cfg, Measuring("train_start", model, clock=timing.clock))  # Liger's sync points
    scheduler = build_scheduler(cfg, optimizer)
    if resume is not None:
        resume.apply(model, optimizer, scheduler)
    faults, grads = cb.Faults(), cb.Grads(params)
    peak = cb.PeakRecorder(optimizer, m.get(M.PEAK_MEMORY_BYTES))
    tracking = CpuMemoryTracking(tracker, tracked, peak)
    progress = cb.TrialProgress(int(t.steps), cfg, timing, peak, initial=start)
    lines = production.progress_lines(cfg, run, progress, timing, peak, start)  # no terminal: a log's lines
    wandb_rows = [cb.WandbRows(logger, scheduler, timing, peak)] if logger is not None else []
    so_far = m.get(M.INTERMEDIATE_EVAL) or ()
    evals = cb.PeriodicEval(cfg, run_eval, timing, progress, logger, reporter, so_far)
    train_loss = cb.TrainLoss(timing)
    owners, trained, ckpt = (train_loss, evals, peak), (model, optimizer, scheduler), None
    restore_sync = count_cuda_synchronize(timing.clock)  # bitsandbytes' per-parameter syncs: optimizer_sync
    try:
        outputs, ckpt = production.run_outputs(
            cfg, run, resume, (train_loss, evals), trained, logger, result, lambda: cb.with_figures(m, owners)
        )
        step_loss = faults.wrap(loss_fn(cfg, model))  # the model's own, or chunked (tiling.loss_chunk_tokens)
        loop = training_fit.trial_loop(
            cfg,
            prep.batches,
            prep.built.device,
            trained,
            loss_fn=step_loss,
            clock=timing.clock,
            params=params,
            start=start,
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
        cb.keep_figures(result, owners)  # what the callbacks measured, also when the trial failed
    return optimizer, timing, grads


# ---------------------------------------------------------------------------------------------------- record
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
    figures.record_rss(result["meta"])
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
