"""Library noise that is not actionable for a person at a terminal (kept in logs).

bitsandbytes logs ``Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels``
on every import on CPUs with AVX512-BF16 when the optional ``kernels`` package (which would download a
kernel from the Hub) is absent; nothing in vramsweep needs it and installing it does not change any
measurement. It is a :data:`HARMLESS` entry with ``show=False``: never printed (at a terminal or in a
redirected log), one line in the run's ``warnings.log`` where there is one.

Known-harmless warnings a user may still want to know about (:data:`HARMLESS`: bitsandbytes' LLM.int8
cast line, the paged-optimizer CPU fallback) go through :data:`DIGEST`: the first of each is shown
once — one line at a terminal, the full text in a log — repeats are counted and the count printed at
exit; ``vramsweep train`` writes the full texts to the run's ``warnings.log``. Any other warning passes
untouched.

torch's "an autograd kernel was not registered ... silently incorrect behavior" for a ``bitsandbytes::`` op
is *not* on the list: it was filed here as harmless, but it fired exactly when bitsandbytes' CPU-packed
4-bit path cut the gradient (``vramsweep.knobs.quant.keep_trainable_4bit_layout``). With that path turned
off it does not fire in an eval + train step of nf4/nf4_dq/fp4/int8, DoRA, checkpointing or bf16
(``tests/knobs/test_quant_grads.py``), so if it ever fires it is shown in full, as torch wrote it.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

#: Warnings that are noise at a terminal: Liger 0.8.5 with Triton 3.6 warns on import that its Ascend (NPU)
#: RoPE backend "cannot import name 'tanh'" — a backend for another accelerator, never used on CUDA.
NOISE_WARNINGS = (r"Backend impl 'liger_kernel\.ops\.backends\._ascend\.rope'",)


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
    install_digest()


# ------------------------------------------------------------------------------------------------------
# Harmless-but-worth-knowing library warnings: shown once, as one line, at a terminal; repeats counted.
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Harmless:
    """A library warning that is known to be harmless for what vramsweep runs.

    Attributes:
        key: short name (the summary line and ``warnings.log`` use it).
        pattern: regex the message must match (``re.search``), as narrow as the library's wording allows.
        line: the one line a terminal shows the first time.
        why: why it is harmless (``tests/training/test_noise.py`` lists each with this text).
        logger: the logger that emits it, for a ``logging`` record; ``None`` for a Python warning.
        show: False: never printed, one line in the run's ``warnings.log`` (not actionable anywhere).
    """

    key: str
    pattern: str
    line: str
    why: str
    logger: str | None = None
    show: bool = True


HARMLESS: tuple[Harmless, ...] = (
    Harmless(
        key="bnb-cpu-gemm-kernels",
        logger="bitsandbytes.backends.cpu.ops",
        pattern=r"^Failed to load CPU gemm_4bit_forward from kernels-community",
        line="bitsandbytes: the optional `kernels` package (a Hub-downloaded CPU 4-bit kernel) is absent",
        why="an optional CPU kernel for 4-bit inference that `kernels` would download from the Hub; "
        "vramsweep runs offline and never installs it; without it bitsandbytes runs its built-in CPU path",
        show=False,
    ),
    Harmless(
        key="bnb-int8-fp16-cast",
        logger="bitsandbytes.autograd._functions",
        pattern=r"^MatMul8bitLt: inputs will be cast from \S+ to float16 during quantization",
        line="bitsandbytes LLM.int8 (quant=int8) casts each matmul's 16/32-bit input to fp16 to quantise it",
        why="LLM.int8 quantises activations from fp16 by design; bitsandbytes logs it on every matmul call "
        "(224 lines in a 1-step trial of the tiny model), and the int8 figures we measure include the cast",
    ),
    Harmless(
        key="bnb-paged-optimizer-cpu",
        pattern=r"^Paged optimizers are not supported on CPU\. Falling back to non-paged optimizer",
        line="bitsandbytes: paged optimizers page only on CUDA; on CPU the state is ordinary tensors",
        why="on CPU there is no unified memory to page to; the trial records `paged_fallback` in its "
        "notes and the estimator counts the state on the host, so the figures say what ran",
    ),
)


class WarningDigest:
    """Counts :data:`HARMLESS` warnings: the first of each is shown (one line at a terminal, the full
    text elsewhere), repeats are counted, not shown; :meth:`summary` says how many there were."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.full: dict[str, str] = {}
        self.log_path: Path | None = None

    @staticmethod
    def match(message: str, logger: str | None = None) -> Harmless | None:
        for h in HARMLESS:
            if h.logger == logger and re.search(h.pattern, message):
                return h
        return None

    def seen(self, h: Harmless, full: str) -> bool:
        """Count one occurrence; True for the first (show it)."""
        first = h.key not in self.counts
        self.counts[h.key] = self.counts.get(h.key, 0) + 1
        if first:
            self.full[h.key] = full
            self._write_log(h, full)
        return first

    def terminal_line(self, h: Harmless) -> str:
        where = f"; full text: {self.log_path.name} in the run folder" if self.log_path is not None else ""
        return f"vramsweep: harmless library warning (shown once, repeats counted{where}): {h.line}"

    def use_log(self, path: Path | None) -> None:
        """Write each first full text to ``path`` (the run's ``warnings.log``) from now on, and those
        seen so far."""
        self.log_path = Path(path) if path is not None else None
        for h in HARMLESS:
            if h.key in self.full:
                self._write_log(h, self.full[h.key])

    def _write_log(self, h: Harmless, full: str) -> None:
        if self.log_path is None:
            return
        text = f"[{h.key}] harmless: {h.why}\n{full.rstrip()}\n\n"
        if not h.show:  # one line: the library's own words
            text = f"[{h.key}] not shown: {' '.join(full.split())}\n"
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass

    def summary(self) -> str | None:
        """``vramsweep: harmless library warnings not repeated: bnb-int8-fp16-cast x896, ...`` (None when no
        warning repeated)."""
        hidden = {h.key for h in HARMLESS if not h.show}
        rep = {k: n for k, n in self.counts.items() if n > 1 and k not in hidden}
        if not rep:
            return None
        return "vramsweep: harmless library warnings not repeated: " + ", ".join(
            f"{k} x{n}" for k, n in rep.items()
        )


