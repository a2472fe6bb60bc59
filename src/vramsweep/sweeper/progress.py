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


def trial_line(
    number: int, result: dict[str, Any], wall_s: float, objectives: list[Any], changed: list[str]
) -> str:
    """``trial 0004 ok        peak 41.2 MiB | 512 tok/s | eval_loss 2.314 | 23.1 s | quant=nf4``."""
    m = result.get("metrics") or {}
    status = str(result.get("status"))
    parts = [f"trial {number:04d} {status:<19s}"]
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
        line += " | " + " ".join(changed)
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
