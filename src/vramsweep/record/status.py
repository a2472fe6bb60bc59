"""Trial statuses (the ``status`` field of a result), defined once.

:class:`Status` is a ``str`` enum: a member compares equal to its string and JSON-encodes as it, so result
files hold the same plain strings as before (``"ok"``, ``"oom"``, ...). How each status is told to Optuna
is in :mod:`vramsweep.sweeper.outcome`; what each means is in docs/CONTRACTS.md.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """How a trial ended."""

    OK = "ok"  # ran to the end; measured
    OOM = "oom"  # ran out of device memory
    HOST_OOM = "host_oom"  # ran out of host memory (pinned memory for offloaded activations)
    UNSUPPORTED = "unsupported"  # a valid config this machine/library set cannot run
    DIVERGED = "diverged"  # a loss became NaN/inf
    ERROR = "error"  # anything else (a bug, a crash, a lost worker)
    INFEASIBLE_ESTIMATE = "infeasible_estimate"  # not run: the estimate exceeds the budget (sweep.preflight)
    PRUNED = "pruned"  # stopped early by the pruner (partial metrics)


#: Every status, in declaration order (the allowed values of ``result.status``).
STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
#: Statuses that are failures in a report (everything except ``ok``).
FAILURE_STATUSES: tuple[str, ...] = tuple(s.value for s in Status if s is not Status.OK)


def parse_status(value: object) -> Status:
    """``value`` as a :class:`Status`; ``ValueError`` naming the allowed values otherwise."""
    try:
        return Status(value)
    except ValueError:
        raise ValueError(f"status={value!r} (allowed: {', '.join(STATUSES)})") from None


__all__ = ["FAILURE_STATUSES", "STATUSES", "Status", "parse_status"]
