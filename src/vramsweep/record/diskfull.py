"""A full disk, told from any other failure: one reason line, ``no space left on device: <path>``.

Writing a result, a log or the study database can hit ``ENOSPC`` (or ``EDQUOT``, a full quota) at any point
of a sweep. The writers turn it into that one line (status ``error``, docs/CONTRACTS.md) instead of a chain of
tracebacks, and the sweep stops cleanly: every later trial would fail the same way.
"""

from __future__ import annotations

import errno

NO_SPACE = "no space left on device"
_CODES = (errno.ENOSPC, errno.EDQUOT)
#: SQLite's message for a full disk (``sqlite3.OperationalError``, also wrapped by SQLAlchemy).
_SQLITE_FULL = "database or disk is full"


def disk_full_reason(exc: BaseException | None, path: object = None) -> str | None:
    """``"no space left on device: <path>"`` when ``exc`` (or an exception it was raised from) is a full
    disk, else None. ``path``: named when the exception does not carry a file name."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in _CODES:
            where = exc.filename if exc.filename is not None else path
            return f"{NO_SPACE}: {where}" if where is not None else NO_SPACE
        if _SQLITE_FULL in str(exc):
            return f"{NO_SPACE}: {path}" if path is not None else f"{NO_SPACE} (the study database)"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


__all__ = ["NO_SPACE", "disk_full_reason"]
