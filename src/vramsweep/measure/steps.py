"""Where a training step's time goes, on the host and on the device, without adding synchronisations.

:class:`StepClock` times the phases of the *timed* steps with ``perf_counter`` (a few hundred ns each):
``h2d`` (host->device copies), ``forward``, ``backward``, ``optimizer`` (clip + step + schedule + zero),
``sync_wait`` (reading the previous step's loss once this step is issued: the host waiting for the
device; see ``vramsweep.loop.fit``), ``loss_sync`` (the host blocked at a sync point inside the forward:
Liger's fused linear cross-entropy calls ``.item()`` there, liger-kernel 0.8.5) and ``other`` (everything
else in the loop: bookkeeping, logging, progress). On CUDA the host phases are the time the host spends
*issuing* work (Python, dispatch, kernel launches), not GPU time.

Device time comes from CUDA events: each phase records one before and one after its work on the current
stream (``record()`` only queues a marker: no sync), and so does each step (``begin_step`` /
``end_step``). A step's events are read (``elapsed_time``) at the end of a later step, once ``query()``
says they completed (the loop's loss read has waited for that step by then), or at the timed window's
closing sync: nothing inside a step waits for them. ``device_s`` is the mean device seconds per phase
between its two events, and ``step`` from the step's first event to its last.

A sync point (:meth:`StepClock.sync_point`, recorded just before Liger's loss) is an event plus the host
time it was recorded at; the host then blocks until the device reaches it, which takes the device's lag
there: the event's device time (against an anchor event recorded on an idle device when the window starts)
minus the host time. That wait is ``loss_sync``, taken out of ``forward`` (the host's issuing). A step is
``host_bound`` when the host waited for the device (``sync_wait`` + ``loss_sync``) under 10 % of the step:
the device waited for the host (Python/launch overhead dominates, so step time hardly grows with tokens).
On CPU every phase is compute and there are no events. Recorded per step in ``meta.step_phases_s``.

Other host waits inside a phase are taken out of it the same way (issue 53), so that ``host_bound`` is
true only when the host really did not wait:

* ``backward_sync``: a sync point as the backward starts (:attr:`StepClock.backward_sync_point`; Liger's
  fused loss backward calls ``torch.equal`` on the incoming gradient, liger-kernel 0.8.5: a second host
  sync per micro-batch), taken out of ``backward``;
* ``optimizer_sync`` (and the other phases' ``torch.cuda.synchronize`` calls): bitsandbytes' 8-bit and
  paged optimizers call ``torch.cuda.synchronize()`` after every parameter (``Optimizer8bit.step`` ->
  ``sync_gpu``; 504 calls a step for Qwen3-8B LoRA r16). :meth:`StepClock.count_synchronize` wraps the
  module's ``synchronize`` for the timed window: the host seconds blocked in it (a wait for the device, by
  definition) are taken out of the phase that called it and counted in ``sync_calls`` (calls per step by
  phase). The optimizer's host time is then issuing + ``optimizer_sync``, and its device time is
  ``device_s.optimizer``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("h2d", "forward", "backward", "optimizer", "sync_wait")
#: The phases that queue device work (timed with events on CUDA).
DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")
#: Where the host's waits inside a device phase are reported (taken out of that phase's host seconds).
SYNC_KEYS = {
    "h2d": "h2d_sync",
    "forward": "loss_sync",
    "backward": "backward_sync",
    "optimizer": "optimizer_sync",
}


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _cuda_synchronize() -> None:
    import torch

    torch.cuda.synchronize()


class _Step:
    """The events of one issued step: its first and last, each phase's pairs, its sync points."""

    __slots__ = ("begin", "end", "phases", "syncs")

    def __init__(self, begin: Any):
        self.begin, self.end = begin, None
        self.phases: list[tuple[str, Any, Any]] = []
        self.syncs: list[tuple[Any, float, str]] = []  # (event, host time, phase)

    def events(self) -> list:
        return [
            self.begin,
            self.end,
            *(e for _, a, b in self.phases for e in (a, b)),
            *(e for e, _, _ in self.syncs),
        ]


