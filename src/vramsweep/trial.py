"""One trial: build -> data -> train N optimizer steps -> measure -> record.

The engine is a minimal PEFT loop (forward, backward, clip, optimizer step, scheduler) rather than
TRL's SFTTrainer, which reached only ~0.5x its tokens/s on our CPUs (it also computes token accuracy
and entropy from the full logits every step); see ``bench/overhead.py``. Libraries still do what they
do well: optimizers by name (torch/bitsandbytes/transformers), schedules (``transformers.get_scheduler``),
gradient checkpointing (``gradient_checkpointing_enable``), adapters (PEFT) and tracking (W&B).

Failures never raise out of :func:`run_trial`: they become statuses (docs/CONTRACTS.md) with a reason, and
whatever was measured before the failure is kept.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.compose import ConfigError
from vramsweep.loop import Callback, Diverged, Pruned
from vramsweep.record.result import new_result, write_result
from vramsweep.record.status import Status

Reporter = Callable[[int, float], bool]


def _is_host_oom(exc: BaseException) -> bool:
    """Host (pinned) memory for offloaded activations ran out: not a device OOM."""
    from vramsweep.longctx.offload import HostMemoryError

    return isinstance(exc, HostMemoryError)


def _check_host_memory(cfg: DictConfig) -> None:
    from vramsweep.longctx.offload import HostMemoryError
    from vramsweep.preflight import check_host_memory

    try:
        check_host_memory(cfg)
    except ConfigError as exc:
        raise HostMemoryError(f"not run: {exc}") from None


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _fault(kind: str, step: int) -> None:
    """Test hook: ``VRAMSWEEP_FAULT=oom@1`` / ``nan@2`` / ``error@0`` injects a failure at a step."""
    spec = os.environ.get("VRAMSWEEP_FAULT", "")
    if not spec or "@" not in spec:
        return
    what, at = spec.split("@", 1)
    if what == kind and int(at) == step:
        import torch

        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by VRAMSWEEP_FAULT)")
        if kind == "error":
            raise RuntimeError("injected error (VRAMSWEEP_FAULT)")


def run_name(overrides: list[str] | tuple[str, ...]) -> str:
    if not overrides:
        return "default"
    keep = [o.replace("/", "_").replace("=", "-").replace(",", "_") for o in overrides]
    name = "_".join(keep)
    return name[:120]


def default_result_path(cfg: DictConfig, overrides) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(str(cfg.results_dir)) / "runs" / f"{stamp}_{run_name(overrides)}" / "result.json"


def source_revision() -> str | None:
    """The git commit of the vramsweep source that runs, when it runs from a git checkout of vramsweep
    (not of whatever repository an installed copy happens to sit in)."""
    import subprocess

    pkg = Path(__file__).resolve().parent
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=pkg,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.splitlines()
    except Exception:
        return None
    if len(top) != 2 or Path(top[0]).resolve() / "src" / "vramsweep" != pkg:
        return None
    return top[1]


def collect_meta(cfg: DictConfig) -> dict[str, Any]:
    import platform

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    # Versions from package metadata: importing unsloth would patch transformers in every trial, and
    # liger_kernel pulls in Triton; neither should happen just to read a version number.
    from importlib.metadata import PackageNotFoundError, version

    for mod, dist in (
        ("transformers", "transformers"),
        ("peft", "peft"),
        ("bitsandbytes", "bitsandbytes"),
        ("optuna", "optuna"),
        ("hydra", "hydra-core"),
        ("omegaconf", "omegaconf"),
        ("wandb", "wandb"),
        ("liger_kernel", "liger-kernel"),
        ("unsloth", "unsloth"),
        ("flash_attn", "flash-attn"),
        ("triton", "triton"),
    ):
        try:
            versions[mod] = version(dist)
        except PackageNotFoundError:
            continue
    sha = source_revision()
    emulated = None
    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device())
        from vramsweep.measure.flops import device_peak

        row = device_peak(device)
        # The profile names a card; the device is what ran. They differ when a bigger GPU emulates the
        # profile's memory (meta.cuda.cap says whether the cap was applied).
        emulated = {
            "profile": str(cfg.hardware.name),
            "physical_device": device,
            "physical_key": row.key if row else None,
            "emulated": not (row is not None and str(cfg.hardware.name).startswith(row.key + "_")),
        }
    else:
        device = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()})"
    return {
        "device": device,
        "hardware_profile": cfg.hardware.name,
        "hardware_emulation": emulated,
        "timing_conditions": timing_conditions(cfg),
        "versions": versions,
        "git_sha": sha,
        "seed": int(cfg.train.seed),
        "hostname": platform.node(),
        "pid": os.getpid(),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def timing_conditions(cfg: DictConfig) -> dict[str, Any]:
    """What can disturb a throughput figure, recorded beside it: load average (1/5/15 min), CPU count,
    torch threads, and on CUDA the other processes on the GPU (NVML; none when NVML is unavailable)."""
    import torch

    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with contextlib.suppress(OSError, AttributeError):
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if cfg.hardware.device == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                out["other_gpu_processes"] = sum(1 for p in procs if p.pid != os.getpid())
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # NVML missing or no permission: say so, do not guess
            out["other_gpu_processes"] = None
            out["nvml_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    return out


def _step_log(loss: float, scheduler, timing, m: dict, cuda: bool) -> dict:
    """Per-step W&B history: loss, lr, tokens/s so far (timed steps), the step's wall time, memory."""
    row = {"train/loss": loss, "train/lr": scheduler.get_last_lr()[0]}
    if timing.step_s is not None:
        row["train/step_time_s"] = timing.step_s
    if (tps := timing.tokens_per_s()) is not None:
        row["train/tokens_per_s"] = tps
    if cuda:
        import torch

        row["memory/allocated_bytes"] = torch.cuda.memory_allocated()
        row["memory/peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    elif m.get("peak_memory_bytes"):
        row["memory/peak_tracked_bytes"] = m["peak_memory_bytes"]
    return row


class _TrialProgress:
    """A live line for a single trial on a terminal (step k/N, loss, tokens/s, peak, ETA); silent when
    stderr is not a TTY (sweep trials log to files; CI logs stay short) or ``VRAMSWEEP_PROGRESS=0``."""

    def __init__(self, steps: int, cfg: DictConfig):
        import sys

        self.bar = None
        self.cuda = cfg.hardware.device == "cuda"
        if sys.stderr.isatty() and os.environ.get("VRAMSWEEP_PROGRESS", "1") != "0":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc="train", unit="step", leave=False, dynamic_ncols=True)

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def step(self, step: int, loss: float, timing, m: dict) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{loss:.3f}"}
        if (tps := timing.tokens_per_s()) is not None:
            post["tok/s"] = f"{tps:,.0f}"
        peak = m.get("peak_memory_bytes")
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


