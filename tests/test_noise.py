"""Harmless library warnings are left out at a terminal and kept elsewhere (trial logs, CI)."""

from __future__ import annotations

import io
import sys
import warnings

from vramsweep import noise

LIGER = (
    "Backend impl 'liger_kernel.ops.backends._ascend.rope' could not be imported: cannot import name 'tanh' "
    "from 'triton.language.extra.libdevice'"
)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _seen(stderr) -> list[str]:
    saved = sys.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.stderr = stderr
        try:
            noise.quiet_terminal_warnings()
        finally:
            sys.stderr = saved
        warnings.warn(LIGER, UserWarning, stacklevel=1)
        warnings.warn("something actionable", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_liger_ascend_warning_dropped_at_a_terminal_only():
    assert _seen(_Tty()) == ["something actionable"]
    assert _seen(io.StringIO()) == [LIGER, "something actionable"]  # a log file keeps it
