"""The bench scripts' child protocol: each measurement runs in a fresh interpreter (``<script> --child ...``)
that prints its result as one ``RESULT <json>`` line on stdout; the parent runs it and reads that line."""

from __future__ import annotations

import json
import subprocess
from typing import Any

PREFIX = "RESULT "


def emit(result: Any) -> None:
    """In the child: print ``result`` as the ``RESULT`` line."""
    print(PREFIX + json.dumps(result))


def run_child(
    argv: list[str], *, check: bool = False, env: dict[str, str] | None = None
) -> tuple[Any, subprocess.CompletedProcess]:
    """In the parent: run ``argv`` (output captured; ``check``: raise on a non-zero exit; ``env``: its
    environment, default this one) and return its result (None where it printed no ``RESULT`` line) and the
    finished process."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=check, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(PREFIX)), None)
    return (None if line is None else json.loads(line[len(PREFIX) :])), proc
