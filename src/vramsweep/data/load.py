"""The user's data: ``data.path`` (+ ``data.eval_path``) -> normalised train and held-out records.

Held-out records come from ``data.eval_path``, else from a dataset folder's ``test`` / ``validation``
split, else they are the last 10 % of ``data.path`` (at least one record; ``data.path`` then needs two).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramsweep.data.documents import load_jsonl
from vramsweep.data.formats import Item, detect_format, normalize_records
from vramsweep.data.sources import read_source, source_sha256

__all__ = ["UserData", "load_user_data"]

EVAL_FRACTION = 0.1


@dataclass
class UserData:
    """Train and held-out records, their format, and the sha256 of each source (``path`` / ``eval_path``)."""

    train: list[Item]
    eval: list[Item]
    format: str
    eval_from: str
    sha256: dict[str, str] = field(default_factory=dict)


def load_user_data(path: str, eval_path: str | None = None, fmt: str = "auto") -> UserData:
    """Read, detect and normalise ``path`` (and ``eval_path``); see the module docstring for the split.

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: ``"<file>:<line>: <problem>"`` from :mod:`~vramsweep.data.sources` and
            :mod:`~vramsweep.data.formats`, a held-out file in another format, or too few records.
    """
    src = read_source(path)
    if (
        fmt in ("auto", "documents")
        and src.kind == "jsonl"
        and detect_format(src.records[0].obj) == "documents"
    ):
        return _jsonl_documents(path, eval_path, src.sha256)
    train = normalize_records(src.records, fmt)
    found = train[0].format
    sha = {"path": src.sha256}
    if eval_path:
        esrc = read_source(eval_path)
        held = normalize_records(esrc.records, fmt)
        if held[0].format != found:
            raise ValueError(
                f"{held[0].where}: data.eval_path is in format {held[0].format!r} but data.path is {found!r}"
            )
        sha["eval_path"] = esrc.sha256
        return UserData(train, held, found, "data.eval_path", sha)
    if src.held_out:
        held = normalize_records(src.held_out, fmt)
        if held[0].format != found:
            raise ValueError(
                f"{held[0].where}: the test split is in format {held[0].format!r}, train in {found!r}"
            )
        return UserData(train, held, found, "test split", sha)
    if len(train) < 2:
        raise ValueError(
            f"data.path={path}: need at least 2 records (or data.eval_path) for a held-out eval, "
            f"got {len(train)}"
        )
    n_eval = max(1, int(len(train) * EVAL_FRACTION))
    return UserData(train[:-n_eval], train[-n_eval:], found, "last 10 %", sha)


def _jsonl_documents(path: str, eval_path: str | None, sha: str) -> UserData:
    """Sectioned documents in JSON Lines: :func:`vramsweep.data.documents.load_jsonl` (its checks, e.g.
    duplicate ids, and messages)."""

    def items(p: str) -> list[Item]:
        return [
            Item(where=f"{p}:{d['id']}", id=d["id"], format="documents", kind="document", doc=d)
            for d in load_jsonl(p)
        ]

    train = items(path)
    hashes = {"path": sha}
    if eval_path:
        hashes["eval_path"] = source_sha256(eval_path)
        return UserData(train, items(eval_path), "documents", "data.eval_path", hashes)
    if len(train) < 2:
        raise ValueError(
            f"data.path={path}: need at least 2 documents (or data.eval_path) for a held-out eval"
        )
    n_eval = max(1, len(train) // 10)
    return UserData(train[:-n_eval], train[-n_eval:], "documents", "last 10 %", hashes)
