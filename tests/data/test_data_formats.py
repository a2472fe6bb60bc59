"""Data formats x sources x data.train_on, chat templates, conversation truncation, the tokenisation cache and
the shipped chat set. The embedded tokenizer throughout; ChatML and Qwen3's real template
(tests/fixtures/chat_templates/qwen3.jinja) on a copy of it with ``<|im_start|>`` / ``<|im_end|>`` added."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from vramsweep.config import compose
from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.data.formats import normalize_records
from vramsweep.data.render import RenderSettings, build_item_examples, render_item
from vramsweep.data.sources import Record, read_source
from vramsweep.data.templates import CHATML
from vramsweep.data.tokenizer import load_tokenizer
from vramsweep.embedded import ASSET_DIR

QWEN3 = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is six."},
]
RECORDS = {
    "messages": {"messages": CHAT},
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "Four."},
        ]
    },
    "prompt_completion": {"prompt": "The capital of France is", "completion": " Paris."},
    "prompt_completion_chat": {
        "prompt": [{"role": "user", "content": "Capital of France?"}],
        "completion": [{"role": "assistant", "content": "Paris."}],
    },
    "alpaca": {"instruction": "Add the numbers.", "input": "2 and 2", "output": "Four."},
    "text": {"text": "Plain language modelling text."},
}
#: record -> the text the default train_on trains (embedded template: <|eos|> ends a turn)
TRAINED = {
    "messages": "Four.<|eos|>It is six.<|eos|>",
    "sharegpt": "Four.<|eos|>",
    "prompt_completion": " Paris.<|eos|>",
    "prompt_completion_chat": "Paris.<|eos|>",
    "alpaca": "Four.<|eos|>",
    "text": "Plain language modelling text.<|eos|>",
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET_DIR, embedded=True)


@pytest.fixture(scope="module")
def im_tok():
    """The embedded tokenizer plus ChatML's two special tokens (a test copy: no model uses it)."""
    t = load_tokenizer(ASSET_DIR)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return t


def settings(train_on="assistant", template=None, max_tokens=4096, truncation="tail", **kw) -> RenderSettings:
    return RenderSettings(
        train_on=train_on,
        template=template,
        enable_thinking=kw.pop("enable_thinking", False),
        max_tokens=max_tokens,
        truncation=truncation,
        decay=kw.pop("decay", 0.5),
        min_tokens_per_section=kw.pop("min_tokens_per_section", 4),
    )


def items(*objs, fmt="auto"):
    return normalize_records([Record(f"f.jsonl:{i + 1}", o) for i, o in enumerate(objs)], fmt)


def trained_text(t, e) -> str:
    return t.decode([x for x in e.labels if x != IGNORE_INDEX])


def write(path: Path, objs: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    elif path.suffix == ".json":
        path.write_text(json.dumps(objs, indent=2))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(objs), path)
    else:
        import datasets

        n = max(1, len(objs) // 3)
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(objs[:-n]), "test": datasets.Dataset.from_list(objs[-n:])}
        ).save_to_disk(str(path))
    return path


# ------------------------------------------------------------------------------- formats x sources x train_on
DOC = {
    "sections": [
        {"heading": "Summary", "text": "ACME is led by Ada Byron."},
        {"heading": "Conclusions", "text": "In short, ACME is led by Ada Byron."},
    ],
    "facts": [{"key": "lead", "value": "Ada Byron", "stated_in": 0, "repeated_in": [1]}],
}
#: records whose train_on values each train something different (two assistant turns, a prompt with an
#: earlier answer, an alpaca history)
MATRIX = {
    "messages": {"messages": CHAT},
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "Four."},
            {"from": "human", "value": "And 3+3?"},
            {"from": "gpt", "value": "It is six."},
        ]
    },
    "prompt_completion": RECORDS["prompt_completion"],
    "prompt_completion_chat": {
        "prompt": [
            {"role": "user", "content": "Capital of Italy?"},
            {"role": "assistant", "content": "Rome."},
            {"role": "user", "content": "Capital of France?"},
        ],
        "completion": [{"role": "assistant", "content": "Paris."}],
    },
    "alpaca": {**RECORDS["alpaca"], "system": "Be brief.", "history": [["What is 1+1?", "Two."]]},
    "text": RECORDS["text"],
    "documents": DOC,
}
ALL = object()  # every token is trained
#: (record, data.train_on) -> the text its trained tokens decode to (embedded template: <|eos|> ends a turn)
EXPECT = {
    ("messages", "assistant"): "Four.<|eos|>It is six.<|eos|>",
    ("messages", "last_assistant"): "It is six.<|eos|>",
    ("messages", "all"): ALL,
    ("sharegpt", "assistant"): "Four.<|eos|>It is six.<|eos|>",
    ("sharegpt", "last_assistant"): "It is six.<|eos|>",
    ("sharegpt", "all"): ALL,
    ("prompt_completion", "completion"): " Paris.<|eos|>",
    ("prompt_completion", "all"): ALL,
    ("prompt_completion_chat", "completion"): "Paris.<|eos|>",
    ("prompt_completion_chat", "all"): ALL,
    ("alpaca", "completion"): "Four.<|eos|>",
    ("alpaca", "all"): ALL,
    ("text", "all"): ALL,
    ("documents", "auto"): "## Conclusions\nIn short, ACME is led by Ada Byron.\n\n<|eos|>",
}
SOURCES = [".jsonl", ".json", ".parquet", "_folder"]


