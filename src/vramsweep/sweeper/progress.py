"""Progress output: one line per finished trial (number, status, key metrics) with a total bar, and the
end-of-run summary (:func:`print_summary`: counts by status, the best trial(s), what is left)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from vramsweep.record.feasibility import over_budget_gib, result_budget_gib
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.status import Status
from vramsweep.record.units import MIB
from vramsweep.sweeper.storage import COPY_OF, JOB_LOST, RETRY_OF, SCREENED, requeue_lost


def bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]`` for ``done/total``."""
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    full = int(round(frac * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def over_budget(result: dict[str, Any], budget_gib: float | None = None) -> bool:
    """Whether an ``ok`` trial's measured peak exceeds its budget (``hardware.budget_gib`` or ``budget_gib``;
    :mod:`vramsweep.record.feasibility`)."""
    c = ((result.get("meta") or {}).get("optuna") or {}).get("constraint")
    if isinstance(c, int | float) and not isinstance(c, bool):
        return c > 0
    over = over_budget_gib(
        (result.get("metrics") or {}).get(M.PEAK_MEMORY_BYTES), result_budget_gib(result, budget_gib)
    )
    return over is not None and over > 0


def status_label(result: dict[str, Any], budget_gib: float | None = None) -> str:
    """The status a person reads: ``over budget`` for an ``ok`` trial whose peak exceeds the budget."""
    status = str(result.get("status"))
    if status == Status.OK and over_budget(result, budget_gib):
        return "over budget"
    return status


def plural(n: int, word: str) -> str:
    """``1 trial``, ``2 trials``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_value(v: Any) -> str:
    """A value for a label: floats with 3 significant digits (``2.23e-04``, ``0.5``), others as given."""
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.4g}"
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return v
        if ("." in v or "e" in v.lower()) and f == f:
            return fmt_value(f)
    return str(v)


def fmt_override(ov: str) -> str:
    """``train.lr=0.00022258235696668132`` -> ``train.lr=2.23e-04`` (other overrides unchanged)."""
    key, sep, value = ov.partition("=")
    return f"{key}={fmt_value(value)}" if sep else ov


def trial_label(number: int) -> str:
    """The one trial label style: ``trial 0004`` (the result file is ``trials/0004.json``)."""
    return f"trial {number:04d}"


def trial_line(
    number: int, result: dict[str, Any], wall_s: float, objectives: list[Any], changed: list[str]
) -> str:
    """``trial 0004 ok        peak 41.2 MiB | 512 tok/s | eval_loss 2.314 | 23.1 s | quant=nf4``."""
    m = result.get("metrics") or {}
    status = str(result.get("status"))
    parts = [f"{trial_label(number)} {status_label(result):<19s}"]
    peak = m.get(M.PEAK_MEMORY_BYTES)
    parts.append(f"peak {_fmt(peak / MIB if isinstance(peak, int | float) else None, '.1f')} MiB")
    parts.append(f"{_fmt(m.get(M.TOKENS_PER_S), '.0f')} tok/s")
    parts.append(f"{M.EVAL_LOSS} {_fmt(m.get(M.EVAL_LOSS), '.3f')}")
    for o in objectives:
        if o.metric not in (M.PEAK_MEMORY_BYTES, M.TOKENS_PER_S, M.EVAL_LOSS):
            parts.append(f"{o.metric} {_fmt(m.get(o.metric), '.4g')}")
    parts.append(f"{wall_s:.1f} s")
    line = " | ".join(parts)
    if changed:
        line += " | " + " ".join(fmt_override(c) for c in changed)
    note = ((result.get("meta") or {}).get("optuna") or {}).get("note")
    if status != Status.OK and result.get("reason"):
        line += f"\n      reason: {str(result['reason'])[:300]}"
    elif note:
        line += f"\n      {note}"
    return line


def fmt_duration(seconds: float | None) -> str:
    """``42 s``, ``3m10s``, ``2h05m``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Thread-safe progress printer.

    Counts (done/running/total) come from the study when the engine passes them (:meth:`update`), so
    they are right when several workers share one study; otherwise they are counted locally. One line
    per finished trial, prefixed by a bar and ``done/total``; on a terminal also a live status line
    (``done, running, ETA, best so far``) redrawn in place every second. When the stream is not a TTY
    (CI logs, pipes) there is no live line and the per-trial lines stay one line each. ``enabled=False``
    (``hydra.sweeper.progress=false``) drops the per-trial and live lines, never a note (:meth:`say`).
    """

    def __init__(
        self,
        total: int,
        done: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        live: bool | None = None,
    ):
        self.total = total
        self.done = done
        self.running = 0
        self.best: str | None = None
        self.enabled = enabled
        self.stream = stream or sys.stdout
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = bool(live and enabled)
        self._walls: list[float] = []
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._shown = False
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # ------------------------------------------------------------------ state
    def update(self, *, done: int | None = None, running: int | None = None, best: str | None = None) -> None:
        """New counts (from the study) and/or best-so-far text; redraws the live line."""
        with self._lock:
            if done is not None:
                self.done = done
            if running is not None:
                self.running = running
            if best is not None:
                self.best = best
            self._draw()

    def eta_s(self) -> float | None:
        """Remaining trials x mean trial time (this run) / trials running in parallel (all workers)."""
        if not self._walls:
            return None
        left = max(0, self.total - self.done)
        return left * (sum(self._walls) / len(self._walls)) / max(1, self.running)

    def status(self) -> str:
        """``12/20 done, 2 running | ETA 3m10s | best eval_loss 2.314 (trial 0007)``."""
        parts = [f"{self.done}/{self.total} done, {self.running} running"]
        if self.done < self.total:
            parts.append(f"ETA {fmt_duration(self.eta_s())}")
        if self.best:
            parts.append(f"best {self.best}")
        return " | ".join(parts)

    # ------------------------------------------------------------------ output
    def _clear(self) -> None:
        if self.live and self._shown:
            self.stream.write("\r\x1b[2K")
            self._shown = False

    def _draw(self) -> None:
        if not self.live:
            return
        self._clear()
        self.stream.write(f"{bar(self.done, self.total)} {self.status()}")
        self.stream.flush()
        self._shown = True

    def start(self) -> None:
        """Redraw the live line every second (ETA and elapsed move while trials run)."""
        if not self.live or self._ticker is not None:
            return

        def tick() -> None:
            while not self._stop.wait(1.0):
                with self._lock:
                    self._draw()

        self._ticker = threading.Thread(target=tick, name="vramsweep-progress", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._clear()
            if self.live:
                self.stream.flush()

    def say(self, text: str) -> None:
        """A note (what runs, a trial's error, a job that could not be stopped): printed whether or not
        progress is ``enabled``, which governs only the per-trial lines and the live line."""
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)
            self._draw()

    def finished(
        self,
        line: str,
        counted: bool = True,
        *,
        wall_s: float | None = None,
        done: int | None = None,
        running: int | None = None,
        best: str | None = None,
    ) -> None:
        with self._lock:
            if wall_s is not None and wall_s > 0:
                self._walls.append(float(wall_s))
            if done is not None:
                self.done = done
            elif counted:
                self.done += 1
            if running is not None:
                self.running = running
            if best is not None:
                self.best = best
            if self.enabled:
                self._clear()
                print(
                    f"{bar(self.done, self.total)} {self.done:>{len(str(self.total))}}/{self.total} {line}",
                    file=self.stream,
                    flush=True,
                )
                self._draw()


def dashboard_hint(storage: str) -> str | None:
    """``vramsweep: dashboard: optuna-dashboard <storage>`` where optuna-dashboard is installed (the
    ``dashboard`` extra installs it), else ``None``: a hint to a command that is not there only confuses."""
    import importlib.util

    if importlib.util.find_spec("optuna_dashboard") is None:
        return None
    return f"vramsweep: dashboard: optuna-dashboard {storage if '@' not in storage else '<storage URL>'}"


def summary_status(trial: Any) -> str:
    """What the summary counts a finished study trial as: :func:`.progress.status_label` (the progress line's
    rule: ``over budget`` for an ``ok`` trial over its budget) of its recorded status and the largest budget
    constraint the study holds for it (``constraints:<name>``; the dashboard's list copy is the same
    value)."""
    constraints = [
        v
        for k, v in trial.system_attrs.items()
        if k.startswith("constraints") and isinstance(v, int | float) and not isinstance(v, bool)
    ]
    status = trial.user_attrs.get("status", trial.state.name.lower())
    return status_label(
        {"status": status, "meta": {"optuna": {"constraint": max(constraints, default=None)}}}
    )


def print_summary(
    plan: Any, study: Any, *, finished: int, wall_s: float, abort_reason: str | None, waiting: int
) -> None:
    """The end-of-run summary of ``plan``'s ``study``: counts by status (``finished``: trials this run
    finished in ``wall_s``), the best feasible trial(s), points lost for good, the abort reason, where the
    results are, and what is left (``waiting`` slots, lost launcher jobs) with how to run it."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs.get(RETRY_OF) for t in trials} - {None}
    by_status: dict[str, int] = {}
    jobs_lost = 0
    for t in trials:
        if (
            t.number in retried
            or t.system_attrs.get(COPY_OF) is not None
            or t.system_attrs.get(SCREENED)  # sweep.edge_screen's estimate-only records: not counted
            or t.state in (TrialState.WAITING, TrialState.RUNNING)
        ):
            continue
        if t.system_attrs.get(JOB_LOST):  # lost infrastructure, not a result: never an "error"
            jobs_lost += 1
            continue
        st = summary_status(t)
        by_status[st] = by_status.get(st, 0) + 1
    lines = [
        f"vramsweep: sweep '{plan.name}' - this run: "
        f"{plural(finished, 'trial')} in {wall_s:.0f} s; study total: "
        + (", ".join(f"{v} {k}" for k, v in sorted(by_status.items())) or "no finished trials")
        + (f"; {plural(jobs_lost, 'launcher job')} lost (not results)" if jobs_lost else "")
    ]
    try:
        best = study.best_trials
    # broad on purpose: no feasible trial or a multi-objective study without a front: no best line
    except Exception:
        best = []
    if best:
        if len(plan.goals) == 1:
            b = best[0]
            lines.append(
                f"vramsweep: best feasible: trial {b.number:04d} "
                f"{plan.goals[0].metric}={b.values[0]:.6g} "
                + " ".join(
                    fmt_override(o) for o in b.user_attrs.get("overrides") or [] if o not in plan.fixed
                )
            )
        else:
            lines.append(
                f"vramsweep: Pareto front (feasible): trials {', '.join(f'{t.number:04d}' for t in best)}"
            )
    left = requeue_lost(study)
    lost = [t.number for t in left if not t.system_attrs.get(JOB_LOST)]
    job_lost = [t.number for t in left if t.system_attrs.get(JOB_LOST)]
    if lost:
        lines.append(
            f"vramsweep: {len(lost)} design point(s) lost for good (their worker died or was stopped "
            f"{plan.retry_stale + 1} times: trial(s) {', '.join(f'{n:04d}' for n in lost)}): "
            f"re-run with hydra.sweeper.retry_stale={plan.retry_stale + 1} to retry them"
        )
    if abort_reason:
        lines.append(f"vramsweep: ABORTED: {abort_reason}")
    if (hint := dashboard_hint(plan.storage_url)) is not None:
        lines.append(hint)
    lines.append(f"results: {plan.folder}")
    if job_lost or waiting:  # the last line: how to retry what is left
        what = (
            [f"{plural(len(job_lost), 'trial')} whose launcher job was lost ({_numbers(job_lost)})"]
            if job_lost
            else []
        )
        what += [f"{plural(waiting, 'trial')} waiting"] if waiting else []
        lines.append(
            f"vramsweep: left: {' and '.join(what)}: re-run the same command to run "
            f"{'it' if len(job_lost) + waiting == 1 else 'them'}"
        )
    for line in lines:
        print(line, flush=True)


def _numbers(numbers: list[int]) -> str:
    return "trial " + ", ".join(f"{n:04d}" for n in numbers)
