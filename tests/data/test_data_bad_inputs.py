"""Bad records of every format exit 2 before anything is built: ``vramsweep train data=file
data.path=<bad>`` prints one line ``vramsweep train: error: ...`` naming ``file:line`` (``file:row N`` for
Parquet and dataset folders) and the problem, in under 10 s of wall time, and writes nothing: no results
folder, no tokenisation-cache entry (``$VRAMSWEEP_CACHE`` points at a folder that must stay absent).

Run in-process through :func:`vramsweep.cli.main` (the console script's entry point); the first case that
reads a tokenizer pays the transformers/torch imports, which the 10 s include. The 10 s are the process's
CPU time: wall time on a shared 2-core test machine measures its neighbours (a wall bound of 60 s guards
against a hang).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from vramsweep.cli import main

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def _parquet(columns: dict) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def _files(d: Path) -> dict[str, Path]:
    """The bad inputs (written before the snapshot of what exists)."""
    m = GOOD["messages"]
    files = {
        "unknown.jsonl": _line(GOOD) + _line({"foo": 1, "bar": "x"}),
        "role.jsonl": _line(GOOD) + _line(_chat(("user", "hi"), ("narrator", "x"), ("assistant", "y"))),
        "sharegpt_role.jsonl": _line(
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]}
        ),
        "no_assistant.jsonl": _line(GOOD) + _line(_chat(("system", "s"), ("user", "hi"))),
        "empty_content.jsonl": _line(GOOD) * 2 + _line(_chat(("user", "hi"), ("assistant", " \n"))),
        "pc_empty_completion.jsonl": _line({"prompt": "q", "completion": "a"})
        + _line({"prompt": "q", "completion": ""}),
        "alpaca_empty_output.json": b"[\n"
        + _line({"instruction": "a", "output": "b"})[:-1]
        + b",\n"
        + _line({"instruction": "a", "output": ""})
        + b"]",
        "no_trained.jsonl": _line({"prompt": "word " * 200, "completion": "yes"})
        + _line({"prompt": "q", "completion": "a"}),
        "mixed.jsonl": _line(GOOD) * 2 + _line({"instruction": "a", "output": "b"}),
        "mixed.parquet": _parquet({"messages": [m, m, None], "text": [None, None, "plain"]}),
        "no_output.parquet": _parquet({"instruction": ["a", "b"], "input": ["", ""]}),
        "latin1.jsonl": _line(GOOD) + b'{"text": "caf\xe9"}\n',
        "latin1.json": b'[\n{"text": "ok"},\n{"text": "caf\xe9"}\n]',
        "long.jsonl": _line(GOOD)
        + _line(_chat(("user", "word " * 300), ("assistant", "fine")))
        + _line(GOOD),
        "good.jsonl": _line(GOOD) * 3,
        "bad.jinja": b"{{ raise_exception('this template refuses') }}",
    }
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    import datasets

    folder = d / "folder"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([GOOD] * 3),
            "test": datasets.Dataset.from_list([GOOD, _chat(("user", "hi"), ("user", "again"))]),
        }
    ).save_to_disk(str(folder))
    out["folder"] = folder
    from vramsweep.embedded import ASSET_DIR

    notpl = d / "model_without_template"  # the embedded model's files, without its chat template
    notpl.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET_DIR / f, notpl / f)
    out["model_without_template"] = notpl
    return out


# (id, overrides with {file} placeholders, what the one line must contain: file:line and the problem)
CASES = [
    ("unknown-format", ["data.path={unknown.jsonl}"],
     "unknown.jsonl:2: unknown format: keys found ['bar', 'foo']; accepted formats: messages ('messages'), "
     "sharegpt ('conversations'), prompt_completion ('prompt' + 'completion'), alpaca ('instruction' + 'output'), "
     "documents ('sections'), text ('text')"),
    ("unknown-role", ["data.path={role.jsonl}"],
     "role.jsonl:2: messages[1]: unknown role 'narrator'; roles are system, user, assistant, tool"),
    ("unknown-role-sharegpt", ["data.path={sharegpt_role.jsonl}"],
     "sharegpt_role.jsonl:1: conversations[1]: unknown role 'bot'; sharegpt roles are human, user, gpt"),
    ("no-assistant-turn", ["data.path={no_assistant.jsonl}"],
     "no_assistant.jsonl:2: 'messages' has no assistant turn: nothing to train on"),
    ("empty-content", ["data.path={empty_content.jsonl}"],
     "empty_content.jsonl:3: messages[1] (assistant) has empty content"),
    ("empty-completion", ["data.path={pc_empty_completion.jsonl}"], "pc_empty_completion.jsonl:2: 'completion' is empty"),
    ("empty-output", ["data.path={alpaca_empty_output.json}"], "alpaca_empty_output.json:3: 'output' is empty"),
    ("no-trained-token", ["data.path={no_trained.jsonl}", "context.max_tokens=32", "context.truncation=head"],
     "no_trained.jsonl:1: no trained token after masking (data.train_on=completion, cut to context.max_tokens=32)"),
    ("too-long-error", ["data.path={no_trained.jsonl}", "context.max_tokens=32", "data.too_long=error"],
     "data.too_long=error: {no_trained.jsonl}:1: "),
    ("too-long-value", ["data.path={no_trained.jsonl}", "data.too_long=cut"], "data.too_long"),
    ("mixed-formats", ["data.path={mixed.jsonl}"],
     "mixed.jsonl:3: this record is in format 'alpaca' but {mixed.jsonl}:1 is 'messages': one file holds one format"),
    ("mixed-formats-parquet", ["data.path={mixed.parquet}"],
     "mixed.parquet:row 3: this record is in format 'text' but {mixed.parquet}:row 1 is 'messages'"),
    ("parquet-column-missing", ["data.path={no_output.parquet}", "data.format=alpaca"],
     "no_output.parquet:row 1: data.format=alpaca needs the column(s) ['output'], missing here; the record has "
     "['input', 'instruction']"),
    ("parquet-column-missing-auto", ["data.path={no_output.parquet}"],
     "no_output.parquet:row 1: unknown format: keys found ['input', 'instruction']"),
    ("folder-test-split", ["data.path={folder}"], "folder[test]:row 2: 'messages' has no assistant turn"),
    ("template-fails", ["data.path={good.jsonl}", "data.chat_template={bad.jinja}"],
     "good.jsonl:1: the chat template failed to render this record: TemplateError: this template refuses"),
    ("no-template", ["data.path={good.jsonl}", "model=local", "model.path={model_without_template}"],
     "data.chat_template: {good.jsonl}:1: the tokenizer has no chat template; set data.chat_template= one of "
     "chatml, embedded or a path to a Jinja file"),
    ("not-utf8-jsonl", ["data.path={latin1.jsonl}"], "latin1.jsonl:2: not UTF-8 (byte 0xe9 at column 14)"),
    ("not-utf8-json", ["data.path={latin1.json}"], "latin1.json:3: not UTF-8 (byte 0xe9"),
    ("truncation-none-too-long", ["data.path={long.jsonl}", "context.max_tokens=64", "context.truncation=none"],
     "long.jsonl:2: "),
]  # fmt: skip


def _fill(arg: str, files: dict[str, Path]) -> str:
    for name, path in files.items():
        arg = arg.replace("{" + name + "}", str(path))
    return arg


@pytest.mark.parametrize(("case_id", "argv", "needle"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_record_exits_2_naming_file_and_line(tmp_path, capsys, monkeypatch, case_id, argv, needle):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(cache))
    d = tmp_path / "in"
    d.mkdir()
    files = _files(d)
    before = {p for p in tmp_path.rglob("*")}
    capsys.readouterr()
    t0, cpu0 = time.perf_counter(), time.process_time()
    code = main(["train", "data=file", *(_fill(a, files) for a in argv), f"results_dir={tmp_path / 'res'}"])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    _out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("vramsweep train: error: "), lines[0]
    assert _fill(needle, files) in lines[0], lines[0]
    assert cpu < 10 and wall < 60, f"{case_id}: {cpu:.1f} s CPU ({wall:.1f} s wall) before exit 2"
    assert {p for p in tmp_path.rglob("*")} == before and not cache.exists()


def test_truncation_none_names_the_longest_records_line_and_length(tmp_path, capsys, monkeypatch):
    """Item 5: ``context.truncation=none`` refuses in the pre-flight with the longest record's file:line and its
    length in tokens (the record's own rendering through the template, counted as the trial counts it)."""
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    longest = _chat(("user", "word " * 300), ("assistant", "fine"))
    p = tmp_path / "c.jsonl"
    p.write_bytes(_line(GOOD) + _line(_chat(("user", "word " * 100), ("assistant", "ok"))) + _line(longest))
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    n = len(tok.apply_chat_template(longest["messages"], tokenize=True)["input_ids"])
    code = main(["train", "data=file", f"data.path={p}", "context.max_tokens=64", "context.truncation=none"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{p}:3: {n} tokens, the longest of 2 of 3 records longer than context.max_tokens=64" in err, err


def test_truncation_none_on_documents_stops_tokenising_at_the_first_batch_with_one_too_long(
    tmp_path, monkeypatch
):
    """Sectioned documents with ``context.truncation=none`` were all tokenised before the
    pre-flight counted the examples too long. Documents go longest first in batches and the check stops at
    the first batch holding one, naming it (counted: sections tokenised, not time)."""
    from vramsweep.config import ConfigError, compose
    from vramsweep.data import truncation
    from vramsweep.preflight import _Tokens, check_data

    monkeypatch.setattr(truncation, "CHECK_BATCH_CHARS", 2000, raising=False)
    tokenised: list[str] = []
    lengths = _Tokens.lengths
    monkeypatch.setattr(
        _Tokens, "lengths", lambda self, texts: tokenised.extend(texts) or lengths(self, texts)
    )

    def doc(i: int, words: int) -> dict:
        sections = [{"heading": f"h{j}", "text": f"section {j} " + "word " * words} for j in range(2)]
        return {"id": f"d{i}", "title": "t", "sections": sections}

    docs = [doc(i, 3) for i in range(300)]
    docs[150] = {**doc(150, 200), "id": "big"}
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = compose(
        ["data=jsonl", f"data.path={p}", "context.truncation=none", "context.max_tokens=96"], rules="none"
    )
    with pytest.raises(
        ConfigError, match=r"context.truncation=none: 1 of \d+ examples.*document 'big'"
    ) as exc:
        check_data(cfg)
    sections = [t for t in tokenised if "word" in t]
    assert 0 < len(sections) < 100, f"{len(sections)} of 600 sections tokenised before the refusal"
    assert f"examples of the {len(sections) // 2} of 300 documents tokenised, longest first," in str(
        exc.value
    )
