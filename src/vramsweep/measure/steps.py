"""Where a training step's time goes, measured on the host without adding synchronisations.

:class:`StepClock` times the phases of the *timed* steps with ``perf_counter`` (a few hundred ns each):
``h2d`` (host->device copies), ``forward``, ``backward``, ``optimizer`` (clip + step + schedule + zero),
``sync_wait`` (reading the previous step's loss once this step is issued: the host waiting for the
device; see ``vramsweep.loop.fit``) and ``other``
(everything else in the loop: bookkeeping, logging, progress). On CUDA the first four are the time the
host spends *issuing* work (Python, dispatch, kernel launches), not GPU time: when ``sync_wait`` is
near zero the device waited for the host (a host-bound step: Python/launch overhead dominates, so
step time hardly grows with tokens); when it is large the device was the bottleneck. On CPU every phase
is compute. Recorded per step in ``meta.step_phases_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("h2d", "forward", "backward", "optimizer", "sync_wait")


class StepClock:
    """Accumulates host seconds per phase over the timed steps."""

    def __init__(self, *, cuda: bool = False):
        self.cuda = cuda
        self.total = dict.fromkeys(PHASES, 0.0)
        self.t0: float | None = None

    def sync(self) -> None:
        """Wait for queued device work (only at the edges of the timed window)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def running(self) -> bool:
        """True once :meth:`start` was called (the timed steps)."""
        return self.t0 is not None

    @contextmanager
    def phase(self, name: str, on: bool | None = None) -> Iterator[None]:
        """Time ``name`` when ``on`` (default: while the clock is :attr:`running`)."""
        if on is None:
            on = self.running
        if not on:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t

    def per_step(self, steps: int, exclude_s: float = 0.0) -> dict[str, float]:
        """Mean seconds per timed step by phase, ``other`` the rest of the step, ``step`` the whole."""
        if self.t0 is None or steps <= 0:
            return {}
        wall = max(0.0, time.perf_counter() - self.t0 - exclude_s) / steps
        out = {k: v / steps for k, v in self.total.items()}
        out["other"] = max(0.0, wall - sum(out.values()))
        out["step"] = wall
        out["host_bound"] = bool(self.cuda and wall > 0 and out["sync_wait"] < 0.1 * wall)
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}
