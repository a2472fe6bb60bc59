"""Progress lines of a production run whose output is not a terminal (nohup, CI, a SLURM log): one plain
line on stderr every ``train.progress_every_steps`` optimizer steps or ``train.progress_every_s`` seconds,
and at the first and the last step (docs/RUNS.md "Length")::

    vramsweep train: step 12/48  loss 2.3456  tokens/s 1,234  peak 12.3 MiB  ETA 3m12s

On a terminal the progress bar says the same (``vramsweep.training.callbacks.TrialProgress``);
``VRAMSWEEP_PROGRESS=0`` silences both.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from vramsweep.loop import Callback


def duration(seconds: float) -> str:
    """``3m12s``, ``1h04m``, ``42s``."""
    s = int(round(max(seconds, 0.0)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class ProgressLines(Callback):
    """A plain progress line on stderr every ``every_steps`` steps or ``every_s`` seconds (0: that rule
    off), at the first step this process runs and at the last. ``tokens_per_s`` and ``peak_bytes`` are read
    when a line is printed (None: not measured yet)."""

    def __init__(
        self,
        steps: int,
        start: int,
        *,
        every_steps: int,
        every_s: float,
        tokens_per_s: Callable[[], float | None],
        peak_bytes: Callable[[], int | None],
        clock: Callable[[], float] = time.monotonic,
        out: Any = None,
    ):
        self.steps, self.start = int(steps), int(start)
        self.every_steps, self.every_s = max(int(every_steps), 0), max(float(every_s), 0.0)
        self.tokens_per_s, self.peak_bytes = tokens_per_s, peak_bytes
        self.clock, self.out = clock, out
        self.t0 = clock()
        self.last_t: float | None = None

    def _due(self, done: int, now: float) -> bool:
        if self.last_t is None or done >= self.steps:
            return True
        if self.every_steps and done % self.every_steps == 0:
            return True
        return bool(self.every_s) and now - self.last_t >= self.every_s

    def on_loss(self, step: int, loss: float) -> None:
        done, now = step + 1, self.clock()
        if not self._due(done, now):
            return
        self.last_t = now
        print(self.line(done, loss, now), file=self.out or sys.stderr, flush=True)

    def line(self, done: int, loss: float, now: float) -> str:
        parts = [f"step {done}/{self.steps}", f"loss {loss:.4f}"]
        tps = self.tokens_per_s()
        parts.append(f"tokens/s {tps:,.0f}" if tps else "tokens/s n/a (warm-up)")
        peak = self.peak_bytes()
        if peak:
            parts.append(f"peak {peak / 2**20:,.1f} MiB")
        ran = done - self.start
        if ran > 0 and done < self.steps:
            parts.append(f"ETA {duration((now - self.t0) / ran * (self.steps - done))}")
        elif done >= self.steps:
            parts.append(f"done in {duration(now - self.t0)}")
        return "vramsweep train: " + "  ".join(parts)
