"""One trial: build -> data -> train N optimizer steps -> measure -> record.

The engine is a minimal PEFT loop (forward, backward, clip, optimizer step, scheduler) rather than
TRL's SFTTrainer, which reached only ~0.5x its tokens/s on our CPUs (it also computes token accuracy
and entropy from the full logits every step); see ``bench/overhead.py``. Libraries still do what they
do well: optimizers by name (torch/bitsandbytes/transformers), schedules (``transformers.get_scheduler``),
gradient checkpointing (``gradient_checkpointing_enable``), adapters (PEFT) and tracking (W&B).

Failures never raise out of :func:`run_trial`: they become statuses (DESIGN.md §5) with a reason, and
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
from vramsweep.record.result import atomic_write_json, new_result

Reporter = Callable[[int, float], bool]


class Diverged(RuntimeError):
    pass


class Pruned(RuntimeError):
    pass


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


def collect_meta(cfg: DictConfig) -> dict[str, Any]:
    import platform
    import subprocess

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
    try:
        from vramsweep.config.compose import repo_root

        sha = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except Exception:
        sha = None
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


# --------------------------------------------------------------------------------------------------
# data helpers


def _random_token_data(cfg: DictConfig):
    """Random token sequences of exactly ``context.max_tokens`` (architecture-only models have no tokenizer;
    ``data=random`` asks for them: memory/speed at an exact length, e.g. max-context searches)."""
    import torch

    from vramsweep.data.examples import Example

    g = torch.Generator().manual_seed(int(cfg.data.seed))
    n = max(8, int(cfg.train.micro_batch) * 2)
    L = int(cfg.context.max_tokens)
    V = int(cfg.model.vocab_size)

    def mk(i: int) -> Example:
        ids = torch.randint(3, V, (L,), generator=g).tolist()
        return Example(
            input_ids=ids,
            labels=list(ids),
            doc_id=f"random-{i}",
            target_section=0,
            n_context_tokens=0,
            fact_spans=[],
        )

    from vramsweep.data_prep import TrialData

    return TrialData(
        train=[mk(i) for i in range(n)],
        eval=[mk(n + i) for i in range(4)],
        pad_id=0,
        stats={"random_tokens": True},
    )


def _batches(examples: list, batch_size: int, count: int, seed: int) -> list[list]:
    """``count`` micro-batches cycling through a seeded shuffle; the two longest go first (fail fast:
    an OOM shows on step 0, and the tracked warm-up steps see the worst case)."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    out: list[list] = []
    pos = 0
    while len(out) < count:
        batch = []
        for _ in range(batch_size):
            if pos % len(order) == 0 and pos:
                rng.shuffle(order)
            batch.append(examples[order[pos % len(order)]])
            pos += 1
        out.append(batch)
    lengths = [max(len(e.input_ids) for e in b) for b in out]
    ranked = sorted(range(len(out)), key=lambda i: (-lengths[i], i))
    first = ranked[: min(2, len(out))]
    rest = [i for i in range(len(out)) if i not in first]
    return [out[i] for i in first + rest]


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def _eval_subset(examples: list, n: int) -> list:
    """A fixed held-out subset: up to half of it examples whose target repeats facts (so the task score
    has spans to check), the rest spread evenly over the other examples; original order kept."""
    if len(examples) <= n:
        return list(examples)
    with_facts = [i for i, e in enumerate(examples) if e.fact_spans]
    picked = set(_spread(with_facts, n // 2))
    rest = [i for i in range(len(examples)) if i not in picked]
    picked |= set(_spread(rest, n - len(picked)))
    return [examples[i] for i in sorted(picked)]


# --------------------------------------------------------------------------------------------------
# the loop


EVAL_CHUNK = 1024  # positions per fp32 cross-entropy chunk in evaluate(): bounds eval memory at large vocabs


def evaluate(model, batches: list[dict], device, meter=None) -> tuple[float, float | None, int]:
    """Held-out mean loss over target tokens, and the task score (teacher-forced exact match of the
    fact values the target repeats from earlier sections; None when no spans).

    One sequence at a time, cross-entropy in chunks of :data:`EVAL_CHUNK` positions: the logits are
    ``seq x vocab`` (Qwen3: 4096 x 151936 = 1.2 GB in bf16 per sequence), and a batch of 4 upcast to
    fp32 would take 10 GB, more than the training step it measures on a 16 GB card.

    ``meter`` (a :class:`vramsweep.measure.quality.QualityMeter`) also gets each sequence's per-token NLL and
    argmax, for the fact/control token metrics."""
    import torch

    from vramsweep.longctx.loss import causal_lm_of

    was_training = model.training
    model.eval()
    try:  # decoder + lm_head per chunk: the seq x vocab logits never exist at once (long contexts)
        lm = causal_lm_of(model)
        head = lm.get_output_embeddings()
    except (TypeError, AttributeError):
        lm = head = None
    total, count, hits, spans = 0.0, 0, 0, 0
    with torch.no_grad():
        for b in batches:
            for row in range(b["input_ids"].shape[0]):
                ids = b["input_ids"][row : row + 1].to(device)
                mask = b["attention_mask"][row : row + 1].to(device)
                if head is not None:
                    hidden = lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[
                        0
                    ]
                    logits_at = lambda s, e, h=hidden: head(h[s:e])  # noqa: E731
                else:
                    full = model(input_ids=ids, attention_mask=mask).logits[0]
                    logits_at = lambda s, e, f=full: f[s:e]  # noqa: E731
                labels = b["labels"][row, 1:].to(device)
                n = labels.shape[0]
                preds, nlls = [], []
                for s in range(0, n, EVAL_CHUNK):
                    chunk = labels[s : s + EVAL_CHUNK]
                    logits = logits_at(s, s + chunk.shape[0])
                    nlls.append(
                        torch.nn.functional.cross_entropy(
                            logits.float(), chunk, ignore_index=-100, reduction="none"
                        )
                    )
                    total += float(nlls[-1].sum())
                    count += int((chunk != -100).sum())
                    preds.append(logits.argmax(-1))
                    del logits
                pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=ids.device)
                if meter is not None:
                    meter.add(torch.cat(nlls) if nlls else pred.float(), pred, labels, b["fact_spans"][row])
                logits_at = None
                for start, end in b["fact_spans"][row]:
                    if start < 1 or end > ids.shape[1]:
                        continue
                    spans += 1
                    hits += int(bool((pred[start - 1 : end - 1] == ids[0, start:end]).all()))
    if was_training:
        model.train()
    return total / max(count, 1), (hits / spans if spans else None), spans


def _collate(examples: list, pad_id: int) -> dict:
    from vramsweep.data.examples import collate

    b = collate(examples, pad_id)
    b["fact_spans"] = [list(e.fact_spans) for e in examples]
    # Counted once here, on the host, so the loop never reads device tensors for bookkeeping.
    b["n_tokens"] = int(b["attention_mask"].sum())
    b["n_targets"] = int((b["labels"] != -100).sum())
    b["no_padding"] = b["n_tokens"] == int(b["attention_mask"].numel())
    return b


def _mfu(
    cfg: DictConfig, notes: dict, tokens_per_s: float | None, mean_seq: float, meta: dict
) -> float | None:
    """MFU against the physical GPU that ran the steps (not the emulated profile's card); null on CPU."""
    if cfg.hardware.device != "cuda":
        return None
    from vramsweep.measure.flops import flops_per_token, mfu

    per_token = flops_per_token(
        total_params=int(notes.get("total_params", 0)),
        trainable_params=int(notes.get("trainable_params", 0)),
        num_layers=int(cfg.model.num_layers),
        attn_width=int(cfg.model.num_heads) * int(cfg.model.head_dim),
        mean_seq=mean_seq,
        recompute=bool(cfg.checkpointing.enabled),
    )
    value, info = mfu(per_token, tokens_per_s, meta.get("device"))
    meta["mfu"] = info
    return value


def _close_tracker(tracker, optimizer, m: dict, meta: dict) -> None:
    """Record the CPU tracker's peak. Optimizer state that did not exist yet at the tracked peak (AdamW
    creates it in the first ``optimizer.step()``, after step 0's forward/backward) is alive during every
    later step, so it is added to the peak and its breakdown."""
    from vramsweep.measure.cpu import optimizer_state_tensors, tensor_bytes

    tracker.close()
    peak, breakdown = int(tracker.peak_bytes), tracker.breakdown()
    state = tensor_bytes(optimizer_state_tensors(optimizer))
    missing = state - int(breakdown.get("optimizer", 0))
    if missing > 0:
        peak += missing
        breakdown["optimizer"] = state
        meta["memory_note"] = (
            f"optimizer state ({missing / 2**20:.2f} MiB) was created by the first optimizer step, after the "
            "tracked forward/backward peak; it is alive in every later step, so it is added to the peak"
        )
    m["peak_memory_bytes"] = peak
    m["memory_kind"] = "cpu_tracked"
    m["memory_breakdown_bytes"] = breakdown


def _step_log(loss, scheduler, tokens, t_measure, eval_s, t_step, m, cuda) -> dict:
    """Per-step W&B history: loss, lr, tokens/s so far (timed steps), this step's wall time, memory."""
    row = {
        "train/loss": loss,
        "train/lr": scheduler.get_last_lr()[0],
        "train/step_time_s": time.perf_counter() - t_step,
    }
    if t_measure is not None and tokens:
        elapsed = time.perf_counter() - t_measure - eval_s
        if elapsed > 0:
            row["train/tokens_per_s"] = tokens / elapsed
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

    def step(
        self, step: int, loss: float, tokens: int, t_measure: float | None, eval_s: float, m: dict
    ) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{loss:.3f}"}
        if t_measure is not None and tokens:
            elapsed = time.perf_counter() - t_measure - eval_s
            if elapsed > 0:
                post["tok/s"] = f"{tokens / elapsed:,.0f}"
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


def _train_steps(cfg: DictConfig, result: dict, reporter: Reporter | None, logger, cuda_mon) -> None:
    import torch

    from vramsweep.data_prep import EVAL_BATCH, build_trial_data
    from vramsweep.knobs import build_model, build_optimizer, build_scheduler
    from vramsweep.knobs.model import model_source
    from vramsweep.measure import TensorMemoryTracker
    from vramsweep.measure.cpu import model_state_tensors, optimizer_state_tensors, tensor_bytes
    from vramsweep.measure.steps import StepClock

    m = result["metrics"]
    t = cfg.train
    if int(t.threads) > 0:
        torch.set_num_threads(int(t.threads))
    random.seed(int(t.seed))
    torch.manual_seed(int(t.seed))

    _, tokenizer = model_source(cfg)
    random_tokens = tokenizer is None or cfg.data.source == "random"
    data = _random_token_data(cfg) if random_tokens else build_trial_data(cfg, tokenizer)
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
    built = build_model(cfg, keep_ids=keep_ids)
    model, device = built.model, built.device
    result["meta"]["build"] = built.notes
    result["meta"]["data"] = data.stats
    pad_id = data.pad_id
    if built.id_map is not None:
        from vramsweep.knobs.vocab import remap_examples

        fallback = str(cfg.vocab.fallback)
        names = tokenizer.convert_ids_to_tokens
        data.train = remap_examples(data.train, built.id_map, fallback=fallback, id_to_token=names)
        data.eval = remap_examples(data.eval, built.id_map, fallback=fallback, id_to_token=names)
        pad_id = int(built.id_map.encode([pad_id])[0])

    ga, mb = int(t.grad_accum), int(t.micro_batch)
    micro = _batches(data.train, mb, int(t.steps) * ga, int(t.seed))
    batches = [_collate(b, pad_id) for b in micro]  # collated up front, like a prefetching loader
    if result.get("estimate") is not None:  # re-estimate at the real longest batch (micro[0])
        try:
            from vramsweep.estimate import estimate

            result["estimate"] = estimate(cfg, seq_len=max(len(e.input_ids) for e in micro[0]))
        except Exception as exc:
            result["meta"]["estimate_error"] = f"{type(exc).__name__}: {exc}"
    eval_batches = [
        _collate(chunk, pad_id)
        for chunk in (lambda ex: [ex[i : i + EVAL_BATCH] for i in range(0, len(ex), EVAL_BATCH)])(
            _eval_subset(data.eval, int(t.eval_batches) * EVAL_BATCH)
        )
    ]

    if cuda_mon is not None:
        cuda_mon.phase("initial_eval")  # the build's peak stays in meta.cuda.phases.setup
    t_eval = time.perf_counter()
    init_loss, init_task, _ = evaluate(model, eval_batches, device)
    m["initial_eval_loss"] = init_loss
    m["initial_task_score"] = init_task
    eval_s = time.perf_counter() - t_eval

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, opt_notes = build_optimizer(cfg, params)
    scheduler = build_scheduler(cfg, optimizer)
    result["meta"]["optimizer"] = opt_notes
    model.train()

    warm = int(t.measure_warmup_steps)
    tracker = TensorMemoryTracker(model, optimizer) if device.type == "cpu" else None
    # The CPU tracker costs a Python call per op, so it never runs during timed steps: step 0 is always
    # tracked (so there is a peak however train.measure_warmup_steps is set), and timing starts after it.
    tracked = max(warm, 1) if tracker is not None else 0
    timed_from = max(warm, tracked)
    if cuda_mon is not None:
        cuda_mon.phase("train")  # peak_memory_bytes = the training steps' reserved peak
    cuda = device.type == "cuda"
    if cuda:  # pinned host copies: the per-step host->device copy is asynchronous
        for b in batches:
            for k in ("input_ids", "attention_mask", "labels"):
                b[k] = b[k].pin_memory()
    from vramsweep.longctx.apply import loss_fn

    compute_loss = loss_fn(cfg, model)  # the model's own loss, or the chunked one (tiling.loss_chunk_tokens)
    clock = StepClock(cuda=cuda)
    progress = _TrialProgress(int(t.steps), cfg)
    tokens = pad_tokens = target_tokens = 0
    losses: list[float] = []
    grad_bytes = 0
    intermediate: list[dict] = []
    m["intermediate_eval"] = intermediate
    t_measure = None
    eval_in_measure = 0.0
    seq_sum = seq_n = 0
    for step in range(int(t.steps)):
        t_step = time.perf_counter()
        if step == tracked and tracker is not None:
            _close_tracker(tracker, optimizer, m, result["meta"])
            tracker = None
        if step == timed_from:
            clock.sync()  # nothing queued from the untimed steps is charged to the timed ones
            t_measure = time.perf_counter()
            clock.start()
        timed = t_measure is not None
        ctx = tracker if tracker is not None else contextlib.nullcontext()
        with ctx:
            step_loss_t = None
            for k in range(ga):
                _fault("oom", step)
                _fault("error", step)
                batch = batches[step * ga + k]
                with clock.phase("h2d", timed):
                    ids = batch["input_ids"].to(device, non_blocking=cuda)
                    labels = batch["labels"].to(device, non_blocking=cuda)
                    # No padding in this batch: no mask, so SDPA can take its causal fast path (flash).
                    mask = (
                        None if batch["no_padding"] else batch["attention_mask"].to(device, non_blocking=cuda)
                    )
                with clock.phase("forward", timed):
                    # Keep only the loss: holding the output would pin the logits through backward.
                    loss = compute_loss(ids, mask, labels) / ga
                    if os.environ.get("VRAMSWEEP_FAULT") == f"nan@{step}":
                        loss = loss * float("nan")
                with clock.phase("backward", timed):
                    loss.backward()
                # Summed on the device: no host sync per micro-batch.
                step_loss_t = loss.detach() if step_loss_t is None else step_loss_t + loss.detach()
                if timed:
                    n_tok = batch["n_tokens"]
                    tokens += n_tok
                    pad_tokens += int(batch["attention_mask"].numel()) - n_tok
                    target_tokens += batch["n_targets"]
                    seq_sum += n_tok
                    seq_n += ids.shape[0]
                del loss
            if step == 0:
                grad_bytes = tensor_bytes(p.grad for p in params if p.grad is not None)
            with clock.phase("optimizer", timed):
                if float(t.max_grad_norm) > 0:
                    torch.nn.utils.clip_grad_norm_(params, float(t.max_grad_norm))
                if tracker is not None:
                    with tracker.optimizer_phase():
                        optimizer.step()
                else:
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            # One host sync per optimizer step, after the step's kernels are queued (the loss of a
            # diverged step is NaN whether we look before or after the update; the trial ends either way).
            with clock.phase("sync_wait", timed):
                step_loss = float(step_loss_t)
        if not math.isfinite(step_loss):
            raise Diverged(f"train loss is {step_loss} at optimizer step {step}")
        losses.append(step_loss)
        progress.step(step, step_loss, tokens, t_measure, eval_in_measure, m)
        if logger is not None:
            logger.log(
                _step_log(step_loss, scheduler, tokens, t_measure, eval_in_measure, t_step, m, cuda),
                step=step + 1,
            )
        ee = int(t.eval_every)
        if ee and (step + 1) % ee == 0 and step + 1 < int(t.steps):
            te = time.perf_counter()
            progress.phase("eval")
            ev, task, _ = evaluate(model, eval_batches, device)
            progress.phase("train")
            eval_in_measure += time.perf_counter() - te if timed else 0.0
            intermediate.append({"step": step + 1, "eval_loss": ev, "task_score": task})
            m["eval_loss"] = ev
            m["eval_ppl"] = math.exp(min(ev, 50.0))
            if logger is not None:
                logger.log({"eval/loss": ev}, step=step + 1)
            if not math.isfinite(ev):
                raise Diverged(f"eval loss is {ev} at optimizer step {step + 1}")
            if reporter is not None and reporter(step + 1, ev):
                raise Pruned(f"pruned by the sweeper after {step + 1} steps (eval_loss {ev:.4f})")
        if timed or step == 0:
            m["train_loss"] = sum(losses[-5:]) / len(losses[-5:])
    if tracker is not None:  # every step was a tracked one: keep the tracked peak anyway
        _close_tracker(tracker, optimizer, m, result["meta"])
    clock.sync()
    progress.close()
    measured_steps = int(t.steps) - timed_from
    if measured_steps > 0:
        result["meta"]["step_phases_s"] = clock.per_step(measured_steps, exclude_s=eval_in_measure)
    if timed_from != warm:
        result["meta"]["timed_from_step"] = timed_from
    measured_s = (time.perf_counter() - t_measure - eval_in_measure) if t_measure is not None else None
    if measured_s and measured_steps > 0:
        m["tokens_per_s"] = tokens / measured_s
        m["step_time_s"] = measured_s / measured_steps
        m["measured_steps"] = measured_steps
        m["tokens_trained"] = tokens
        m["padding_tokens"] = pad_tokens
        m["target_tokens"] = target_tokens
        m["mfu"] = _mfu(cfg, built.notes, m["tokens_per_s"], seq_sum / max(seq_n, 1), result["meta"])
    m["state_bytes"] = {
        "params": tensor_bytes(model_state_tensors(model)),
        "grads": grad_bytes,
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)),
    }
    if cuda_mon is not None:
        cuda_mon.stop()
        m.update(cuda_mon.metrics(m["state_bytes"]))

    te = time.perf_counter()
    from vramsweep.measure.quality import QualityMeter

    quality = QualityMeter()  # fact vs control token accuracy/NLL (measure/quality.py)
    final, task, n_spans = evaluate(model, eval_batches, device, meter=quality)
    m.update(quality.metrics())
    eval_s += time.perf_counter() - te
    m["eval_loss"] = final
    m["eval_ppl"] = math.exp(min(final, 50.0))
    m["task_score"] = task
    m["task_spans"] = n_spans
    result["meta"]["eval_s"] = round(eval_s, 3)
    if not math.isfinite(final):
        raise Diverged(f"final eval loss is {final}")


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
        if _is_oom(exc):
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
        atomic_write_json(result_path, result)
        result["meta"]["result_path"] = str(result_path)
    return result


def run_trial_overrides(overrides: list[str] | tuple[str, ...] = (), **kw: Any) -> dict:
    """Compose + validate (ConfigError propagates), then :func:`run_trial`."""
    from vramsweep.config import compose

    cfg = compose(list(overrides), validate_rules=True)
    return run_trial(cfg, overrides=list(overrides), **kw)