DIGEST = WarningDigest()


def _at_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class _DigestFilter(logging.Filter):
    """For a harmless record: the first passes (one line at a terminal), repeats are counted and dropped."""

    def __init__(self, logger: str) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        # broad on purpose: a log filter must never drop or break a record whose message cannot format
        except Exception:
            return True
        h = WarningDigest.match(text, self.logger)
        if h is None:
            return True
        if not DIGEST.seen(h, f"{record.levelname} {record.name}: {text}") or not h.show:
            return False
        if _at_terminal():
            record.msg, record.args = DIGEST.terminal_line(h), None
        return True


_show_original = None


def _showwarning(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's shape
    h = WarningDigest.match(str(message))
    if h is None:
        return _show_original(message, category, filename, lineno, file, line)
    full = warnings.formatwarning(message, category, filename, lineno, line)
    if not DIGEST.seen(h, full) or not h.show:
        return None
    out = file if file is not None else sys.stderr
    try:
        out.write((DIGEST.terminal_line(h) if _at_terminal() else f"{category.__name__}: {message}") + "\n")
    except (OSError, ValueError):
        pass
    return None


def _print_summary() -> None:
    text = DIGEST.summary()
    if text is not None:
        try:
            print(text, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass


def install_digest() -> None:
    """Route :data:`HARMLESS` through :data:`DIGEST` (idempotent): a filter on each logger, a
    ``warnings.showwarning`` wrapper for Python warnings (with an ``always`` filter for their patterns so
    every occurrence is counted), and the repeat count printed at exit. Everything else passes untouched."""
    global _show_original
    for h in HARMLESS:
        if h.logger is None:
            warnings.filterwarnings("always", message=h.pattern.lstrip("^"))
            continue
        logger = logging.getLogger(h.logger)
        if not any(isinstance(f, _DigestFilter) for f in logger.filters):
            logger.addFilter(_DigestFilter(h.logger))
    if _show_original is None:
        _show_original = warnings.showwarning
        warnings.showwarning = _showwarning
        atexit.register(_print_summary)
