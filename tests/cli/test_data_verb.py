"""``vramsweep data``: the records as the trial sees them (the same cached examples), trained tokens marked,
per-record and total counts, lengths and the held-out source; ``--json`` for scripts; bad input exits 2."""

from __future__ import annotations

import io
import json

import pytest

from vramsweep.cli import main

SHORT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."},
    ]
}


def _long(k: int) -> dict:
    """A conversation whose first user turn is long: over context.max_tokens=64 it loses that exchange."""
    msgs = [dict(m) for m in SHORT["messages"]]
    msgs[1]["content"] = "What is 2+2? " * k
    return {"messages": msgs}


@pytest.fixture
def chats(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "c.jsonl"
    recs = [SHORT, _long(20), SHORT, _long(30), SHORT, SHORT, SHORT, SHORT, SHORT, _long(40)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_lists_each_trained_span_and_counts(chats, capsys):
    """One object per record with the decoded trained spans (as data.train_on says), then the totals: a
    record cut to context.max_tokens is counted truncated; the held-out record is scored under the default."""
    base = ["data=file", f"data.path={chats}", "context.max_tokens=64"]
    assert main(["data", *base, "--records", "all", "--json"]) == 0
    lines = _json_lines(capsys.readouterr().out)
    recs, summary = lines[:-1], lines[-1]
    assert [r["kind"] for r in recs] == ["record"] * 9 and summary["kind"] == "summary"
    assert recs[0]["trained"] == ["Four.<|eos|>", "Six.<|eos|>"] and not recs[0]["truncated"]
    assert recs[1]["trained"] == ["Six.<|eos|>"]  # the long first exchange is cut: only the last is left
    assert recs[1]["truncated"] and recs[1]["untruncated_tokens"] > 64 >= recs[1]["tokens"]
    assert [r["where"].rsplit(":", 1)[1] for r in recs if r["truncated"]] == ["2", "4"]
    assert summary["train"] == {
        "records": 9,
        "examples": 9,
        "tokens": sum(r["tokens"] for r in recs),
        "trained": sum(r["trained_tokens"] for r in recs),
        "truncated": 2,
        "dropped": 0,
        "boundary_merged": 0,  # the embedded tokenizer keeps a boundary space apart
    }
    assert summary["eval"]["truncated"] == 1 and summary["eval_from"] == "last 10 %"
    assert (summary["train_on"], summary["eval_train_on"]) == ("assistant", "assistant")

    assert main(["data", *base, "data.train_on=last_assistant", "--records", "1", "--json"]) == 0
    lines = _json_lines(capsys.readouterr().out)
    assert len(lines) == 2 and lines[0]["trained"] == ["Six.<|eos|>"]
    assert (lines[1]["train_on"], lines[1]["eval_train_on"]) == ("last_assistant", "assistant")


def test_text_marks_trained_tokens_and_reads_the_trials_cache(chats, capsys, monkeypatch):
    """Brackets when not a terminal; colour on one; the examples are the trial's (a cache hit after
    trial_data built them)."""
    from vramsweep.config import compose
    from vramsweep.data.prep import trial_data
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.dataview import show
    from vramsweep.embedded import ASSET_DIR

    over = ["data=file", f"data.path={chats}", "context.max_tokens=64"]
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    trial_data(compose(over), tok)
    assert main(["data", *over, "--records", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(
        "format messages, train_on assistant, template tokenizer, enable_thinking false, cache hit"
    )
    assert "<|bos|>assistant\n[[Four.<|eos|>]]\n" in out and "[[Six.<|eos|>]]" in out
    assert "--- example 2 of 9 (" in out and "truncated from" in out
    assert "train: 9 records -> 9 examples" in out and ", 2 truncated, 0 dropped, 0 boundary-merged" in out
    assert "held-out records: last 10 % (1), scored under train_on assistant" in out
    assert "lengths (train, tokens): min " in out and "(context.max_tokens=64)" in out

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = Tty()
    show(compose(over), tok, 1, out=tty)
    assert "\x1b[1;32mFour.<|eos|>\x1b[0m" in tty.getvalue() and "[[" not in tty.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    tty = Tty()
    show(compose(over), tok, 1, out=tty)
    assert "[[Four.<|eos|>]]" in tty.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.train_on=completion"], "data.train_on=completion does not apply to format 'messages'"),
        (["data.path=/nonexistent/x.jsonl"], "/nonexistent/x.jsonl"),
        (["data=random"], "data=random: random tokens, no records to show"),
        (["--records", "x"], "--records=x (allowed: a number >= 0, or all)"),
        (["quant=nope"], "quant=nope"),
    ],
)
def test_bad_input_exits_2_with_one_line(chats, tmp_path, capsys, args, message):
    base = [] if args[0] == "data=random" else ["data=file", f"data.path={chats}"]
    assert main(["data", *base, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramsweep data: error: ") and "\n" not in err and message in err


def test_help_names_the_docs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["data", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--records N" in out and "--json" in out and "docs: docs/DATA.md" in out


def test_boundary_merged_spans_are_counted_where_the_data_step_marks_them():
    """``Example.boundary_merged`` (set by the data step where a token straddles the prompt/answer
    boundary) is shown per record and summed; an example without the field counts 0."""
    from vramsweep.data.examples import Example
    from vramsweep.dataview import Split, record

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    plain = Example(
        input_ids=[1, 2, 3], labels=[-100, 2, 3], doc_id="a", target_section=0, n_context_tokens=1
    )
    merged = Example(input_ids=[4, 5], labels=[-100, 5], doc_id="b", target_section=0, n_context_tokens=1)
    merged.boundary_merged = 1
    split = Split("train", [plain, merged], {("a", 0): 3, ("b", 0): 2}, 2)
    assert [record(split, i, e, Tok())["boundary_merged"] for i, e in enumerate(split.examples)] == [0, 1]
    assert split.totals()["boundary_merged"] == 1 and record(split, 0, plain, Tok())["trained"] == ["2 3"]
