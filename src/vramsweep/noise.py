"""Library noise that is not actionable for a person at a terminal (kept in logs).

bitsandbytes logs ``Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels``
on every import on CPUs with AVX512-BF16 when the optional ``kernels`` package (which would download a
kernel from the Hub) is absent; nothing in vramsweep needs it and installing it does not change any
measurement. The record is dropped when stderr is a terminal and kept otherwise: trial logs
(``trials/NNNN.log``), CI logs and redirected output still have it.
"""

from __future__ import annotations

import logging
import sys

#: (logger name, message start) of records that are noise at a terminal.
NOISE = (("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),)


class _TerminalNoiseFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = str(record.msg)
        except Exception:
            return True
        if not msg.startswith(self.prefix):
            return True
        isatty = getattr(sys.stderr, "isatty", None)
        return not (isatty and isatty())


def install() -> None:
    """Attach the filters (idempotent; the loggers need not exist yet)."""
    for name, prefix in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TerminalNoiseFilter) for f in logger.filters):
            logger.addFilter(_TerminalNoiseFilter(prefix))