@pytest.fixture(scope="module")
def file_cfg(tmp_path_factory):
    """``data=file`` composed once (the matrix sets data.path / data.train_on on copies: compose is slow)."""
    p = write(tmp_path_factory.mktemp("cfg") / "x.jsonl", [RECORDS["text"]] * 2)
    return compose(["data=file", f"data.path={p}", "context.max_tokens=512"])


@pytest.mark.parametrize("suffix", SOURCES)
@pytest.mark.parametrize(("fmt", "train_on"), list(EXPECT), ids=[f"{f}-{t}" for f, t in EXPECT])
def test_every_format_from_every_source_with_every_train_on(
    tmp_path, tok, file_cfg, monkeypatch, fmt, train_on, suffix
):
    """data=file data.path=<each source> data.train_on=<each value the format takes>: the format detected,
    the held-out split (the folder's test split, else the last 10 %), the trained tokens."""
    from vramsweep.data.prep import trial_data

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / f"data{suffix}", [MATRIX[fmt]] * 6)
    cfg = file_cfg.copy()
    cfg.data.path, cfg.data.train_on = str(path), train_on
    d = trial_data(cfg, tok)
    want_fmt = "prompt_completion" if fmt.startswith("prompt_completion") else fmt
    assert d.stats["format"] == want_fmt
    folder = suffix == "_folder"
    assert (len(d.train), len(d.eval)) == ((4, 2) if folder else (5, 1))
    assert d.stats["eval_from"] == ("test split" if folder else "last 10 %")
    assert d.stats["source_sha256"]["path"] == read_source(path).sha256
    if fmt != "documents":
        last = f"{path}[test]:row 1" if folder else read_source(path).records[-1].where
        assert d.eval[0].where == last
        assert d.stats["train_on"] == train_on
    # held-out records are masked under the format's default train_on whatever the trial trains (bug 4)
    default = next(t for f, t in EXPECT if f == fmt)
    for e, mask in [(e, train_on) for e in d.train] + [(e, default) for e in d.eval]:
        got = trained_text(tok, e)
        assert got == (tok.decode(e.input_ids) if EXPECT[fmt, mask] is ALL else EXPECT[fmt, mask])
        if EXPECT[fmt, mask] is not ALL:
            assert any(x == IGNORE_INDEX for x in e.labels)  # the prompt is not trained
    if fmt == "documents":  # the fact in the target is a fact span, from every source
        assert all(
            tok.decode(e.input_ids[a:b]).strip() == "Ada Byron" for e in d.train for a, b in e.fact_spans
        )
        assert all(e.fact_spans for e in d.train)


def test_every_train_on_is_in_the_matrix():
    from vramsweep.data.formats import FORMATS
    from vramsweep.data.render import train_on_choices

    for f in FORMATS:
        if f == "documents":
            continue
        for t in train_on_choices(f):
            assert (f, t) in EXPECT, (f, t)
    assert {("prompt_completion_chat", t) for t in train_on_choices("prompt_completion")} <= set(EXPECT)


