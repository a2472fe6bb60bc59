"""``train.threads``: how many torch CPU threads a trial uses.

``auto`` (the default) takes, at trial start: the cores this process may run on
(``os.sched_getaffinity``), the sweep's concurrent trials (``VRAMSWEEP_CONCURRENT_TRIALS``, set by the
sweeper: each trial gets its share), and the cores other processes keep busy right now (per-core busy time
over :data:`SAMPLE_S` from ``psutil``, less this process's own CPU time). It never takes more than torch's
own default (one thread per physical core), and at least 1.

Why: torch's default (every physical core) beside another job that also computes on those cores
oversubscribes them, and a matmul whose threads wait on each other slows by several times (issue 52 measured
5-9x on 2 shared cores). A fixed count (``train.threads=N``) is kept as given; ``0`` is torch's default.
The trial records the setting, the count it used and why in ``meta.threads``, and the count actually in use
in ``meta.timing_conditions.torch_threads``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from vramsweep.record.threads_env import CONCURRENT_ENV  # set by the sweeper for its trial processes

#: Seconds of per-core busy time sampled at trial start (``auto``).
SAMPLE_S = 0.3
#: A core counts as taken by another process from this share of busy time on (a busy core is ~1.0).
BUSY_CORE = 0.5


@dataclass(frozen=True)
class ThreadChoice:
    """What ``train.threads`` resolved to, recorded as ``meta.threads``."""

    setting: str  # the config value: "auto", "0" (torch's default) or a count
    threads: int  # torch threads the trial runs with
    usable_cores: int | None = None  # cores in this process's affinity mask
    concurrent_trials: int | None = None
    busy_other_cores: float | None = None  # cores other processes kept busy during the sample
    torch_default: int | None = None
    why: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def concurrent_trials() -> int:
    """The sweep's trials running at once (:data:`CONCURRENT_ENV`; 1 outside a sweep or when unreadable)."""
    try:
        return max(1, int(os.environ.get(CONCURRENT_ENV, "1")))
    except ValueError:
        return 1


def busy_other_cores(sample_s: float = SAMPLE_S) -> float | None:
    """Cores of this process's affinity mask that other processes kept busy over ``sample_s`` seconds
    (per-core busy share from ``psutil``, less this process's own CPU seconds); None when unmeasurable."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = None
    try:
        own0 = sum(os.times()[:2])
        t0 = time.perf_counter()
        psutil.cpu_percent(percpu=True)  # starts the interval
        time.sleep(sample_s)
        per_cpu = psutil.cpu_percent(percpu=True)
        own = (sum(os.times()[:2]) - own0) / max(time.perf_counter() - t0, 1e-6)
    # broad on purpose: psutil or a container's /proc may fail in many ways: no CPU sample
    except Exception:
        return None
    mine = [per_cpu[i] for i in cores if i < len(per_cpu)] if cores else per_cpu
    return max(0.0, sum(p / 100.0 for p in mine) - own)


def decide(usable: int, concurrent: int, busy_others: float | None, torch_default: int) -> tuple[int, str]:
    """The ``auto`` thread count and why (pure: the rule tests pin).

    A fair share of the usable cores per concurrent trial, less the cores other processes keep busy (each
    core busy for at least :data:`BUSY_CORE` of the sample counts whole), capped at torch's default, at
    least 1."""
    usable, concurrent = max(1, int(usable)), max(1, int(concurrent))
    share = max(1, usable // concurrent)
    cap = max(1, min(share, int(torch_default)))
    why = [f"{usable} usable cores"]
    if concurrent > 1:
        why.append(f"{concurrent} trials at once: {share} each")
    if busy_others is None:
        why.append("other processes' load not measurable")
        return cap, ", ".join(why)
    taken = int(busy_others + (1 - BUSY_CORE))  # 0.5 busy -> 1 core taken
    free = usable - taken
    threads = max(1, min(cap, free))
    why.append(f"{busy_others:.1f} cores busy with other processes")
    if threads < cap:
        why.append(f"{threads} left free")
    return threads, ", ".join(why)


def choose(setting: object, *, torch_default: int, sample_s: float = SAMPLE_S) -> ThreadChoice:
    """Resolve ``train.threads``: ``auto`` by :func:`decide`, ``0`` torch's default, ``N`` as given."""
    text = str(setting).strip().lower()
    if text == "auto":
        usable, concurrent = usable_cores(), concurrent_trials()
        busy = busy_other_cores(sample_s)
        threads, why = decide(usable, concurrent, busy, torch_default)
        return ThreadChoice(
            "auto",
            threads,
            usable,
            concurrent,
            None if busy is None else round(busy, 2),
            torch_default,
            why,
        )
    n = int(text)
    if n == 0:
        return ThreadChoice("0", torch_default, torch_default=torch_default, why="torch's default")
    return ThreadChoice(str(n), n, torch_default=torch_default, why="train.threads as given")


def apply(setting: object) -> ThreadChoice:
    """:func:`choose`, then ``torch.set_num_threads``; torch's default is read once per process (before any
    trial changed it)."""
    import torch

    global _TORCH_DEFAULT
    if _TORCH_DEFAULT is None:
        _TORCH_DEFAULT = torch.get_num_threads()
    choice = choose(setting, torch_default=_TORCH_DEFAULT)
    torch.set_num_threads(choice.threads)
    return choice


_TORCH_DEFAULT: int | None = None
