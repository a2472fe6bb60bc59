"""Helpers for run-folder tests: a hash of everything a folder holds."""

from __future__ import annotations

import hashlib
from pathlib import Path


def folder_hash(folder: Path) -> str:
    """Names, bytes and modification times of every file under ``folder`` (equal: nothing changed)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes() + str(p.stat().st_mtime_ns).encode())
    return h.hexdigest()