@pytest.mark.parametrize("suffix", SOURCES)
def test_mixed_formats_in_one_source_are_an_error(tmp_path, suffix):
    """Columnar sources give every row every column (null where a record lacks it): a row of another
    format is still named, as in JSON Lines."""
    from vramsweep.data.load import load_user_data

    chat = {"messages": CHAT[1:3]}
    path = tmp_path / f"mixed{suffix}"
    if suffix in (".jsonl", ".json"):
        write(path, [chat, chat, {"text": "plain"}])
    else:
        import pyarrow as pa

        table = pa.table({"messages": [CHAT[1:3], CHAT[1:3], None], "text": [None, None, "plain"]})
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path)
        else:
            import datasets

            datasets.Dataset(table).save_to_disk(str(path))
    rows = read_source(path).records
    with pytest.raises(ValueError) as e:
        load_user_data(str(path))
    assert str(e.value) == (
        f"{rows[2].where}: this record is in format 'text' but {rows[0].where} is 'messages': one file holds "
        "one format (set data.format to check it)"
    )


def test_json_locations_name_the_line(tmp_path):
    p = write(tmp_path / "d.json", [{"text": "a"}, {"text": "b"}])
    assert [r.where for r in read_source(p).records] == [f"{p}:2", f"{p}:5"]


def test_data_format_setting_checks_every_record():
    with pytest.raises(
        ValueError, match=r"f.jsonl:1: data.format=alpaca needs the field\(s\) \['instruction', 'output'\]"
    ):
        items({"text": "x"}, fmt="alpaca")
    assert items({"text": "x"}, fmt="text")[0].kind == "text"


# ------------------------------------------------------------------------------------ the chat template
def test_ids_are_the_tokenization_of_the_rendered_text(tok, im_tok):
    for t, template in ((tok, tok.chat_template), (im_tok, CHATML), (im_tok, QWEN3)):
        s = settings(template=template)
        (it,) = items({"messages": CHAT})
        text, _ = render_item(it, t, s)
        assert text == t.apply_chat_template(
            CHAT, tokenize=False, chat_template=template, enable_thinking=False
        )
        (e,) = build_item_examples([it], t, s)
        assert e.input_ids == t(text, add_special_tokens=False)["input_ids"]
        want = t.apply_chat_template(CHAT, chat_template=template, enable_thinking=False)["input_ids"]
        assert e.input_ids == want


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_trained_tokens_are_the_assistant_contents_and_their_end_of_turn(im_tok, template):
    s = settings(template=CHATML if template == "chatml" else QWEN3)
    (e,) = build_item_examples(items({"messages": CHAT}), im_tok, s)
    assert trained_text(im_tok, e) == "Four.<|im_end|>It is six.<|im_end|>"
    (last,) = build_item_examples(
        items({"messages": CHAT}), im_tok, settings(train_on="last_assistant", template=s.template)
    )
    assert trained_text(im_tok, last) == "It is six.<|im_end|>"
    (every,) = build_item_examples(
        items({"messages": CHAT}), im_tok, settings(train_on="all", template=s.template)
    )
    assert all(x != IGNORE_INDEX for x in every.labels)


def test_qwen3_thinking_switch_is_a_setting(im_tok):
    """enable_thinking=True (Qwen3's default) renders the last turn with its empty think block and trains it."""
    s = settings(template=QWEN3, enable_thinking=True)
    (e,) = build_item_examples(items({"messages": CHAT}), im_tok, s)
    assert trained_text(im_tok, e) == "Four.<|im_end|><think>\n\n</think>\n\nIt is six.<|im_end|>"


def test_a_tokenizer_without_template_needs_the_setting(im_tok):
    (it,) = items({"messages": CHAT})
    with pytest.raises(ValueError, match="set data.chat_template= one of chatml, embedded"):
        render_item(it, im_tok, settings(template=None))


def test_prompt_completion_and_alpaca_train_the_completion(tok):
    pc, al = items(RECORDS["prompt_completion"])[0], items(RECORDS["alpaca"])[0]
    (e,) = build_item_examples([pc], tok, settings("completion"))
    assert tok.decode(e.input_ids) == "The capital of France is Paris.<|eos|>"
    (a,) = build_item_examples([al], tok, settings("completion", template=tok.chat_template))
    assert "Add the numbers.\n\n2 and 2" in tok.decode(a.input_ids)
    assert trained_text(tok, a) == "Four.<|eos|>"
    (f,) = build_item_examples([pc], tok, settings("all"))
    assert all(x != IGNORE_INDEX for x in f.labels)


