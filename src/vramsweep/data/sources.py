"""Where records come from: ``.jsonl``, ``.json`` (a list), ``.parquet`` or a ``datasets`` ``save_to_disk``
folder.

Local files only; nothing is downloaded. Every record is returned with its location (``file:line`` for
JSON Lines and JSON, ``file:row N`` for Parquet and dataset folders) so that each later problem names it.
A ``DatasetDict`` folder with a ``test`` (or ``validation``) split gives the held-out records.

Parquet and dataset folders are read with ``pyarrow`` / ``datasets``, the libraries that write them (the
formats TRL, axolotl and LLaMA-Factory read); they are imported only for those sources.

One reader, one decoder: every data file (records of any format, sectioned documents included:
:func:`vramsweep.data.documents.load_jsonl` reads through :func:`read_source`) is opened once per process
while it is unchanged: its bytes are read once, hashed (:func:`source_sha256`) and parsed from memory, and
both are kept, keyed by the file's path, size, modification time and inode (:data:`_MEMO_FILES` files at
most; a file modified in the last :data:`RACY_NS` is read again each time, since two writes that close
can leave the same size and time). The pre-flight, the data step and the data fingerprints of the same
process then open it no more.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Record", "Source", "SOURCE_KINDS", "read_source", "source_sha256"]

#: What ``data.path`` may name.
SOURCE_KINDS = (".jsonl", ".json", ".parquet", "<datasets save_to_disk folder>")


@dataclass(frozen=True)
class Record:
    """One input record and where it is (``file:line`` or ``file:row N``)."""

    where: str
    obj: Any


@dataclass
class Source:
    """The records of one ``data.path``; ``held_out``: a dataset folder's test split (else None)."""

    records: list[Record]
    sha256: str
    held_out: list[Record] | None = None
    kind: str = ""
    columns: list[str] = field(default_factory=list)


#: How many files' parsed records :func:`read_source` keeps (the train and eval files of a sweep, and some).
_MEMO_FILES = 4
_READ: OrderedDict[tuple, Source] = OrderedDict()
_SHA: dict[tuple, str] = {}


#: A file modified less than this long ago is not kept (nanoseconds): file times tick in milliseconds, so
#: two writes that close together could leave the same size and time (git's "racy" files).
RACY_NS = 2_000_000_000


def _stat_key(p: Path) -> tuple | None:
    """What says a file (or a folder's files) is unchanged: resolved path, size, mtime (ns), inode; None
    when it cannot be read or was modified in the last :data:`RACY_NS` (then it is read each time)."""
    try:
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        stats = [(str(q.relative_to(p)) if p.is_dir() else "", q.stat()) for q in files]
    except OSError:
        return None
    if any(s.st_mtime_ns > time.time_ns() - RACY_NS for _, s in stats):
        return None
    return (str(p.resolve()), *((n, s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev) for n, s in stats))


def _sha_of_folder(p: Path) -> str:
    h = hashlib.sha256()
    for q in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(str(q.relative_to(p)).encode() + b"\0")
        with open(q, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def source_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, or of a folder's files (names and bytes, sorted); from :func:`read_source`'s read
    where it read the unchanged file already, else read once and kept."""
    p = Path(path)
    key = _stat_key(p)
    if key is not None and key in _READ:
        return _READ[key].sha256
    if key is not None and key in _SHA:
        return _SHA[key]
    if p.is_dir():
        sha = _sha_of_folder(p)
    else:
        with open(p, "rb") as fh:
            h = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
            sha = h.hexdigest()
    if key is not None:
        _SHA[key] = sha
    return sha


def _guess_encoding(raw: bytes) -> str:
    """A likely legacy encoding of a line that is not UTF-8, as the error's clause ("" when none fits)."""
    for enc, name in (("cp1252", "Windows-1252/Latin-1"), ("latin-1", "Latin-1")):
        try:
            raw.decode(enc)
            return f"; it looks like {name}"
        except UnicodeDecodeError:
            continue
    return ""


def _decode(p: Path, raw: bytes, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{p}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
            f"{_guess_encoding(raw)}: save the file as UTF-8"
        ) from None


#: A record nested deeper than Python's JSON decoder recurses.
_TOO_DEEP = "invalid JSON: nested too deeply (over ~1,000 levels)"


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(obj: Any, text: str) -> str | None:
    """The problem of a record whose JSON text escapes half a UTF-16 pair (``"\\ud800"`` alone): Python
    parses it into a string no tokenizer can encode. None when there is none (the text is searched first)."""
    if "\\u" not in text or not _SURROGATE.search(text):
        return None
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"a lone surrogate \\u{ord(e.object[e.start]):04x} (half of a UTF-16 pair, not a character): "
            "write the character itself, or both halves of its pair"
        )
    return None


def _lines(data: bytes) -> list[bytes]:
    """The file's lines as a file object yields them (split after each ``\n``; no empty last line)."""
    parts = data.split(b"\n")
    lines = [x + b"\n" for x in parts[:-1]]
    return [*lines, parts[-1]] if parts[-1] else lines


