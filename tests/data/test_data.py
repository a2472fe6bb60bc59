"""Data layer: synthetic documents, tokenizer, JSONL documents, training examples."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from transformers import AutoTokenizer

from vramsweep.data.documents import document_text, format_section, load_jsonl, value_occurs, write_jsonl
from vramsweep.data.examples import (
    IGNORE_INDEX,
    Example,
    build_examples,
    collate,
    examples_stats,
    span_exact_match,
)
from vramsweep.data.synthetic import FACT_KEYS, generate_documents, pretrain_texts
from vramsweep.data.tokenizer import SPECIAL_TOKENS, train_tokenizer
from vramsweep.data.truncation import ContextOverflowError

INSTR = "Write the next section of this grant report."


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return generate_documents(4, seed=7)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(pretrain_texts(12, seed=0), vocab_size=1500)


def build(docs, tok, **kw):
    args = dict(
        max_tokens=1024, truncation="exp_decay", decay=0.5, min_tokens_per_section=16, instructions=INSTR
    )
    return build_examples(docs, tok, **(args | kw))


# ----------------------------------------------------------------------------------------------- synthetic
def test_generate_is_deterministic_and_prefix_stable(docs):
    assert generate_documents(4, seed=7) == docs
    assert generate_documents(2, seed=7) == docs[:2]
    assert generate_documents(4, seed=8) != docs
    assert len({d["id"] for d in generate_documents(30, seed=7)}) == 30


def test_generate_does_not_touch_the_global_rng():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_documents(2, seed=1)
    pretrain_texts(1, seed=1)
    assert random.random() == expected


def test_document_shape_and_size():
    for doc in generate_documents(12, seed=3):
        assert set(doc) == {"id", "title", "sections", "facts"}
        assert 10 <= len(doc["sections"]) <= 14
        headings = [s["heading"] for s in doc["sections"]]
        assert headings[:3] == ["Project summary", "Consortium", "Objectives"]
        assert headings[-2:] == ["Financial summary", "Conclusions"]
        assert sum(h.startswith("Work package") for h in headings) >= 2
        assert "Budget" in headings
        assert "| TOTAL |" in doc["sections"][headings.index("Budget")]["text"]
        words = len(document_text(doc).split())
        assert 1500 <= words <= 4000, words


def test_facts_are_stated_early_and_repeated_verbatim_later():
    for doc in generate_documents(12, seed=5):
        texts = [format_section(s) for s in doc["sections"]]
        assert [f["key"] for f in doc["facts"]] == list(FACT_KEYS)
        for f in doc["facts"]:
            assert f["repeated_in"] and all(r > f["stated_in"] for r in f["repeated_in"])
            assert f["stated_in"] < len(texts) - 3  # an early/middle section
            # stated_in is the first section containing the value; each repeat contains it verbatim
            assert not any(value_occurs(t, f["value"]) for t in texts[: f["stated_in"]])
            assert value_occurs(texts[f["stated_in"]], f["value"])
            for r in f["repeated_in"]:
                assert value_occurs(texts[r], f["value"])
            between = range(f["stated_in"] + 1, min(f["repeated_in"]))
            assert not any(value_occurs(texts[j], f["value"]) for j in between)


def test_budget_total_is_the_sum_of_the_rows(docs):
    for doc in docs:
        budget = next(s["text"] for s in doc["sections"] if s["heading"] == "Budget")
        rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d,]+) \|$", budget, flags=re.M))
        total = int(rows.pop("TOTAL").replace(",", ""))
        assert total == sum(int(v.replace(",", "")) for v in rows.values())
        fact = next(f for f in doc["facts"] if f["key"] == "budget_total")
        assert int(fact["value"].replace(",", "")) == total


def test_pretrain_texts_use_a_separate_stream(docs):
    texts = pretrain_texts(4, seed=7)
    assert texts == pretrain_texts(4, seed=7)
    assert all(t.startswith("## Project summary\n") for t in texts)
    assert not set(texts) & {document_text(d) for d in docs}


# ----------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_specials_and_determinism(tok):
    again = train_tokenizer(pretrain_texts(12, seed=0), vocab_size=1500)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id, tok.sep_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    other = train_tokenizer(pretrain_texts(12, seed=1), vocab_size=1500)
    assert other.backend_tokenizer.to_str() != tok.backend_tokenizer.to_str()


def test_tokenizer_roundtrips_text_and_adds_no_specials(tok):
    text = "Ünïcode — budget of EUR 1,234,500 (ÅÄÖ) 🚀\n## Budget\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & set(range(len(SPECIAL_TOKENS)))
    assert len(tok) <= 1500


def test_tokenizer_save_and_autotokenizer_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    text = document_text(generate_documents(1, seed=1)[0])[:2000]
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token, loaded.eos_token, loaded.bos_token, loaded.unk_token) == SPECIAL_TOKENS[:4]


def test_tokenizer_trains_on_2mb_in_seconds():
    texts = pretrain_texts(150, seed=11)
    assert sum(map(len, texts)) > 1_900_000
    start = time.perf_counter()
    big = train_tokenizer(texts, vocab_size=4096)
    assert time.perf_counter() - start < 30
    assert 2000 < len(big) <= 4096


def test_tokenizer_rejects_bad_input():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="non-empty"):
        train_tokenizer(["", ""], vocab_size=1000)


# ----------------------------------------------------------------------------------------------- documents
def test_jsonl_roundtrip(docs, tmp_path):
    path = tmp_path / "sub" / "docs.jsonl"
    write_jsonl(docs, path)
    assert load_jsonl(path) == docs
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(docs)


def test_jsonl_minimal_document_gets_defaults(tmp_path):
    path = tmp_path / "min.jsonl"
    path.write_text('\n{"sections": [{"text": "a"}, {"heading": "H", "text": "b"}]}\n\n', encoding="utf-8")
    (doc,) = load_jsonl(path)
    assert doc["id"] == "min:2"
    assert doc["title"] == "" and doc["facts"] == []
    assert doc["sections"] == [{"heading": "", "text": "a"}, {"heading": "H", "text": "b"}]
    assert format_section(doc["sections"][0]) == "a\n\n"
    assert format_section(doc["sections"][1]) == "## H\nb\n\n"


GOOD = {"id": "x", "sections": [{"text": "one"}, {"text": "total 1,200 here"}, {"text": "again 1,200."}]}


@pytest.mark.parametrize(
    "line,problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "a"}', "missing required field 'sections'"),
        ('{"sections": []}', "non-empty list"),
        ('{"sections": [{"heading": "h"}]}', r"sections\[0\] is missing required field 'text'"),
        ('{"sections": [{"text": 3}]}', r"sections\[0\].text must be a string"),
        ('{"sections": [{"text": "a", "heading": 1}]}', r"sections\[0\].heading must be a string"),
        ('{"id": 5, "sections": [{"text": "a"}]}', "'id' must be a non-empty string"),
        (
            json.dumps(GOOD | {"facts": [{"key": "t", "value": "1,200", "stated_in": 1}]}),
            r"facts\[0\] is missing required field 'repeated_in'",
        ),
        (
            json.dumps(GOOD | {"facts": [{"key": "t", "value": "1,200", "stated_in": 5, "repeated_in": []}]}),
            r"facts\[0\].stated_in must be a section index in \[0, 3\)",
        ),
        (
            json.dumps(
                GOOD | {"facts": [{"key": "t", "value": "1,200", "stated_in": 2, "repeated_in": [1]}]}
            ),
            "repeats must come after stated_in=2",
        ),
        (
            json.dumps(
                GOOD | {"facts": [{"key": "t", "value": "1,200", "stated_in": 0, "repeated_in": [2]}]}
            ),
            "value '1,200' does not occur in section 0",
        ),
    ],
)
def test_jsonl_bad_line_names_file_line_and_problem(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{problem}"):
        load_jsonl(path)


def test_jsonl_duplicate_ids_and_empty_file(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"dup\.jsonl:2: duplicate id 'x' \(first on line 1\)"):
        load_jsonl(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.jsonl:1: no records \(only 1 blank line\(s\)\)"):
        load_jsonl(empty)


def test_write_jsonl_validates_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="document 1: missing required field 'sections'"):
        write_jsonl([GOOD, {"id": "y"}], path)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_value_occurs_respects_word_and_number_boundaries():
    assert value_occurs("in four work packages", "four")
    assert not value_occurs("in fourteen work packages", "four")
    assert value_occurs("EUR 1,200.", "1,200")
    assert not value_occurs("EUR 31,200", "1,200") and not value_occurs("EUR 1,200,500", "1,200")


# ----------------------------------------------------------------------------------------------- examples
def test_example_layout_and_labels(docs, tok):
    examples = build(docs[:1], tok)
    doc = docs[0]
    assert [e.target_section for e in examples] == list(range(1, len(doc["sections"])))
    instr = tok(INSTR, add_special_tokens=False)["input_ids"]
    for e in examples:
        assert e.doc_id == doc["id"]
        assert len(e.input_ids) == len(e.labels) <= 1024
        n_prompt = e.labels.index(next(t for t in e.labels if t != IGNORE_INDEX))
        assert all(t == IGNORE_INDEX for t in e.labels[:n_prompt])
        assert e.labels[n_prompt:] == e.input_ids[n_prompt:]
        assert e.input_ids[: 2 + len(instr)] == [tok.bos_token_id, *instr, tok.sep_token_id]
        assert e.input_ids[n_prompt - 1] == tok.sep_token_id
        assert n_prompt == 3 + len(instr) + e.n_context_tokens
        target = tok(format_section(doc["sections"][e.target_section]), add_special_tokens=False)["input_ids"]
        assert e.input_ids[n_prompt:] == [*target, tok.eos_token_id]


def test_context_is_the_truncated_earlier_sections(docs, tok):
    doc = docs[1]
    secs = [tok(format_section(s), add_special_tokens=False)["input_ids"] for s in doc["sections"]]
    examples = build([doc], tok, max_tokens=600, truncation="tail")
    prefix = 2 + len(tok(INSTR, add_special_tokens=False)["input_ids"])
    for e in examples:
        i = e.target_section
        whole = [t for s in secs[:i] for t in s]
        budget = 600 - prefix - 1 - (len(secs[i]) + 1)
        if budget >= 0:
            assert e.n_context_tokens == min(budget, len(whole))
            context = e.input_ids[prefix : prefix + e.n_context_tokens]
            assert context == (whole[len(whole) - e.n_context_tokens :] if e.n_context_tokens else [])
        else:  # target alone overflows: first tokens of the target, no context, exactly max_tokens
            assert e.n_context_tokens == 0 and len(e.input_ids) == 600


def test_examples_never_exceed_max_tokens_and_target_overflow_is_cut(docs, tok):
    for strategy in ("head", "tail", "exp_decay"):
        examples = build(docs, tok, max_tokens=200, truncation=strategy)
        assert all(len(e.input_ids) <= 200 for e in examples)
        long_targets = [e for e in examples if e.n_context_tokens == 0 and len(e.input_ids) == 200]
        assert long_targets  # work-package sections are far longer than 200 tokens
        for e in long_targets:
            doc = next(d for d in docs if d["id"] == e.doc_id)
            full = tok(format_section(doc["sections"][e.target_section]), add_special_tokens=False)[
                "input_ids"
            ]
            kept = [t for t in e.labels if t != IGNORE_INDEX]
            assert len(kept) == 200 - 3 - len(tok(INSTR, add_special_tokens=False)["input_ids"])
            assert kept == full[: len(kept)]  # the target's first tokens (no EOS: it was cut)


def test_truncation_none_raises_when_over_and_matches_when_fits(docs, tok):
    with pytest.raises(ContextOverflowError, match="section"):
        build(docs[:1], tok, max_tokens=512, truncation="none")
    with pytest.raises(ContextOverflowError, match="target alone"):
        build(docs[:1], tok, max_tokens=64, truncation="none")
    roomy = dict(max_tokens=20000)
    assert [e.input_ids for e in build(docs[:1], tok, truncation="none", **roomy)] == [
        e.input_ids for e in build(docs[:1], tok, truncation="head", **roomy)
    ]


def test_max_tokens_too_small_for_instructions(docs, tok):
    with pytest.raises(ValueError, match="no room for a target"):
        build(docs[:1], tok, max_tokens=5)


def test_fact_spans_cover_the_repeated_values(docs, tok):
    examples = build(docs, tok, max_tokens=4096)
    by_key = {(e.doc_id, e.target_section): e for e in examples}
    n_checked = 0
    for doc in docs:
        for f in doc["facts"]:
            for r in f["repeated_in"]:
                e = by_key[(doc["id"], r)]
                decoded = [tok.decode(e.input_ids[s:t]).strip() for s, t in e.fact_spans]
                assert f["value"] in decoded
                n_checked += 1
        for e in (by_key[(doc["id"], i)] for i in range(1, len(doc["sections"]))):
            first_target = next(k for k, t in enumerate(e.labels) if t != IGNORE_INDEX)
            assert all(first_target <= s < t <= len(e.input_ids) - 1 for s, t in e.fact_spans)
            repeated_here = any(e.target_section in f["repeated_in"] for f in doc["facts"])
            assert bool(e.fact_spans) == repeated_here
    assert n_checked >= len(docs) * len(FACT_KEYS)


def test_fact_spans_do_not_depend_on_truncation(docs, tok):
    a = build(docs[:2], tok, max_tokens=512, truncation="tail")
    b = build(docs[:2], tok, max_tokens=512, truncation="head")
    for x, y in zip(a, b):
        off_x = len(x.input_ids) - len([t for t in x.labels if t != IGNORE_INDEX])
        off_y = len(y.input_ids) - len([t for t in y.labels if t != IGNORE_INDEX])
        assert [(s - off_x, t - off_x) for s, t in x.fact_spans] == [
            (s - off_y, t - off_y) for s, t in y.fact_spans
        ]


def test_build_examples_is_deterministic(docs, tok):
    a = build(docs, tok, max_tokens=300)
    b = build(generate_documents(4, seed=7), tok, max_tokens=300)
    assert a == b


def test_exp_decay_context_differs_from_tail_and_head(docs, tok):
    kw = dict(max_tokens=700)
    ctx = {
        s: [e.input_ids for e in build(docs[:1], tok, truncation=s, **kw)]
        for s in ("head", "tail", "exp_decay")
    }
    assert ctx["head"] != ctx["tail"] != ctx["exp_decay"] != ctx["head"]


def test_collate_pads_right(tok):
    examples = [
        Example(input_ids=[5, 6, 7], labels=[-100, 6, 7], doc_id="a", target_section=1, n_context_tokens=0),
        Example(input_ids=[8, 9], labels=[-100, 9], doc_id="b", target_section=1, n_context_tokens=0),
    ]
    batch = collate(examples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    with pytest.raises(ValueError):
        collate([], pad_id=0)


def test_examples_stats(docs, tok):
    examples = build(docs[:2], tok, max_tokens=512)
    stats = examples_stats(examples)
    assert stats["count"] == len(examples)
    assert stats["max_length"] == max(len(e.input_ids) for e in examples) <= 512
    assert stats["mean_length"] == pytest.approx(sum(len(e.input_ids) for e in examples) / len(examples))
    assert stats["frac_with_facts"] == pytest.approx(
        sum(bool(e.fact_spans) for e in examples) / len(examples)
    )
    assert 0 < stats["frac_with_facts"] < 1
    assert examples_stats([])["count"] == 0


def test_span_exact_match_is_teacher_forced():
    ids = [9, 1, 2, 3, 4]
    perfect = [1, 2, 3, 4, 0]  # pred_next[t] predicts ids[t + 1]
    assert span_exact_match(perfect, ids, [(1, 3), (3, 5)]) == [True, True]
    one_wrong = [1, 2, 7, 4, 0]  # position 2 predicts 7 instead of ids[3] = 3
    assert span_exact_match(torch.tensor(one_wrong), torch.tensor(ids), [(1, 3), (3, 5)]) == [True, False]
    with pytest.raises(ValueError):
        span_exact_match(perfect, ids, [(0, 2)])