def _train(cfg: DictConfig, result: dict, reporter: Reporter | None, logger) -> None:
    """Run :func:`_train_steps` under the CUDA memory monitor (cap, reset, NVML) on CUDA profiles; the
    monitor's meta (cap, allocator settings, per-phase peaks) is recorded even when the trial fails."""
    cuda_mon = None
    if cfg.hardware.device == "cuda":
        from vramsweep.measure.cuda import CudaMemoryMonitor

        cuda_mon = CudaMemoryMonitor(cfg)
        cuda_mon.start()
        result["meta"]["cuda"] = cuda_mon.meta()
    try:
        _train_steps(cfg, result, reporter, logger, cuda_mon)
    finally:
        if cuda_mon is not None:
            cuda_mon.stop()
            result["meta"]["cuda"] = cuda_mon.meta()


def _prepare(cfg: DictConfig, result: dict):
    """Data -> (vocab slice) -> model -> collated micro-batches and eval batches, as the config says."""
    from vramsweep.data_prep import collate_batch, eval_batches, micro_batches, trial_data
    from vramsweep.knobs import build_model
    from vramsweep.knobs.model import model_source

    t = cfg.train
    source = model_source(cfg)  # (weights dir, tokenizer): the tokenizer is loaded once per trial
    tokenizer = source[1]
    data = trial_data(cfg, tokenizer)
    keep_ids = None
    if cfg.vocab.mode != "full":
        from vramsweep.knobs.vocab import kept_ids

        # The ids the model will actually see: every train and eval example as built (after truncation).
        seen = [e.input_ids for e in data.train] + [e.input_ids for e in data.eval]
        keep_ids = kept_ids(
            tokenizer,
            seen,
            mode=str(cfg.vocab.mode),
            top_k=int(cfg.vocab.top_k),
            reserve=int(cfg.vocab.reserve),
        )
    built = build_model(cfg, keep_ids=keep_ids, source=source)
    result["meta"]["build"] = built.notes
    result["meta"]["data"] = data.stats
    pad_id = data.pad_id
    if built.id_map is not None:
        from vramsweep.knobs.vocab import remap_examples

        fallback, names = str(cfg.vocab.fallback), tokenizer.convert_ids_to_tokens
        data.train = remap_examples(data.train, built.id_map, fallback=fallback, id_to_token=names)
        data.eval = remap_examples(data.eval, built.id_map, fallback=fallback, id_to_token=names)
        pad_id = int(built.id_map.encode([pad_id])[0])
    micro = micro_batches(data.train, int(t.micro_batch), int(t.steps) * int(t.grad_accum), int(t.seed))
    if result.get("estimate") is not None:  # re-estimate at the real longest batch (micro[0])
        try:
            from vramsweep.estimate import estimate

            result["estimate"] = estimate(cfg, seq_len=max(len(e.input_ids) for e in micro[0]))
        except Exception as exc:
            result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"
    batches = [collate_batch(b, pad_id) for b in micro]  # collated up front, like a prefetching loader
    if built.device.type == "cuda":  # pinned host copies: the per-step host->device copy is asynchronous
        for b in batches:
            for k in ("input_ids", "attention_mask", "labels"):
                b[k] = b[k].pin_memory()
    return built, batches, eval_batches(data.eval, int(t.eval_batches), pad_id)


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
        def fn(ids, mask, labels):
            loss = loss_fn(ids, mask, labels)
            return loss * float("nan") if os.environ.get("VRAMSWEEP_FAULT") == f"nan@{self.step}" else loss

        return fn