def test_train_on_that_does_not_apply_is_refused(tmp_path):
    from vramsweep.data.prep import render_settings

    p = write(tmp_path / "t.jsonl", [RECORDS["text"]] * 2)
    cfg = compose(["data=file", f"data.path={p}", "data.train_on=completion"])
    with pytest.raises(
        ValueError, match="data.train_on=completion does not apply to format 'text'; use auto or one of all"
    ):
        render_settings(cfg, None, "text")


def test_fact_spans_lie_in_trained_answers(tok):
    rec = {"messages": CHAT[1:3], "facts": ["Four"]}
    (e,) = build_item_examples(items(rec), tok, settings(template=tok.chat_template))
    ((s, t),) = e.fact_spans
    assert tok.decode(e.input_ids[s:t]) == "Four" and all(e.labels[i] != IGNORE_INDEX for i in range(s, t))


# ------------------------------------------------------------------------------------------------ length
def _long_chat(n_turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "SYSTEM PROMPT"}]
    for i in range(n_turns):
        msgs += [
            {"role": "user", "content": f"question {i} " + "and more words " * 12},
            {"role": "assistant", "content": f"answer {i} is short"},
        ]
    return msgs


def test_a_long_conversation_keeps_the_system_prompt_and_the_newest_turns(tok):
    (it,) = items({"messages": _long_chat(8)})
    (e,) = build_item_examples([it], tok, settings(template=tok.chat_template, max_tokens=200))
    text = tok.decode(e.input_ids)
    assert len(e.input_ids) <= 200 and text.startswith("<|bos|>system\nSYSTEM PROMPT<|eos|>")
    assert "answer 7 is short" in text and "question 0 " not in text
    kept = [i for i in range(8) if f"answer {i} is short" in text]
    assert kept == list(range(kept[0], 8))  # the newest turns, contiguous
    assert trained_text(tok, e) == "".join(f"answer {i} is short<|eos|>" for i in kept)


def test_exp_decay_over_turns_cuts_older_user_turns_never_a_trained_span(tok):
    (it,) = items({"messages": _long_chat(8)})
    tail = build_item_examples([it], tok, settings(template=tok.chat_template, max_tokens=200))[0]
    exp = build_item_examples(
        [it], tok, settings(template=tok.chat_template, max_tokens=200, truncation="exp_decay", decay=0.9)
    )[0]
    assert len(exp.input_ids) <= 200
    answers = [i for i in range(8) if f"answer {i} is short<|eos|>" in trained_text(tok, exp)]
    tail_answers = [i for i in range(8) if f"answer {i} is short" in tok.decode(tail.input_ids)]
    assert len(answers) > len(tail_answers)  # older exchanges survive with their user turns cut
    assert trained_text(tok, exp) == "".join(f"answer {i} is short<|eos|>" for i in answers)
    assert "question 7 " + "and more words " * 12 in tok.decode(exp.input_ids)  # the newest turn is whole


def test_truncation_none_names_the_longest_record(tok):
    from vramsweep.data.truncation import ContextOverflowError

    its = items({"messages": _long_chat(2)}, {"messages": _long_chat(5)}, {"messages": CHAT})
    with pytest.raises(ContextOverflowError, match=r"f.jsonl:2: \d+ tokens, the longest of 2 of 3 records"):
        build_item_examples(its, tok, settings(template=tok.chat_template, max_tokens=64, truncation="none"))


def test_truncation_none_stops_tokenising_at_the_first_batch_holding_a_record_too_long(tok, monkeypatch):
    """A 55 MB JSONL with ``truncation=none`` was refused only after every record was
    tokenised (~60 s). Records are tokenised longest first in batches and the check stops at the first batch
    that holds one too long, naming its ``file:line`` (counted: records tokenised, not time)."""
    from vramsweep.data import render, truncation
    from vramsweep.data.truncation import ContextOverflowError

    monkeypatch.setattr(truncation, "CHECK_BATCH_CHARS", 4000, raising=False)
    tokenised: list[str] = []
    encode = render._encode
    monkeypatch.setattr(render, "_encode", lambda t, texts: tokenised.extend(texts) or encode(t, texts))
    short = [{"messages": CHAT}] * 300
    its = items(*short[:150], {"messages": _long_chat(8)}, *short[150:])
    with pytest.raises(ContextOverflowError, match=r"f.jsonl:151: \d+ tokens, the longest of 1 ") as exc:
        build_item_examples(its, tok, settings(template=tok.chat_template, max_tokens=64, truncation="none"))
    assert 0 < len(tokenised) < 100, f"{len(tokenised)} of 301 records tokenised before the refusal"
    said = f"longer than context.max_tokens=64 among the {len(tokenised)} of 301 records tokenised, longest first"
    assert said in str(exc.value), exc.value


