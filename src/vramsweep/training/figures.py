"""The figures a trial records around training (docs/CONTRACTS.md): the evaluation before the first step,
the start of the training phase (CPU tensor tracker, step timing), the timed window's throughput and MFU,
the state bytes and memory peaks, the final evaluation, and the process's resident set at the end.
"""

from __future__ import annotations

import math
import time

from omegaconf import DictConfig

from vramsweep.loop import Diverged, Timing
from vramsweep.measure import TensorMemoryTracker
from vramsweep.measure.cpu import model_state_tensors, optimizer_state_tensors, tensor_bytes
from vramsweep.measure.flops import trial_mfu
from vramsweep.measure.quality import QualityMeter
from vramsweep.measure.steps import StepClock
from vramsweep.production.checkpoint import Resume
from vramsweep.record.hostmem import process_rss
from vramsweep.record.metrics import MetricName as M
from vramsweep.training.callbacks import Grads


def record_throughput(cfg: DictConfig, result: dict, built, timing: Timing, tiled_share: float = 0.0) -> None:
    """The timed window's figures: tokens/s, step time, token counts, MFU, per-phase step seconds
    (``tiled_share``: the share of timed tokens the tiled MLP split, from the ``mlp_tiles`` knob)."""

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
        m[M.MFU] = trial_mfu(cfg, built.notes, tps, seq, meta, model=built.model, tiled_share=tiled_share)


def record_memory(result: dict, model, optimizer, grads: Grads, cuda_mon) -> None:
    """The state bytes (params, grads, optimizer), CUDA peaks."""

    m = result["metrics"]
    m[M.STATE_BYTES] = {
        "params": tensor_bytes(model_state_tensors(model)),
        "grads": grads.bytes,
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)),
    }
    if cuda_mon is not None:
        cuda_mon.stop()
        m.update(cuda_mon.metrics(m[M.STATE_BYTES]))


def final_eval(result: dict, run_eval, eval_s: float) -> None:
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


def start_training(t: DictConfig, model, optimizer, device, cuda_mon, start: int) -> tuple:
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


def initial_eval(m: dict, run_eval, resume: Resume | None, cuda_mon, shared=(None, ""), meta=None) -> float:
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


def record_rss(meta: dict) -> None:
    """The trial process's resident set at its end and its peak, beside the host pool's figures (the
    headroom the pre-flight keeps for the process, docs/LONG_CONTEXT.md, is checked against this)."""
    host = dict(meta.get("host_memory") or {})
    host.update(process_rss())
    host["rss_definition"] = (
        "peak_rss_bytes: the trial process's peak resident set (VmHWM; a forked trial's starts at the pages "
        "it shares with its fork server); rss_bytes: its resident set when the trial ended (VmRSS)"
    )
    meta["host_memory"] = host
