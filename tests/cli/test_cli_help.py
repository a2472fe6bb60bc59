"""``vramsweep --help`` and ``vramsweep <verb> --help``: the verbs, the config groups and
their options, and the docs page for each verb and topic."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.torchfree

REPO = Path(__file__).resolve().parents[2]


def test_help_names_only_existing_docs_pages() -> None:
    from vramsweep.cli_help import doc_paths

    pages = doc_paths()
    assert "docs/KNOBS.md" in pages
    assert all((REPO / p).exists() for p in pages), [p for p in pages if not (REPO / p).exists()]


def test_help_lists_verbs_groups_options_and_docs(capsys) -> None:
    from vramsweep.cli import main

    for argv, want in (
        (["--help"], ["vramsweep report <sweep dir>", "quant ", "nf4_dq", "docs/KNOBS.md", "docs/SWEEPS.md"]),
        (["train", "--help"], ["paged_adamw_8bit", "vramsweep pick <sweep dir>", "docs: docs/CLI.md"]),
        (["estimate", "--help"], ["docs: docs/ESTIMATOR.md"]),
        (["report", "--help"], ["docs: docs/READING_A_SWEEP.md"]),
        (["pick", "--help"], ["docs: docs/READING_A_SWEEP.md"]),
    ):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr().out
        assert code == 0, argv
        for w in want:
            assert w in out, (argv, w)