def test_truncation_none_in_batches_gives_the_examples_of_one_pass(tok, monkeypatch):
    """A data set that fits is tokenised whole, batch by batch, into the same examples as one pass."""
    from vramsweep.data import truncation

    its = items(*[{"messages": _long_chat(k % 5 + 1)} for k in range(40)], {"messages": CHAT})
    one_pass = build_item_examples(its, tok, settings(template=tok.chat_template, max_tokens=4096))
    monkeypatch.setattr(truncation, "CHECK_BATCH_CHARS", 700, raising=False)
    none = settings(template=tok.chat_template, max_tokens=4096, truncation="none")
    assert build_item_examples(its, tok, none) == one_pass


# ----------------------------------------------------------------------------------------- trial data
def _cfg(tmp_path, path, *extra):
    return compose(["data=file", f"data.path={path}", f"+results_dir={tmp_path}/r", *extra])


def test_trial_data_records_format_hash_counts_and_lengths(tmp_path, tok, monkeypatch):
    from vramsweep.data.prep import trial_data

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    p = write(tmp_path / "c.jsonl", [{"messages": CHAT}] * 10)
    d = trial_data(compose(["data=file", f"data.path={p}"]), tok)
    st = d.stats
    assert (st["format"], st["train_on"], st["eval_from"], st["cache"]) == (
        "messages",
        "assistant",
        "last 10 %",
        "miss",
    )
    assert len(st["source_sha256"]["path"]) == 64
    n = len(d.train[0].input_ids)
    assert st["train"]["trained_tokens"] == 9 * len(
        tok("Four.<|eos|>It is six.<|eos|>", add_special_tokens=False)["input_ids"]
    )
    assert st["train"]["prompt_tokens"] + st["train"]["trained_tokens"] == 9 * n
    assert st["train"]["length_distribution"] == {"min": n, "p50": n, "p90": n, "p99": n, "max": n}
    again = trial_data(compose(["data=file", f"data.path={p}"]), tok)
    assert again.stats["cache"] == "hit" and [e.input_ids for e in again.train] == [
        e.input_ids for e in d.train
    ]
    changed = trial_data(compose(["data=file", f"data.path={p}", "data.train_on=last_assistant"]), tok)
    assert changed.stats["cache"] == "miss"


def _worker(args):
    cache, path = args
    import os

    os.environ["VRAMSWEEP_CACHE"] = cache
    from vramsweep.data.prep import trial_data

    return trial_data(
        compose(["data=file", f"data.path={path}"]), load_tokenizer(ASSET_DIR, embedded=True)
    ).stats["cache"]


def test_concurrent_workers_tokenize_once(tmp_path):
    p = write(tmp_path / "c.jsonl", [{"messages": CHAT}] * 50)
    with multiprocessing.get_context("fork").Pool(4) as pool:
        got = pool.map(_worker, [(str(tmp_path / "cache"), str(p))] * 4)
    assert sorted(got) == ["hit", "hit", "hit", "miss"]
    assert [q.name for q in (tmp_path / "cache" / "data").iterdir() if q.suffix == ".pkl"].__len__() == 1


def test_the_shipped_chat_set_is_deterministic_and_answers_from_the_report(tok, monkeypatch, tmp_path):
    from vramsweep.data.chatset import generate_chats
    from vramsweep.data.prep import trial_data

    a, b = generate_chats(3, 1234), generate_chats(3, 1234)
    assert a == b
    for rec in a:
        report = rec["messages"][1]["content"]
        for v in rec["facts"]:
            assert v in report and any(v in m["content"] for m in rec["messages"] if m["role"] == "assistant")
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    d = trial_data(
        compose(["data=grant_chat", "data.num_docs=4", "data.num_eval_docs=2", "context.max_tokens=2048"]),
        tok,
    )
    assert d.stats["format"] == "messages" and len(d.train) == 4 and len(d.eval) == 2
    assert all(e.fact_spans for e in d.train)


