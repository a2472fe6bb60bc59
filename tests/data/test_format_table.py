"""One format table (issue 50, wanted 7): a format is one row (detection keys, normaliser, data.train_on
choices and default, builders, an example record); detection, normalisation, data.train_on, data.format's
allowed values and the error listing the accepted formats all read it, so adding a format is one row."""

from __future__ import annotations

import json

import pytest

from vramsweep.config import compose
from vramsweep.config.compose import ConfigError
from vramsweep.data import formats as formats_module
from vramsweep.data.formats import FORMAT_TABLE, Format, Item, detect_format, normalize_records
from vramsweep.data.prep import trial_data
from vramsweep.data.render import default_train_on, train_on_choices
from vramsweep.data.sources import Record
from vramsweep.data.tokenizer import load_tokenizer
from vramsweep.embedded import ASSET_DIR


@pytest.mark.parametrize("row", FORMAT_TABLE, ids=[f.name for f in FORMAT_TABLE])
def test_every_row_detects_and_normalises_its_example(row):
    obj = json.loads(row.example)
    assert detect_format(obj) == row.name
    (item,) = normalize_records([Record("x.jsonl:1", obj)])
    assert item.format == row.name and item.kind in row.kinds
    assert train_on_choices(row.name) == row.train_on
    if row.train_on:
        assert default_train_on(row.name) == row.train_on[0]


def test_names_and_keys_are_unique_and_documents_are_a_row():
    names = [f.name for f in FORMAT_TABLE]
    assert len(set(names)) == len(names) and "documents" in names
    assert len({f.keys for f in FORMAT_TABLE}) == len(FORMAT_TABLE)
    assert formats_module.FORMATS == tuple(names)


def _qa(obj: dict, base: dict) -> Item:
    msgs = [{"role": "user", "content": obj["question"]}, {"role": "assistant", "content": obj["answer"]}]
    return Item(**base, kind="chat", messages=msgs)


def test_adding_a_format_is_one_row(tmp_path, monkeypatch):
    """A new row (question/answer records, normalised to two chat turns) and nothing else: its records are
    detected, data.format accepts its name, data.train_on its choices, and a trial's examples are built."""
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    row = Format(
        "qa", ("question", "answer"), _qa, ("assistant", "all"), ("chat",), '{"question": "", "answer": ""}'
    )
    monkeypatch.setattr(formats_module, "FORMAT_TABLE", (*FORMAT_TABLE, row))
    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i}+{i}?", "answer": f"{2 * i}."}) + "\n" for i in range(10))
    )
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    data = trial_data(compose(["data=file", f"data.path={path}", "data.format=qa", "data.train_on=all"]), tok)
    assert data.stats["format"] == "qa" and data.stats["train_on"] == "all"
    assert data.stats["eval_train_on"] == "assistant" and len(data.train) == 9
    with pytest.raises(
        ValueError, match=r"data.train_on=completion does not apply to format 'qa'; use auto or"
    ):
        trial_data(compose(["data=file", f"data.path={path}", "data.train_on=completion"]), tok)
    with pytest.raises(
        ValueError, match=r"accepted formats: messages \('messages'\), .*, qa \('question' \+"
    ):
        normalize_records([Record("y.jsonl:1", {"query": "?"})])
    monkeypatch.setattr(formats_module, "FORMAT_TABLE", FORMAT_TABLE)
    with pytest.raises(ConfigError, match="data.format"):
        compose(["data=file", f"data.path={path}", "data.format=qa"])