class StepClock:
    """Accumulates host seconds per phase over the timed steps and, with events (CUDA), device seconds.

    Args:
        cuda: the steps run on a CUDA device (events and the window's syncs are CUDA's).
        event: a factory of timing events (``record``, ``query``, ``elapsed_time`` in ms); CUDA's by default
            on CUDA, none elsewhere. Tests pass a fake.
        synchronize: waits for all queued device work (the window's edges only).
        timer: the host clock (seconds).
    """

    def __init__(
        self,
        *,
        cuda: bool = False,
        event: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.cuda = cuda
        self._event = event if event is not None else (_cuda_event if cuda else None)
        self._synchronize = synchronize if synchronize is not None else (_cuda_synchronize if cuda else None)
        self._now = timer
        self.total = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(DEVICE_PHASES, 0.0)  # host seconds blocked at sync points, by phase
        self.blocked = dict.fromkeys(DEVICE_PHASES, 0.0)  # host seconds inside counted synchronize calls
        self.sync_calls = dict.fromkeys(DEVICE_PHASES, 0)  # counted synchronize calls, by phase
        self.backward_sync_point = False  # a sync point as each backward starts (Liger's fused loss)
        self._current: str | None = None  # the device phase running now (for the synchronize counter)
        self.device = dict.fromkeys((*DEVICE_PHASES, "step"), 0.0)
        self.device_steps = 0  # steps whose events were read
        self.t0: float | None = None
        self._anchor: tuple[Any, float] | None = None
        self._step: _Step | None = None
        self._issued: deque[_Step] = deque()
        self._pool: list = []

    def sync(self) -> None:
        """Wait for queued device work (only at the edges of the timed window)."""
        if self._synchronize is not None:
            self._synchronize()

    def _record(self) -> Any:
        ev = self._pool.pop() if self._pool else self._event()
        ev.record()
        return ev

    def start(self) -> None:
        """Open the timed window (after :meth:`sync`: the device is idle, so the anchor event's device time
        is the host time it is recorded at)."""
        if self._event is not None:
            self._anchor = (self._record(), self._now())
        self.t0 = self._now()

    @property
    def running(self) -> bool:
        """True once :meth:`start` was called (the timed steps)."""
        return self.t0 is not None

    @property
    def events(self) -> bool:
        """Device events are recorded (CUDA, in the timed window)."""
        return self._anchor is not None

    def begin_step(self) -> None:
        """Before a step's first micro-batch: its first event."""
        if self.events:
            self._step = _Step(self._record())

    def end_step(self) -> None:
        """After a step's optimizer phase: its last event; the step waits to be read (:meth:`collect`)."""
        if self._step is not None:
            self._step.end = self._record()
            self._issued.append(self._step)
            self._step = None

    @property
    def loss_sync(self) -> float:
        """Host seconds blocked at the forward's sync points (Liger's in-forward ``.item()``)."""
        return self.waits["forward"]

    def sync_point(self) -> None:
        """Just before a host sync inside a phase (Liger's loss): an event, the host time and the phase."""
        if self._step is not None:
            self._step.syncs.append((self._record(), self._now(), self._current or "forward"))

    def count_synchronize(self, module: Any) -> Callable[[], None]:
        """Wrap ``module.synchronize`` (``torch.cuda``) so that, inside a timed device phase, the host
        seconds it blocks and the calls are counted for that phase; returns the function that restores it."""
        real = module.synchronize

        def synchronize(*args, **kwargs):
            phase = self._current if self.running else None
            if phase is None:
                return real(*args, **kwargs)
            t = self._now()
            try:
                return real(*args, **kwargs)
            finally:
                self.blocked[phase] += self._now() - t
                self.sync_calls[phase] += 1

        module.synchronize = synchronize

        def restore() -> None:
            module.synchronize = real

        return restore

    def collect(self) -> None:
        """Read the events of the issued steps that completed (``query()``: never waits), oldest first."""
        while self._issued and self._issued[0].end.query():
            self._read(self._issued.popleft())

    def _read(self, step: _Step) -> None:
        for name, a, b in step.phases:
            self.device[name] += a.elapsed_time(b) / 1e3
        self.device["step"] += step.begin.elapsed_time(step.end) / 1e3
        anchor, t_anchor = self._anchor
        for ev, t_host, phase in step.syncs:
            self.waits[phase] += max(0.0, t_anchor + anchor.elapsed_time(ev) / 1e3 - t_host)
        self.device_steps += 1
        self._pool.extend(step.events())

    @contextmanager
    def phase(self, name: str, on: bool | None = None) -> Iterator[None]:
        """Time ``name`` when ``on`` (default: while the clock is :attr:`running`); inside a step with
        events, a device phase also records an event before and after its work."""
        if on is None:
            on = self.running
        if not on:
            yield
            return
        step = self._step if name in DEVICE_PHASES else None
        a = self._record() if step is not None else None
        t = self._now()
        outer, self._current = self._current, (name if name in DEVICE_PHASES else None)
        if name == "backward" and self.backward_sync_point:
            self.sync_point()
        try:
            yield
        finally:
            self._current = outer
            self.total[name] += self._now() - t
            if step is not None:
                step.phases.append((name, a, self._record()))

    def per_step(self, steps: int, exclude_s: float = 0.0) -> dict[str, Any]:
        """Mean seconds per timed step by phase, ``other`` the rest of the step, ``step`` the whole;
        ``device_s`` (events: after the window's closing :meth:`sync`) the device's seconds by phase."""
        if self.t0 is None or steps <= 0:
            return {}
        self.collect()
        wall = max(0.0, self._now() - self.t0 - exclude_s) / steps
        out: dict[str, Any] = {k: v / steps for k, v in self.total.items()}
        n = max(self.device_steps, 1)
        for phase, key in SYNC_KEYS.items():
            # sync points are read per step with events; synchronize calls are timed on every timed step
            wait = self.waits[phase] / n + self.blocked[phase] / steps
            out[key] = min(out[phase], wait)
            out[phase] -= out[key]
        out["other"] = max(0.0, wall - sum(out.values()))
        out["step"] = wall
        waited = out["sync_wait"] + sum(out[k] for k in SYNC_KEYS.values())
        out["host_bound"] = bool(self.cuda and wall > 0 and waited < 0.1 * wall)
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}
        if any(self.sync_calls.values()):
            out["sync_calls"] = {k: round(v / steps, 3) for k, v in self.sync_calls.items() if v}
        if self.device_steps:
            out["device_s"] = {k: round(v / self.device_steps, 6) for k, v in self.device.items()}
        return out


def install_sync_point(clock: StepClock, module: Any) -> Any:
    """Record a sync point on ``clock`` after each forward of ``module`` (the decoder stack whose output
    Liger's fused loss syncs on at once). Returns the hook's handle."""

    def hook(_module, _args, _output):
        clock.sync_point()

    return module.register_forward_hook(hook)


def count_cuda_synchronize(clock: StepClock) -> Callable[[], None]:
    """On a CUDA clock, count ``torch.cuda.synchronize`` calls and their host wait per phase
    (:meth:`StepClock.count_synchronize`; bitsandbytes' optimizers call it per parameter); returns the
    function that restores it (a no-op elsewhere)."""
    if not clock.cuda:
        return lambda: None
    import torch

    return clock.count_synchronize(torch.cuda)
