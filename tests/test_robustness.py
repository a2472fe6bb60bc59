"""Issue 13: umask-honouring writes, pre-flight checks, exact recovery of killed points, progress, polish."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from vramsweep.record.result import atomic_write_json, atomic_write_text

# ---------------------------------------------------------------------------------------------- umask


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        p = atomic_write_text(tmp_path / "a.md", "x\n")
        q = atomic_write_json(tmp_path / "sub" / "b.json", {"a": 1})
        # rewriting an existing file keeps the umask's mode too (not the temp file's 0600)
        atomic_write_json(q, {"a": 2})
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == mode
    assert stat.S_IMODE(q.stat().st_mode) == mode
    assert json.loads(Path(q).read_text()) == {"a": 2}
    assert not list(tmp_path.rglob(".*.tmp"))
