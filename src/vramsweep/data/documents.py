"""Long-document input: JSONL reading/writing, validation and the text rendering of sections.

JSONL format (``data=jsonl data.path=train.jsonl``): UTF-8, one JSON object per line, blank lines ignored::

    {"id": "grant-0001",                       # optional str; default "<file stem>:<line number>"
     "title": "Coastal flood forecasting",     # optional str; default ""
     "sections": [                             # required, non-empty, oldest (first) to newest (last)
        {"heading": "Project summary",         # optional str; default ""
         "text": "FLOODCAST is coordinated by ..."},   # required str
        ...],
     "facts": [                                # optional; what the task score checks
        {"key": "budget_total",                # str, a name for reports
         "value": "1,234,500",                 # str, occurs verbatim in every listed section
         "stated_in": 4,                       # int, the section that first gives the value
         "repeated_in": [11]}]}                # ints > stated_in: later sections that repeat it

Each training example asks the model to write section ``i`` given the instructions and the (truncated)
sections ``0..i-1``; a fact's value inside a ``repeated_in`` target is predictable only from its
``stated_in`` section, which is what the task score measures. Unknown keys are kept but ignored. Every
problem raises ``ValueError`` naming the file, the line number and the problem.

A section is rendered for the model as ``"## {heading}\\n{text}\\n\\n"`` (``"{text}\\n\\n"`` without a
heading): see :func:`format_section`. Training examples and the embedded model's pre-training text use the
same rendering.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vramsweep.data.sources import read_source
from vramsweep.record.result import atomic_write_text

__all__ = [
    "document_text",
    "format_section",
    "load_jsonl",
    "normalize_document",
    "value_pattern",
    "value_occurs",
    "write_jsonl",
]


def format_section(section: dict[str, Any]) -> str:
    """The text of one section as the model sees it: ``## heading`` line, the text, a blank line."""
    heading = section.get("heading") or ""
    text = section["text"]
    return f"## {heading}\n{text}\n\n" if heading else f"{text}\n\n"


def document_text(doc: dict[str, Any]) -> str:
    """A whole document as plain text (its sections rendered by :func:`format_section`, in order)."""
    return "".join(format_section(s) for s in doc["sections"])


def value_occurs(text: str, value: str) -> bool:
    """Whether ``value`` occurs in ``text`` as a whole token (not inside a longer word or number)."""
    return value_pattern(value).search(text) is not None


def value_pattern(value: str) -> re.Pattern[str]:
    """The regex :func:`value_occurs` uses: ``value`` not preceded by a word char or comma, not followed by a
    word char or by a comma and a digit (so ``"four"`` does not match ``"fourteen"``, nor ``"1,200"`` match
    inside ``"31,200"`` or ``"1,200,500"``)."""
    return re.compile(rf"(?<![\w,]){re.escape(value)}(?!\w|,\d)")


