"""Held-out loss over one reference (issue 50, bug 4): every trial of a sweep over ``data.train_on`` scores the
same held-out tokens, and the eval-set fingerprint says which tokens a trial scored."""

from __future__ import annotations

import json

import pytest

from vramsweep.config import compose
from vramsweep.data.evalset import eval_set, fingerprint
from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.data.prep import trial_data
from vramsweep.data.tokenizer import load_tokenizer
from vramsweep.embedded import ASSET_DIR

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is six, as you can check by adding three to three."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET_DIR, embedded=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))


def _file(tmp_path, records) -> str:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(p)


def _data(path: str, tok, *extra: str):
    return trial_data(compose(["data=file", f"data.path={path}", *extra]), tok)


def _trained(examples) -> list[list[int]]:
    return [[i for i, t in enumerate(e.labels) if t != IGNORE_INDEX] for e in examples]


@pytest.mark.parametrize(
    ("records", "values", "default"),
    [
        ([{"messages": CHAT}] * 10, ("assistant", "last_assistant", "all"), "assistant"),
        ([{"prompt": "Q: 2+2? A:", "completion": " Four."}] * 10, ("completion", "all"), "completion"),
    ],
    ids=["messages", "prompt_completion"],
)
def test_a_sweep_over_train_on_scores_one_eval_set(tmp_path, tok, records, values, default):
    """Each data.train_on value trains its own mask, but the held-out examples are masked under the format's
    default: the same ids, labels and fingerprint for every value (before: the eval followed train_on, so
    assistant / last_assistant / all scored different tokens and their losses were ranked anyway)."""
    path = _file(tmp_path, records)
    runs = {v: _data(path, tok, f"data.train_on={v}") for v in values}
    train_masks = {v: _trained(d.train) for v, d in runs.items()}
    assert len({json.dumps(m) for m in train_masks.values()}) == len(values)  # the knob changes training
    ref = runs[default]
    for d in runs.values():
        assert [(e.input_ids, e.labels) for e in d.eval] == [(e.input_ids, e.labels) for e in ref.eval]
    assert {v: (d.stats["train_on"], d.stats["eval_train_on"]) for v, d in runs.items()} == {
        v: (v, default) for v in values
    }
    sets = {v: eval_set(d.eval, 1, d.stats) for v, d in runs.items()}
    assert len({json.dumps(s, sort_keys=True) for s in sets.values()}) == 1
    es = sets[default]
    assert es["train_on"] == default and es["examples"] == 1
    assert es["scored_tokens"] == len(_trained(ref.eval)[0]) - (ref.eval[0].labels[0] != IGNORE_INDEX)


def test_fingerprint_follows_every_change_to_the_scored_tokens(tmp_path, tok):
    """Knobs that change what the eval scores (context.max_tokens cutting a record, the template,
    train.eval_batches choosing the subset) change the fingerprint; one that does not, does not."""
    path = _file(tmp_path, [{"messages": CHAT}] * 20)
    base = _data(path, tok)
    fp = eval_set(base.eval, 1, base.stats)["fingerprint"]
    assert len(fp) == 16 and fp == fingerprint(base.eval[:4])
    assert eval_set(_data(path, tok, "data.train_on=all").eval, 1)["fingerprint"] == fp
    assert eval_set(_data(path, tok, "context.max_tokens=32").eval, 1)["fingerprint"] != fp
    other = tmp_path / "other.jinja"  # the tokenizer's own template behind a header line: another rendering
    other.write_text("{{ 'Chat log\\n' }}" + tok.chat_template)
    assert eval_set(_data(path, tok, f"data.chat_template={other}").eval, 1)["fingerprint"] != fp
    many = [{"messages": [*CHAT[:-1], {"role": "assistant", "content": f"Answer {i}."}]} for i in range(80)]
    varied = _data(_file(tmp_path, many), tok)
    assert eval_set(varied.eval, 1)["fingerprint"] != eval_set(varied.eval, 2)["fingerprint"]
    # one label more or less is another eval set, even over the same ids
    e = base.eval[0]
    k = next(i for i, t in enumerate(e.labels) if t != IGNORE_INDEX)
    fewer = [*e.labels[:k], IGNORE_INDEX, *e.labels[k + 1 :]]
    assert fingerprint([type(e)(**{**e.__dict__, "labels": fewer})]) != fingerprint([e])