def _read_jsonl(p: Path, data: bytes) -> list[Record]:
    out: list[Record] = []
    blank = 0
    for lineno, raw in enumerate(_lines(data), start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        elif lineno == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise ValueError(f"{p}:1: the file is UTF-16 (byte-order mark {raw[:2].hex()}); save it as UTF-8")
        line = _decode(p, raw, lineno)
        if not line.strip():
            blank += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{p}:{lineno}: {_TOO_DEEP}") from None
        if problem := lone_surrogate(obj, line):
            raise ValueError(f"{p}:{lineno}: {problem}")
        out.append(Record(f"{p}:{lineno}", obj))
    if not out:
        raise ValueError(
            f"{p}:1: no records ({f'only {blank} blank line(s)' if blank else 'the file is empty'})"
        )
    return out


def _read_json(p: Path, raw: bytes) -> list[Record]:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    text = ""
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        _decode(p, line, lineno)  # names the first line that is not UTF-8
    text = raw.decode("utf-8")
    dec = json.JSONDecoder()

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip(0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{p}:{line_of(pos)}: a .json data file must hold one JSON list of records")
    pos = skip(pos + 1)
    out: list[Record] = []
    while pos < len(text) and text[pos] != "]":
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{p}:{line_of(pos)}: {_TOO_DEEP}") from None
        if problem := lone_surrogate(obj, text[pos:end]):
            raise ValueError(f"{p}:{line_of(pos)}: {problem}")
        out.append(Record(f"{p}:{line_of(pos)}", obj))
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise ValueError(f"{p}:{line_of(pos)}: invalid JSON: expected ',' or ']' between records")
    if pos >= len(text):
        raise ValueError(f"{p}:{line_of(pos)}: invalid JSON: the list is not closed with ']'")
    return out


def _rows(table: Any, where: str) -> list[Record]:
    """One record per row; a column that is null in a row is left out of it (a table gives every row every
    column, so a row of another format, or one lacking a field, reads as it would from JSON Lines)."""
    return [
        Record(f"{where}:row {i + 1}", {k: v for k, v in row.items() if v is not None})
        for i, row in enumerate(table.to_pylist())
    ]


def _read_parquet(p: Path, raw: bytes) -> tuple[list[Record], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(raw))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"{p}:1: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    return _rows(table, str(p)), list(table.column_names)


def _read_folder(p: Path) -> tuple[list[Record], list[Record] | None, list[str]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # noqa: BLE001 - datasets raises FileNotFoundError / ValueError / others
        raise ValueError(
            f"{p}: not a folder written by datasets' save_to_disk ({type(exc).__name__}: {exc})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" not in ds:
            raise ValueError(f"{p}: the DatasetDict has splits {splits} but no 'train' split")
        held = next((s for s in ("test", "validation", "eval") if s in ds), None)
        train = _rows(ds["train"].data.table, f"{p}[train]")
        cols = list(ds["train"].column_names)
        return train, (_rows(ds[held].data.table, f"{p}[{held}]") if held else None), cols
    return _rows(ds.data.table, str(p)), None, list(ds.column_names)


def read_source(path: str | os.PathLike[str]) -> Source:
    """Read every record of ``path`` (see the module docstring): the file's bytes once, hashed and parsed;
    the same :class:`Source` again while the file is unchanged.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``"<file>:<line>: <problem>"``: not UTF-8, invalid JSON, an unreadable Parquet file or
            dataset folder, an unknown file type, or no records at all.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    key = _stat_key(p)
    if key is not None and key in _READ:
        _READ.move_to_end(key)
        return _READ[key]
    src = _read(p)
    if key is not None:
        _READ[key] = src
        while len(_READ) > _MEMO_FILES:
            _READ.popitem(last=False)
    return src


def _read(p: Path) -> Source:
    held: list[Record] | None = None
    cols: list[str] = []
    suffix = p.suffix.lower()
    if p.is_dir():
        records, held, cols = _read_folder(p)
        return _checked(p, Source(records, _sha_of_folder(p), held, "datasets", cols))
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(
            f"{p}:1: unknown data file type {suffix or '(no suffix)'!r}; use one of {', '.join(SOURCE_KINDS)}"
        )
    raw = p.read_bytes()  # the one open: hashed and parsed from these bytes
    sha = hashlib.sha256(raw).hexdigest()
    if suffix == ".jsonl":
        records, kind = _read_jsonl(p, raw), "jsonl"
    elif suffix == ".json":
        records, kind = _read_json(p, raw), "json"
    else:
        (records, cols), kind = _read_parquet(p, raw), "parquet"
    return _checked(p, Source(records=records, sha256=sha, held_out=held, kind=kind, columns=cols))


def _checked(p: Path, src: Source) -> Source:
    if not src.records:
        raise ValueError(f"{p}:1: no records (the file is empty)")
    return src
