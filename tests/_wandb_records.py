"""Read an offline W&B run back from its transaction log (``offline-run-*/run-<id>.wandb``).

wandb 0.31 writes the log from its Go core and ships no Python reader (the old
``wandb.sdk.internal.datastore`` is gone), so this is the framing of that file -- W&B's LevelDB-style
log: a 7-byte file header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of records, each
``crc32 (uint32 LE) · length (uint16 LE) · type (FULL/FIRST/MIDDLE/LAST)`` + payload -- with every
payload decoded by W&B's own protobuf schema, ``wandb.proto.wandb_internal_pb2.Record``. The CRC of
every chunk is checked, so a file we mis-frame fails loudly instead of yielding garbage.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
CHUNK = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: str | Path):
    """Yield every ``wandb_internal_pb2.Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (IDENT, MAGIC, VERSION), f"{path}: not a W&B log ({ident!r})"
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # block trailer (zero padding)
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if crc == 0 and length == 0 and kind == 0:  # zero-filled tail of the block
            pos += left
            continue
        payload = data[pos + CHUNK.size : pos + CHUNK.size + length]
        assert len(payload) == length, f"{path}: truncated record at byte {pos}"
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad CRC at {pos}"
        pos += CHUNK.size + length
        if kind == FULL:
            pending = b""
            whole = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            whole, pending = pending + payload, b""
        else:
            raise AssertionError(f"{path}: unknown chunk type {kind} at byte {pos}")
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(whole)
        yield rec


def _items(items) -> dict[str, Any]:
    """``{key: value}`` of config/summary/history items (nested_key joined with '/', values JSON)."""
    out: dict[str, Any] = {}
    for it in items:
        key = it.key or "/".join(it.nested_key)
        out[key] = json.loads(it.value_json)
    return out


@dataclass
class OfflineRun:
    """What one run's log says: the run record, config, tags, job type, history rows, summary."""

    path: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    project: str = ""
    tags: list[str] = field(default_factory=list)
    resumed: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    kinds: list[str] = field(default_factory=list)


def read_run(path: str | Path, wait_s: float = 15.0) -> OfflineRun:
    """Fold a ``.wandb`` file (or the ``offline-run-*`` folder holding one) into an :class:`OfflineRun`.

    wandb-core may still be flushing the log for a moment after ``run.finish()`` returns: wait (up to
    ``wait_s``) for the ``exit`` record that closes a finished run.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = _read_run(Path(path))
            if run.exit_code is not None:
                return run
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _read_run(path: Path) -> OfflineRun:
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        assert len(files) == 1, f"{path}: expected one run-*.wandb, found {files}"
        path = files[0]
    run = OfflineRun(path=path)
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        run.kinds.append(str(kind))
        if kind == "run":
            r = rec.run  # a later run record (tags set at finish) carries only what changed
            for attr, value in (
                ("run_id", r.run_id),
                ("name", r.display_name),
                ("group", r.run_group),
                ("job_type", r.job_type),
                ("project", r.project),
            ):
                if value:
                    setattr(run, attr, value)
            if r.tags:
                run.tags = list(r.tags)
            run.resumed = run.resumed or bool(r.resumed)
            run.config.update(_items(r.config.update))
            run.summary.update(_items(r.summary.update))
        elif kind == "config":
            run.config.update(_items(rec.config.update))
            for it in rec.config.remove:
                run.config.pop(it.key, None)
        elif kind == "history":
            run.history.append(_items(rec.history.item))
        elif kind == "summary":
            run.summary.update(_items(rec.summary.update))
            for it in rec.summary.remove:
                run.summary.pop(it.key or "/".join(it.nested_key), None)
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    return run


def offline_runs(wandb_dir: str | Path) -> list[OfflineRun]:
    """Every offline run under a ``wandb`` folder, oldest first."""
    return [read_run(p) for p in sorted(Path(wandb_dir).glob("offline-run-*"))]