class _Grads(Callback):
    """Gradient bytes after step 0's backward (the grads term of ``metrics.state_bytes``)."""

    def __init__(self, params):
        self.params, self.bytes = params, 0

    def on_grads(self, step: int) -> None:
        if step == 0:
            from vramsweep.measure.cpu import tensor_bytes

            self.bytes = tensor_bytes(p.grad for p in self.params if p.grad is not None)


def _train_steps(cfg: DictConfig, result: dict, reporter: Reporter | None, logger, cuda_mon) -> None:
    """Prepare, evaluate, :func:`vramsweep.loop.fit` with the trial's callbacks, measure, evaluate."""
    import torch

    from vramsweep.knobs import build_optimizer, build_scheduler
    from vramsweep.knobs.registry import loss_fn
    from vramsweep.longctx.loss import causal_lm_of
    from vramsweep.loop import CpuMemoryTracking, Every, Loop, OnLoss, Timing, fit
    from vramsweep.measure import TensorMemoryTracker
    from vramsweep.measure.cpu import (
        close_tracker,
        model_state_tensors,
        optimizer_state_tensors,
        tensor_bytes,
    )
    from vramsweep.measure.eval import evaluate
    from vramsweep.measure.flops import trial_mfu
    from vramsweep.measure.quality import QualityMeter
    from vramsweep.measure.steps import StepClock

    m, meta, t = result["metrics"], result["meta"], cfg.train
    if int(t.threads) > 0:
        torch.set_num_threads(int(t.threads))
    random.seed(int(t.seed))
    torch.manual_seed(int(t.seed))
    built, batches, evals = _prepare(cfg, result)
    model, device = built.model, built.device

    def run_eval(meter=None):
        return evaluate(model, evals, device, causal_lm=causal_lm_of, meter=meter)

    if cuda_mon is not None:
        cuda_mon.phase("initial_eval")  # the build's peak stays in meta.cuda.phases.setup
    t_eval = time.perf_counter()
    first = run_eval()
    m["initial_eval_loss"], m["initial_task_score"] = first.loss, first.task_score
    eval_s = time.perf_counter() - t_eval

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, meta["optimizer"] = build_optimizer(cfg, params)
    model.train()
    if cuda_mon is not None:
        cuda_mon.phase("train")  # peak_memory_bytes = the training steps' reserved peak
    steps, warm = int(t.steps), int(t.measure_warmup_steps)
    tracker = TensorMemoryTracker(model, optimizer) if device.type == "cpu" else None
    # Step 0 is always tracked on CPU (so there is a peak however measure_warmup_steps is set); timing
    # starts after the tracked steps.
    tracked = max(warm, 1) if tracker is not None else 0
    timing = Timing(StepClock(cuda=device.type == "cuda"), timed_from=max(warm, tracked))

    def record_peak(tr) -> None:
        m["peak_memory_bytes"], m["memory_breakdown_bytes"], note = close_tracker(tr, optimizer)
        m["memory_kind"] = "cpu_tracked"
        if note:
            meta["memory_note"] = note

    def periodic_eval(step: int) -> None:
        te = time.perf_counter()
        progress.phase("eval")
        ev = run_eval()
        progress.phase("train")
        if timing.t_start is not None:
            timing.eval_s += time.perf_counter() - te
        m["intermediate_eval"].append({"step": step, "eval_loss": ev.loss, "task_score": ev.task_score})
        m["eval_loss"], m["eval_ppl"] = ev.loss, math.exp(min(ev.loss, 50.0))
        if logger is not None:
            logger.log({"eval/loss": ev.loss}, step=step)
        if not math.isfinite(ev.loss):
            raise Diverged(f"eval loss is {ev.loss} at optimizer step {step}")
        if reporter is not None and reporter(step, ev.loss):
            raise Pruned(f"pruned by the sweeper after {step} steps (eval_loss {ev.loss:.4f})")

    losses: list[float] = []

    def after_step(step: int, loss: float) -> None:
        losses.append(loss)
        progress.step(step, loss, timing, m)
        if logger is not None:
            logger.log(_step_log(loss, scheduler, timing, m, timing.clock.cuda), step=step + 1)
        if timing.t_start is not None or step == 0:
            m["train_loss"] = sum(losses[-5:]) / len(losses[-5:])

    scheduler = build_scheduler(cfg, optimizer)
    faults, grads = _Faults(), _Grads(params)
    tracking = CpuMemoryTracking(tracker, tracked, record_peak)
    m["intermediate_eval"] = []
    progress = _TrialProgress(steps, cfg)
    loop = Loop(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        # the model's own loss, or the chunked one (tiling.loss_chunk_tokens)
        loss_fn=faults.wrap(loss_fn(cfg, model)),
        device=device,
        steps=steps,
        grad_accum=int(t.grad_accum),
        max_grad_norm=float(t.max_grad_norm),
        clock=timing.clock,
        params=params,
    )
    try:
        fit(
            loop,
            [
                tracking,
                timing,
                faults,
                grads,
                OnLoss(after_step),
                Every(int(t.eval_every), steps, periodic_eval),
            ],
        )
    finally:
        progress.close()
    tracking.close()  # every step was a tracked one: keep the tracked peak anyway
    timing.clock.sync()
    measured_steps = steps - timing.timed_from
    if measured_steps > 0:
        meta["step_phases_s"] = timing.clock.per_step(measured_steps, exclude_s=timing.eval_s)
    if timing.timed_from != warm:
        meta["timed_from_step"] = timing.timed_from
    measured_s = timing.train_seconds()
    if measured_s and measured_steps > 0:
        m["tokens_per_s"] = timing.tokens / measured_s
        m["step_time_s"] = measured_s / measured_steps
        m["measured_steps"] = measured_steps
        m["tokens_trained"] = timing.tokens
        m["padding_tokens"] = timing.pad_tokens
        m["target_tokens"] = timing.target_tokens
        m["mfu"] = trial_mfu(cfg, built.notes, m["tokens_per_s"], timing.mean_seq(), meta, model=model)
    offload = getattr(model, "_vramsweep_offload", None)
    if offload is not None:  # checkpointing=offload: the host side of the memory (longctx/offload.py)
        meta["host_memory"] = {
            "pool_bytes": offload.pool_bytes,
            "peak_offloaded_bytes": offload.peak_host_bytes,
            "pinned": offload.cuda,
            "definition": "pool_bytes: the exact-size host pool for the layer inputs (page-locked with "
            "cudaHostRegister on CUDA); peak_offloaded_bytes: the most layer-input bytes held at once",
        }
    m["state_bytes"] = {
        "params": tensor_bytes(model_state_tensors(model)),
        "grads": grads.bytes,
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)),
    }
    if cuda_mon is not None:
        cuda_mon.stop()
        m.update(cuda_mon.metrics(m["state_bytes"]))

    te = time.perf_counter()
    quality = QualityMeter()  # fact vs control token accuracy/NLL (measure/quality.py)
    final = run_eval(quality)
    m.update(quality.metrics())
    eval_s += time.perf_counter() - te
    m["eval_loss"], m["eval_ppl"] = final.loss, math.exp(min(final.loss, 50.0))
    m["task_score"], m["task_spans"] = final.task_score, final.task_spans
    meta["eval_s"] = round(eval_s, 3)
    if not math.isfinite(final.loss):
        raise Diverged(f"final eval loss is {final.loss}")


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
    """Run one trial and return its result dict (also written atomically to ``result_path``)."""
    from vramsweep.config.rules import UnsupportedError, validate

    started = datetime.now(UTC)
    t0 = time.perf_counter()
    result = new_result(
        sweep=sweep, trial=trial, overrides=list(overrides), config=OmegaConf.to_container(cfg, resolve=True)
    )
    result["meta"] = collect_meta(cfg)
    result["meta"]["started"] = started.isoformat()
    if design is not None:
        result["meta"]["design"] = design
    try:
        from vramsweep.estimate import estimate

        result["estimate"] = estimate(cfg)
    except Exception as exc:  # the estimator must never cost a measurement
        result["estimate"] = None
        result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"

    logger = None
    status, reason, oom = "ok", None, False
    try:
        _check_host_memory(cfg)  # before anything is built: a pool that cannot fit is host_oom, not run
        validate(cfg)
        from vramsweep.report.wandb_run import start_logger

        logger = start_logger(
            cfg,
            name=run_name(overrides) if trial is None else f"{sweep}-{trial:04d}",
            group=sweep,
            result=result,
        )
        _train(cfg, result, reporter, logger)
    except UnsupportedError as exc:
        status, reason = "unsupported", str(exc)
    except ConfigError as exc:
        status, reason = "error", f"config: {exc}"
    except Diverged as exc:
        status, reason = "diverged", str(exc)
    except Pruned as exc:
        status, reason = "pruned", str(exc)
    except BaseException as exc:  # noqa: BLE001 - failures are data
        if isinstance(exc, KeyboardInterrupt):
            raise
        from vramsweep.record.diskfull import disk_full_reason

        if (full := disk_full_reason(exc)) is not None:
            status, reason = Status.ERROR.value, full  # one line, no traceback: the disk, not the config
        elif _is_host_oom(exc):
            status, reason = Status.HOST_OOM.value, f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}"
        elif _is_oom(exc):
            status, reason, oom = "oom", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", True
        else:
            status, reason = "error", f"{type(exc).__name__}: {str(exc)[:500]}"
            result["meta"]["traceback"] = traceback.format_exc()[-4000:]
    # Recover memory outside the except block (a live traceback pins the tensors).
    gc.collect()
    if oom:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
    result["status"], result["reason"] = status, reason
    with contextlib.suppress(OSError, AttributeError, KeyError, TypeError):
        result["meta"]["timing_conditions"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 3)
    result["meta"]["finished"] = datetime.now(UTC).isoformat()
    if logger is not None:
        logger.finish(result)
    if result_path is not None:
        try:
            write_result(result_path, result)
            result["meta"]["result_path"] = str(result_path)
        except OSError as exc:
            from vramsweep.record.diskfull import disk_full_reason

            full = disk_full_reason(exc, result_path)
            if full is None:
                raise
            # the measurement is lost with the file; the caller gets the status and the one-line reason
            result["status"], result["reason"] = Status.ERROR.value, full
            result["meta"]["result_path"] = None
    return result


def run_trial_overrides(
    overrides: list[str] | tuple[str, ...] = (), *, cfg: DictConfig | None = None, **kw: Any
) -> dict:
    """Compose + validate (ConfigError propagates), then :func:`run_trial`.

    ``cfg``: the config already composed from ``overrides`` (the sweeper's pre-flight composed it): only
    the rules run, it is not composed again.
    """
    from vramsweep.config.compose import check_rules, compose

    if cfg is None:
        cfg = compose(overrides, rules="all")
    else:
        check_rules(cfg, "all")
    return run_trial(cfg, overrides=list(overrides), **kw)