def test_the_instruction_prefix_can_be_empty_and_applies_to_documents_only(tok):
    from vramsweep.data.examples import build_examples
    from vramsweep.data.synthetic import generate_documents

    doc = generate_documents(1, 1234)[:1]
    kw = dict(max_tokens=512, truncation="tail", decay=0.5, min_tokens_per_section=16)
    with_text = build_examples(doc, tok, instructions="Write the next section.", **kw)[0]
    empty = build_examples(doc, tok, instructions="", **kw)[0]
    n = len(tok("Write the next section.", add_special_tokens=False)["input_ids"])
    assert empty.input_ids[:2] == [tok.bos_token_id, tok.sep_token_id]
    assert trained_text(tok, empty) == trained_text(tok, with_text)
    assert len(with_text.input_ids) - len(empty.input_ids) in (n, 0)  # 0 when tail truncation used the room
    (chat,) = build_item_examples(items({"messages": CHAT}), tok, settings(template=tok.chat_template))
    assert "Write the next" not in tok.decode(chat.input_ids)


def test_vocab_slicing_keeps_the_templates_special_tokens(tok):
    from vramsweep.knobs.vocab_slice import kept_ids

    (e,) = build_item_examples(items({"messages": CHAT}), tok, settings(template=tok.chat_template))
    kept = set(kept_ids(tok, [e.input_ids], mode="corpus"))
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} <= kept and set(e.input_ids) <= kept


@pytest.mark.slow
def test_a_four_trial_sweep_tokenizes_once(tmp_path, embedded_model_dir, monkeypatch):
    """The pre-flight builds the examples (the one tokenizer pass); the 4 real trials read them from the cache."""
    from vramsweep.sweeper import run_multirun

    conf = tmp_path / "conf"
    (conf / "sweep").mkdir(parents=True)
    (conf / "sweep" / "chat4.yaml").write_text(
        "# @package _global_\n# Launch: vramsweep train -m sweep=chat4\n"
        "defaults:\n  - override /hydra/sweeper: vramsweep\n"
        "sweep:\n  name: chat4\n  design: ablation\n"
        "  objectives:\n    - {metric: peak_memory_bytes, direction: minimize}\n"
        "  baseline: [adapter=lora]\n  factors:\n    - [adapter=rslora]\n  repeats: 2\n"
    )
    monkeypatch.setenv("VRAMSWEEP_CONFIG_DIR", str(conf))
    data = write(tmp_path / "chats.jsonl", [{"messages": CHAT, "id": f"{tmp_path}-{i}"} for i in range(8)])
    rc = run_multirun(
        ["sweep=chat4", "data=file", f"data.path={data}", f"results_dir={tmp_path}", "train.steps=2"]
        + ["train.measure_warmup_steps=1", "context.max_tokens=128"]
    )
    assert rc == 0
    res = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "sweeps" / "chat4" / "trials").glob("*.json"))
    ]
    assert len(res) == 4 and all(r["status"] == "ok" for r in res)
    assert [r["meta"]["data"]["cache"] for r in res] == ["hit"] * 4
    assert len({r["meta"]["data"]["cache_key"] for r in res}) == 1


