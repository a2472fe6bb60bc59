"""The trial's callbacks around :func:`vramsweep.loop.fit` (docs/TRIAL.md): a live progress bar, per-step
W&B rows, the train loss, the CPU tracker's peak, the periodic evaluation (divergence and pruning), the
``VRAMSWEEP_FAULT`` test hook and step 0's gradient bytes. A callback that owns figures of the result
(:class:`Figures`) hands them to the trial through :func:`keep_figures`, also when the trial fails.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from omegaconf import DictConfig

from vramsweep.loop import Callback, Diverged, Every, Pruned, Timing
from vramsweep.measure.cpu import close_tracker, tensor_bytes
from vramsweep.record.metrics import MetricName as M


def fault(kind: str, step: int) -> None:
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


class TrialProgress(Callback):
    """A live line for a single trial on a terminal (step k/N, loss, tokens/s, peak, ETA); silent when
    stderr is not a TTY (sweep trials log to files; CI logs stay short) or ``VRAMSWEEP_PROGRESS=0``."""

    def __init__(self, steps: int, cfg: DictConfig, timing: Timing, peak: PeakRecorder, initial: int = 0):
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


class WandbRows(Callback):
    """Per-step W&B history: loss, lr, tokens/s so far (timed steps), the step's wall time, memory."""

    def __init__(self, logger, scheduler, timing: Timing, peak: PeakRecorder):
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


class Figures:
    """A callback that owns figures of the result: the metrics and meta entries it measured so far, which
    the trial merges into the result (:func:`keep_figures`; also when the trial fails)."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def meta(self) -> dict[str, Any]:
        return {}


class TrainLoss(Callback, Figures):
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


class PeakRecorder(Figures):
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


class PeriodicEval(Every, Figures):
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


class Faults(Callback):
    """Test hook: ``VRAMSWEEP_FAULT=oom@1`` / ``error@0`` raise before a micro-batch of that step,
    ``nan@2`` makes that step's loss NaN (wraps the loss function)."""

    def __init__(self):
        self.step = -1

    def on_step_start(self, step: int) -> None:
        self.step = step

    def on_micro_batch(self, step: int, batch: dict) -> None:
        fault("oom", step)
        fault("error", step)

    def wrap(self, loss_fn):
        def fn(ids, mask, labels, **kw):
            loss = loss_fn(ids, mask, labels, **kw)
            return loss * float("nan") if os.environ.get("VRAMSWEEP_FAULT") == f"nan@{self.step}" else loss

        return fn


class Grads(Callback):
    """Gradient bytes after step 0's backward (the grads term of ``metrics.state_bytes``)."""

    def __init__(self, params):
        self.params, self.bytes = params, 0

    def on_grads(self, step: int) -> None:
        if step == 0:
            self.bytes = tensor_bytes(p.grad for p in self.params if p.grad is not None)


def with_figures(m: dict, owners: tuple[Figures, ...]) -> dict:
    """The metrics so far: the trial's own, with those its callbacks own."""
    out = dict(m)
    for owner in owners:
        out.update(owner.metrics())
    return out


def keep_figures(result: dict, owners: tuple[Figures, ...]) -> None:
    """Merge the figures the callbacks own into the result's metrics and meta."""
    result["metrics"].update(with_figures({}, owners))
    for owner in owners:
        result["meta"].update(owner.meta())
