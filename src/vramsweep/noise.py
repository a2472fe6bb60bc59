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
import warnings

#: Warnings that are noise at a terminal: Liger 0.8.5 with Triton 3.6 warns on import that its Ascend (NPU)
#: RoPE backend "cannot import name 'tanh'" — a backend for another accelerator, never used on CUDA.
NOISE_WARNINGS = (r"Backend impl 'liger_kernel\.ops\.backends\._ascend\.rope'",)
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


def quiet_terminal_warnings() -> bool:
    """Ignore :data:`NOISE_WARNINGS` in this process when stderr is a terminal (``vramsweep`` verbs call it;
    sweep trials, whose output goes to their log files, keep the warnings). Returns whether it did."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        return False
    for pattern in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    return True


def install() -> None:
    """Attach the filters (idempotent; the loggers need not exist yet)."""
    for name, prefix in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TerminalNoiseFilter) for f in logger.filters):
            logger.addFilter(_TerminalNoiseFilter(prefix))
