"""Byte units, defined once for the whole package (GiB = 2**30 bytes, MiB = 2**20 bytes)."""

from __future__ import annotations

#: Bytes per GiB (``hardware.budget_gib``, ``peak_gib`` and every other "GiB" in vramsweep).
GIB = 1 << 30
#: Bytes per MiB.
MIB = 1 << 20

__all__ = ["GIB", "MIB"]
