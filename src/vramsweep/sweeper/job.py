"""A popped trial, ready to run (:class:`Job`): what the ask/tell ledger (:mod:`.study`) hands the workers
(:mod:`.workers`) and what lost-trial recovery (:mod:`.recovery`) closes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Job:
    """A popped trial, ready to run."""

    trial: Any
    number: int
    slot: int
    overrides: list[str]
    label: list[str]  # what the point changes, for progress lines
    design: dict[str, Any]
    retry_of: int | None = None
    duplicate_of: int | None = None
    source: dict[str, Any] | None = None
    dup_streak: int = 0
    retries: int = 0  # how many earlier trials of this point were lost (dead worker, Ctrl-C)
