"""What ships: the docs the source cites exist, and a non-editable install runs from another folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cited_docs_exist():
    """A docstring that says "see DESIGN.md §5" sends the reader to a file this repository does not have."""
    missing = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for doc in re.findall(r"\b((?:[\w.-]+/)*[A-Z][\w-]*\.md)\b", line):
                if not (ROOT / doc).is_file() and not (ROOT / "docs" / doc).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {doc}")
    assert not missing, "\n".join(missing)