def normalize_document(obj: Any, *, default_id: str) -> dict[str, Any]:
    """Validate one parsed document and return it with defaults filled in.

    Raises:
        ValueError: with a message naming the offending field (without file/line; callers add those).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    sections = obj.get("sections")
    if sections is None:
        raise ValueError("missing required field 'sections'")
    if not isinstance(sections, list) or not sections:
        raise ValueError('\'sections\' must be a non-empty list of {"heading", "text"} objects')
    norm_sections = [_normalize_section(i, s) for i, s in enumerate(sections)]
    doc_id = obj.get("id", default_id)
    if not isinstance(doc_id, str) or not doc_id:
        raise ValueError(f"'id' must be a non-empty string, got {doc_id!r}")
    title = obj.get("title", "")
    if title is None:
        title = ""
    if not isinstance(title, str):
        raise ValueError(f"'title' must be a string, got {type(title).__name__}")
    facts = obj.get("facts", [])
    if facts is None:
        facts = []
    if not isinstance(facts, list):
        raise ValueError(f"'facts' must be a list, got {type(facts).__name__}")
    norm_facts = [_normalize_fact(j, f, norm_sections) for j, f in enumerate(facts)]
    return {**obj, "id": doc_id, "title": title, "sections": norm_sections, "facts": norm_facts}


def _normalize_section(i: int, s: Any) -> dict[str, Any]:
    """Section ``i`` of a document, validated, with its heading defaulted to ``""``."""
    if not isinstance(s, dict):
        raise ValueError(f"sections[{i}] must be an object, got {type(s).__name__}")
    if "text" not in s:
        raise ValueError(f"sections[{i}] is missing required field 'text'")
    if not isinstance(s["text"], str):
        raise ValueError(f"sections[{i}].text must be a string, got {type(s['text']).__name__}")
    heading = s.get("heading", "")
    if heading is None:
        heading = ""
    if not isinstance(heading, str):
        raise ValueError(f"sections[{i}].heading must be a string, got {type(heading).__name__}")
    return {**s, "heading": heading, "text": s["text"]}


def _normalize_fact(j: int, f: Any, norm_sections: list[dict[str, Any]]) -> dict[str, Any]:
    """Fact ``j`` of a document, validated against the document's (normalised) sections: its value occurs
    where it is stated and repeated, and repeats come after the statement; ``repeated_in`` comes back
    sorted and deduplicated."""
    n = len(norm_sections)
    where = f"facts[{j}]"
    if not isinstance(f, dict):
        raise ValueError(f"{where} must be an object, got {type(f).__name__}")
    for key in ("key", "value", "stated_in", "repeated_in"):
        if key not in f:
            raise ValueError(f"{where} is missing required field {key!r}")
    if not isinstance(f["key"], str) or not isinstance(f["value"], str) or not f["value"]:
        raise ValueError(f"{where}: 'key' and 'value' must be strings ('value' non-empty)")
    stated = f["stated_in"]
    if isinstance(stated, bool) or not isinstance(stated, int) or not 0 <= stated < n:
        raise ValueError(f"{where}.stated_in must be a section index in [0, {n}), got {stated!r}")
    rep = f["repeated_in"]
    if not isinstance(rep, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in rep):
        raise ValueError(f"{where}.repeated_in must be a list of section indices, got {rep!r}")
    for r in rep:
        if not stated < r < n:
            raise ValueError(
                f"{where}.repeated_in contains {r}: repeats must come after stated_in={stated} "
                f"and be < {n} (the number of sections)"
            )
    for r in (stated, *rep):
        if not value_occurs(format_section(norm_sections[r]), f["value"]):
            raise ValueError(f"{where}: value {f['value']!r} does not occur in section {r}")
    return {**f, "repeated_in": sorted(set(rep))}


def load_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read documents from a JSONL file (format in the module docstring), through the one reader
    (:func:`vramsweep.data.sources.read_source`: its decoder and error style, the file read once).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: ``"<path>:<line>: <problem>"`` for bad JSON, a missing/ill-typed field, a fact that does
            not occur where it says, a duplicate id, or a file without documents.
    """
    p = Path(path)
    docs: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for rec in read_source(p).records:
        lineno = int(rec.where.rsplit(":", 1)[1])
        try:
            doc = normalize_document(rec.obj, default_id=f"{p.stem}:{lineno}")
        except ValueError as e:
            raise ValueError(f"{rec.where}: {e}") from None
        if doc["id"] in seen:
            raise ValueError(f"{rec.where}: duplicate id {doc['id']!r} (first on line {seen[doc['id']]})")
        seen[doc["id"]] = lineno
        docs.append(doc)
    return docs


def write_jsonl(docs: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write documents as JSONL (UTF-8, one per line), atomically (temp file + fsync + rename).

    Each document is validated first, so a file written here always loads with :func:`load_jsonl`.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, doc in enumerate(docs):
        try:
            normalize_document(doc, default_id=f"{p.stem}:{i + 1}")
        except ValueError as e:
            raise ValueError(f"document {i}: {e}") from None
        lines.append(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))

    atomic_write_text(p, "".join(f"{line}\n" for line in lines))
