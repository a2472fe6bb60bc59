"""Held-out loss over one reference (issue 50, bug 4): every trial of a sweep over ``data.train_on`` scores the
same held-out tokens, and the eval-set fingerprint says which tokens a trial scored."""

from __future__ import annotations

import json

import pytest

from vramsweep.config import compose
from vramsweep.data.evalset import eval_set, fingerprint
from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.data.prep import trial_data
from vramsweep.data.reference import SWEEP_DIR_ENV, reference_of, sweep_reference
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


def _in_sweep(tmp_path, monkeypatch, reference: dict) -> None:
    """This process as a trial of a sweep whose sweep.json records ``reference`` (as the sweeper writes it)."""
    folder = tmp_path / "sweep"
    folder.mkdir(exist_ok=True)
    (folder / "sweep.json").write_text(json.dumps({"name": "s", "eval_reference": reference}))
    monkeypatch.setenv(SWEEP_DIR_ENV, str(folder))


def test_every_trial_of_a_sweep_scores_the_baseline_reference(tmp_path, tok, monkeypatch):
    """Trials that train with another template, thinking switch, data.train_on or a longer context score the
    held-out records rendered under the sweep baseline's (read from sweep.json): one fingerprint, the same
    scored tokens. Before, each trial rendered the held-out records under its own template and context, so
    these trials scored different tokens and report/pick refused to rank them."""
    many = [
        {"messages": [*CHAT[:-1], {"role": "assistant", "content": f"It is {i} " * 30}]} for i in range(40)
    ]
    path = _file(tmp_path, many)
    other = tmp_path / "other.jinja"
    other.write_text("{{ 'Chat log\\n' }}" + tok.chat_template)
    base = ["data=file", f"data.path={path}", "context.max_tokens=512"]
    _in_sweep(tmp_path, monkeypatch, reference_of(compose(base)))
    trials = {
        "baseline": [],
        "last_assistant": ["data.train_on=last_assistant"],
        "template": [f"data.chat_template={other}"],
        "thinking": ["data.enable_thinking=true"],
        "longer": ["context.max_tokens=1024"],
    }
    data = {name: trial_data(compose([*base, *extra]), tok) for name, extra in trials.items()}
    sets = {name: eval_set(d.eval, 2, d.stats) for name, d in data.items()}
    assert {n: s["fingerprint"] for n, s in sets.items()} == dict.fromkeys(
        trials, sets["baseline"]["fingerprint"]
    )
    assert {s["scored_tokens"] for s in sets.values()} == {sets["baseline"]["scored_tokens"]}
    assert {d.stats["eval_reference"]["from"] for d in data.values()} == {"sweep baseline"}
    assert all(s["comparable"] for s in sets.values())
    assert sets["template"]["reference"]["chat_template"] == "tokenizer"
    # the template knob still changes what is trained: its own training examples, the reference's held-out
    own = trial_data(compose([*base, f"data.chat_template={other}"]), tok)
    assert "Chat log" in tok.decode(own.train[0].input_ids) and "Chat log" not in tok.decode(
        own.eval[0].input_ids
    )


def test_a_trial_too_short_for_the_reference_is_marked_not_comparable(tmp_path, tok, monkeypatch):
    """A trial whose context.max_tokens is below the reference's longest held-out example cannot score it: its
    held-out records are cut to its own context (another fingerprint) and its eval set says comparable:
    false with why, which report and pick read."""
    many = [
        {"messages": [*CHAT[:-1], {"role": "assistant", "content": f"It is {i} " * 30}]} for i in range(40)
    ]
    path = _file(tmp_path, many)
    base = ["data=file", f"data.path={path}", "context.max_tokens=512"]
    _in_sweep(tmp_path, monkeypatch, reference_of(compose(base)))
    ref = trial_data(compose(base), tok)
    longest = max(len(e.input_ids) for e in ref.eval)
    assert 64 < longest <= 512
    short = trial_data(compose([*base, "context.max_tokens=64"]), tok)
    es, ref_es = eval_set(short.eval, 2, short.stats), eval_set(ref.eval, 2, ref.stats)
    assert es["fingerprint"] != ref_es["fingerprint"]
    assert es.get("comparable") is False and ref_es["comparable"] is True
    assert es["not_comparable"] == (
        f"context.max_tokens=64 is shorter than the reference's held-out examples (up to {longest} tokens at "
        "the sweep baseline's context.max_tokens=512)"
    )
    assert max(len(e.input_ids) for e in short.eval) <= 64
    # a context that holds every reference example scores it, however much shorter than the baseline's
    fits = trial_data(compose([*base, f"context.max_tokens={longest}"]), tok)
    assert eval_set(fits.eval, 2, fits.stats)["fingerprint"] == ref_es["fingerprint"]


def test_the_reference_is_the_baselines_values(tmp_path, monkeypatch):
    """reference_of: the config's values of the reference keys, the baseline's overrides winning; a trial
    reads the sweep's from sweep.json, nothing outside a sweep folder."""
    cfg = compose(["data=grant_chat", "context.max_tokens=384"])
    assert reference_of(cfg) == {
        "data.chat_template": None,
        "data.enable_thinking": False,
        "context.max_tokens": 384,
    }
    assert reference_of(cfg, ["context.max_tokens=256", "data.enable_thinking=true", "quant=nf4"]) == {
        "data.chat_template": None,
        "data.enable_thinking": True,
        "context.max_tokens": 256,
    }
    monkeypatch.delenv(SWEEP_DIR_ENV, raising=False)
    assert sweep_reference() is None
    _in_sweep(tmp_path, monkeypatch, reference_of(cfg))
    assert sweep_reference() == reference_of(cfg)
