"""Progress output: one line per finished trial (number, status, key metrics) with a total bar."""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

MIB = float(1 << 20)


def bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]`` for ``done/total``."""
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    full = int(round(frac * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def over_budget(result: dict[str, Any], budget_gib: float | None = None) -> bool:
    """Whether an ``ok`` trial's measured peak exceeds its budget (``hardware.budget_gib`` or ``budget_gib``)."""
    c = ((result.get("meta") or {}).get("optuna") or {}).get("constraint")
    if isinstance(c, int | float) and not isinstance(c, bool):
        return c > 0
    budget = budget_gib
    try:
        budget = float(result["config"]["hardware"]["budget_gib"]) or budget
    except (KeyError, TypeError, ValueError):
        pass
    peak = (result.get("metrics") or {}).get("peak_memory_bytes")
    return bool(budget) and isinstance(peak, int | float) and peak / float(1 << 30) > float(budget)


def status_label(result: dict[str, Any], budget_gib: float | None = None) -> str:
    """The status a person reads: ``over budget`` for an ``ok`` trial whose peak exceeds the budget."""
    status = str(result.get("status"))
    if status == "ok" and over_budget(result, budget_gib):
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
    peak = m.get("peak_memory_bytes")
    parts.append(f"peak {_fmt(peak / MIB if isinstance(peak, int | float) else None, '.1f')} MiB")
    parts.append(f"{_fmt(m.get('tokens_per_s'), '.0f')} tok/s")
    parts.append(f"eval_loss {_fmt(m.get('eval_loss'), '.3f')}")
    for o in objectives:
        if o.metric not in ("peak_memory_bytes", "tokens_per_s", "eval_loss"):
            parts.append(f"{o.metric} {_fmt(m.get(o.metric), '.4g')}")
    parts.append(f"{wall_s:.1f} s")
    line = " | ".join(parts)
    if changed:
        line += " | " + " ".join(fmt_override(c) for c in changed)
    note = ((result.get("meta") or {}).get("optuna") or {}).get("note")
    if status != "ok" and result.get("reason"):
        line += f"\n      reason: {str(result['reason'])[:300]}"
    elif note:
        line += f"\n      {note}"
    return line


class Progress:
    """Thread-safe progress printer (plain lines: works in logs, CI and terminals alike)."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total = total
        self.done = done
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            print(text, file=self.stream, flush=True)

    def finished(self, line: str, counted: bool = True) -> None:
        with self._lock:
            if counted:
                self.done += 1
            if self.enabled:
                print(
                    f"{bar(self.done, self.total)} {self.done:>{len(str(self.total))}}/{self.total} {line}",
                    file=self.stream,
                    flush=True,
                )
