"""What every bench that compares arms shares: the arm order alternates round by round (a drift in machine
load then hits every arm alike instead of always the one that runs last), the torch threads are pinned in
each child (a thread count that differs between arms, or that torch picks from a busy machine, is a
several-fold effect of its own), and a ratio is printed with its spread: the median of the per-round ratios
(arms paired within a round) and their min-max."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

#: Environment of a child process that pins its thread pools (torch reads these at import; the child also
#: calls ``torch.set_num_threads``: :func:`pin_torch`).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def order(arms: Sequence[str], rnd: int) -> list[str]:
    """The arms' order in round ``rnd``: rotated by one each round, so each arm runs in every position
    equally often over ``len(arms)`` rounds (two arms: A B, B A, A B, ...)."""
    k = rnd % len(arms) if arms else 0
    return [*arms[k:], *arms[:k]]


def child_env(threads: int | None) -> dict[str, str]:
    """This environment with the thread pools pinned to ``threads`` (None: as it is)."""
    env = dict(os.environ)
    if threads is not None:
        for key in THREAD_ENV:
            env[key] = str(int(threads))
    return env


def pin_torch(threads: int | None) -> int:
    """In a child: ``torch.set_num_threads(threads)`` (None: leave torch's choice); returns the count."""
    import torch

    if threads is not None:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def paired_ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
    """Per-round ratios ``num[i] / den[i]`` of the rounds where both arms measured."""
    return [a / b for a, b in zip(num, den, strict=False) if a is not None and b]


def spread(values: Sequence[float], what: str = "round") -> str:
    """``median [min-max] (n rounds)`` of ``values`` (``what``: what one value is), or ``n/a``."""
    if not values:
        return f"n/a (no {what} measured)"
    v = sorted(values)
    return (
        f"{statistics.median(v):.3f} [{v[0]:.3f}-{v[-1]:.3f}] ({len(v)} {what}{'s' if len(v) != 1 else ''})"
    )


#: A competing torch job: ``threads``-thread float32 matmuls until killed (another trial; any process doing
#: multi-threaded matmuls on the same cores).
COMPETITOR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(768, 768)
while True:
    a = torch.tanh(a @ a)
"""


@contextlib.contextmanager
def competitor(threads: int | None) -> Iterator[None]:
    """Inside: a :data:`COMPETITOR` process of ``threads`` threads, computing before the body starts (3 s
    head start) and killed when it ends; ``None``/``0``: nothing started."""
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(threads)]) if threads else None
    try:
        if proc is not None:
            time.sleep(3.0)
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