class _CountingTokenizer:
    """The embedded tokenizer, counting its passes: encode calls (each a batch or a text) and renders."""

    def __init__(self, base):
        self._base, self.encodes, self.renders = base, 0, 0

    def __call__(self, *a, **kw):
        self.encodes += 1
        return self._base(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.renders += 1
        return self._base.apply_chat_template(*a, **kw)

    @property
    def backend_tokenizer(self):  # what data/render.py calls for a fast tokenizer: counted the same
        outer, backend = self, self._base.backend_tokenizer

        class _Backend:
            def encode_batch(self, *a, **kw):
                outer.encodes += 1
                return backend.encode_batch(*a, **kw)

            def __getattr__(self, name):
                return getattr(backend, name)

        return _Backend()

    def __getattr__(self, name):
        return getattr(self._base, name)


def test_a_four_trial_sweep_tokenizes_once_counted(tmp_path, tok, monkeypatch):
    """The pre-flight's data check and 4 trials that differ in their knobs (not in the data): one tokenizer
    pass, at the pre-flight; the trials read the cache. A data setting that changes the examples builds
    again."""
    from vramsweep.data.prep import build_trial_data, trial_data

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    p = write(tmp_path / "c.jsonl", [{"messages": CHAT, "id": f"c{i}"} for i in range(20)])
    base = ["data=file", f"data.path={p}", "context.max_tokens=256"]
    counting = _CountingTokenizer(tok)
    build_trial_data(compose(base), counting)  # what the pre-flight's check_records does
    once = (counting.encodes, counting.renders)
    assert once[0] >= 1 and once[1] >= 20  # the records encoded (one batch), every record rendered
    trials = [
        ["adapter=lora"],
        ["adapter=rslora"],
        ["adapter=lora", "train.seed=2"],
        ["adapter=rslora", "train.seed=2"],
    ]
    got = [trial_data(compose([*base, *t]), counting).stats["cache"] for t in trials]
    assert got == ["hit"] * 4 and (counting.encodes, counting.renders) == once
    trial_data(compose([*base, "data.train_on=last_assistant"]), counting)
    assert counting.encodes > once[0]


def test_vocab_slicing_keeps_a_templates_added_special_tokens(im_tok):
    """ChatML's <|im_start|>/<|im_end|> (added special tokens) survive slicing in every mode, even top_k with
    a K far below what the examples use."""
    from vramsweep.knobs.vocab_slice import kept_ids

    (e,) = build_item_examples(items({"messages": CHAT}), im_tok, settings(template=CHATML))
    marks = set(im_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    assert marks <= set(e.input_ids)
    for mode, k in (("corpus", 0), ("top_k", 3)):
        kept = set(kept_ids(im_tok, [e.input_ids], mode=mode, top_k=k))
        assert marks | {im_tok.eos_token_id, im_tok.pad_token_id} <= kept, mode


def test_load_tokenizer_builds_what_autotokenizer_builds_without_the_auto_registry(tok):
    """The embedded tokenizer loads through its own class (the pre-flight's bad chat record exits sooner):
    the same class, ids, specials, template and cache fingerprint as ``AutoTokenizer`` gives."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from vramsweep.data.cache import tokenizer_fingerprint

    auto = AutoTokenizer.from_pretrained(str(ASSET_DIR))
    assert type(auto) is type(tok) and tokenizer_fingerprint(auto) == tokenizer_fingerprint(tok)
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert (
        auto(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    )
    code = (
        "import sys; from vramsweep.data.tokenizer import load_tokenizer; from vramsweep.embedded import ASSET_DIR;"
        "load_tokenizer(ASSET_DIR, embedded=True); print('transformers.models.auto.modeling_auto' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_encode_through_the_rust_backend_gives_the_tokenizers_own_ids_and_offsets(tok):
    """data/render.py encodes through a fast tokenizer's backend: the same ids and offsets as the
    tokenizer's own call (unicode, newlines, an empty text); a backend with truncation set in its
    tokenizer.json goes through the tokenizer's call, which does not cut (a cut would hide an overflow)."""
    import copy

    from vramsweep.data.render import _encode

    texts = ["Hello, wörld — naïve café.\n\nSecond line", "", "a" * 300, "日本語のテキスト and more"]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    want = [(list(i), [tuple(o) for o in offs]) for i, offs in zip(enc["input_ids"], enc["offset_mapping"])]
    got = [(list(i), [tuple(o) for o in offs]) for i, offs in _encode(tok, texts)]
    assert got == want
    cut = copy.deepcopy(tok)
    cut.backend_tokenizer.enable_truncation(8)
    assert [len(i) for i, _ in _encode(cut, texts)] == [len(i) for i, _ in want]


def test_a_cache_entry_is_written_whole_through_the_one_writer(tmp_path, monkeypatch):
    """The data cache's pickle goes through ``record/atomic.py``: a write that fails before the rename leaves
    no entry and no temp file (the next call builds again), a good one lands whole and readable by the team."""
    import os

    from vramsweep.data.cache import cached
    from vramsweep.record import atomic

    def boom(*_a):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        cached({"k": 1}, lambda: [1, 2], folder=tmp_path / "d")
    assert [p for p in os.listdir(tmp_path / "d") if not p.endswith(".lock")] == []
    monkeypatch.undo()
    assert cached({"k": 1}, lambda: [1, 2], folder=tmp_path / "d")[:2] == ([1, 2], "miss")
    assert cached({"k": 1}, lambda: [3], folder=tmp_path / "d")[:2] == ([1, 2], "hit")
    (entry,) = (tmp_path / "d").glob("*.pkl")
    assert oct(entry.stat().st_mode & 0o777) == oct(0o666 & ~atomic.current_umask())
