"""One reader, each source file opened and parsed once (issue 50, wanted 7): across the pre-flight and a
trial in one process, a data file (sectioned documents or chat records, train and held-out) is opened once,
counted with an audit hook on Python's ``open`` event, and parsed once; the trial reads its examples from the
tokenisation cache. Before, a documents JSONL was opened 14 times and parsed 7 times on this path (measured
2026-12-06: two readers, ``data/documents.py`` and ``data/sources.py``, and each caller reading again), a chat
JSONL 9 times and parsed 3 times."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

import pytest

from conftest import FAST
from vramsweep.config import compose
from vramsweep.data import sources
from vramsweep.data.documents import write_jsonl
from vramsweep.data.prep import trial_data
from vramsweep.data.reference import SWEEP_DIR_ENV, reference_of
from vramsweep.data.sources import read_source, source_sha256
from vramsweep.data.synthetic import generate_documents
from vramsweep.data.tokenizer import load_tokenizer
from vramsweep.embedded import ASSET_DIR
from vramsweep.preflight import check_data, preflight
from vramsweep.trial import run_trial

CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]
_OPENS: Counter = Counter()
_HOOKED: list[bool] = []


def _hook(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], str | os.PathLike):
        _OPENS[os.path.abspath(os.fspath(args[0]))] += 1


def _count_opens() -> Counter:
    """The process-wide open counter (an audit hook cannot be removed: added once, cleared per test)."""
    if not _HOOKED:
        sys.addaudithook(_hook)
        _HOOKED.append(True)
    _OPENS.clear()
    return _OPENS


def _settled(*paths) -> None:
    """Date the files 10 s back: a file modified in the last 2 s is read each time (sources.RACY_NS), as a
    user's data file is not, so the test sees what a sweep over it sees."""
    old = time.time() - 10
    for p in paths:
        os.utime(p, (old, old))


def _docs(tmp_path):
    train, held = tmp_path / "docs.jsonl", tmp_path / "held.jsonl"
    write_jsonl(generate_documents(6, 1), train)
    write_jsonl(generate_documents(2, 99), held)
    return [train, held], ["data=jsonl", f"data.path={train}", f"data.eval_path={held}"]


def _chats(tmp_path):
    train = tmp_path / "chats.jsonl"
    train.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(20)))
    return [train], ["data=file", f"data.path={train}"]


@pytest.mark.usefixtures("embedded_model_dir")
@pytest.mark.parametrize("make", [_docs, _chats], ids=["documents", "messages"])
def test_each_source_file_is_opened_and_parsed_once(tmp_path, monkeypatch, make):
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    files, data = make(tmp_path)
    _settled(*files)
    parsed: Counter = Counter()
    read = getattr(sources, "_read", None)  # (absent before the one reader: the open count fails first)

    def counting_read(p):
        parsed[os.path.abspath(p)] += 1
        return read(p)

    monkeypatch.setattr(sources, "_read", counting_read, raising=False)
    over = [o for o in FAST if not o.startswith("data.num_")] + data
    over += ["train.steps=2", "train.measure_warmup_steps=1", f"results_dir={tmp_path / 'res'}"]
    opens = _count_opens()
    preflight(compose(over), overrides=over)
    result = run_trial(compose(over), result_path=tmp_path / "r.json", overrides=over)
    assert result["status"] == "ok" and result["meta"]["data"]["cache"] == "hit"
    want = {os.path.abspath(f): 1 for f in files}
    assert {p: n for p, n in opens.items() if p in want} == want
    assert dict(parsed) == want


def test_a_changed_file_is_read_again(tmp_path):
    """The kept records follow the file: rewritten (another size or time), it is read and hashed again."""
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "one"}) + "\n")
    _settled(p)
    first = read_source(p)
    assert read_source(p) is first and source_sha256(p) == first.sha256
    p.write_text(json.dumps({"text": "two!"}) + "\n")
    _settled(p)
    again = read_source(p)
    assert again.records[0].obj == {"text": "two!"} and again.sha256 != first.sha256
    # a file just written is read each time (its time cannot yet tell two writes apart)
    p.write_text(json.dumps({"text": "six!"}) + "\n")
    assert read_source(p).records[0].obj == {"text": "six!"}
    p.write_text(json.dumps({"text": "ten!"}) + "\n")
    assert read_source(p).records[0].obj == {"text": "ten!"}


@pytest.mark.usefixtures("embedded_model_dir")
def test_a_sweeps_preflight_builds_what_its_trials_read(tmp_path, monkeypatch):
    """A sweep's pre-flight builds each data setting under the sweep's eval reference, so a trial of the
    sweep (its sweep.json read through VRAMSWEEP_SWEEP_DIR) whose own context differs from the baseline's
    finds its examples in the cache and parses nothing."""
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    (train,), data = _chats(tmp_path)
    _settled(train)
    base = [*data, f"results_dir={tmp_path / 'res'}", "context.max_tokens=512"]
    ref = reference_of(compose(base))
    trial = compose([*base, "context.max_tokens=1024"])
    check_data(trial, ref)  # what check_sweep_data runs for this data setting
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps({"eval_reference": ref}))
    monkeypatch.setenv(SWEEP_DIR_ENV, str(folder))
    monkeypatch.setattr(sources, "_read", lambda p: pytest.fail(f"the trial parsed {p}"))
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    d = trial_data(trial, tok)
    assert d.stats["cache"] == "hit" and d.stats["eval_reference"]["from"] == "sweep baseline"
    assert d.stats["eval_reference"]["max_tokens"] == 512
