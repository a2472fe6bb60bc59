"""The report reads results through ``TrialResult.from_json`` (report/load.py): ``Status`` members, old files
with missing keys as they are, and files that fail the schema still read (tolerantly, with a note)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import atomic_write_json, new_result
from vramsweep.record.status import Status
from vramsweep.report import build_report, load_sweep
from vramsweep.report.load import RUNNING, TrialRecord, as_status

pytestmark = pytest.mark.torchfree


def _ok(n: int, peak: float, tps: float) -> dict:
    r = new_result(status=Status.OK, sweep="s", trial=n, overrides=[f"adapter.r={8 * (n + 1)}"])
    r["metrics"][M.PEAK_MEMORY_BYTES], r["metrics"][M.TOKENS_PER_S] = peak, tps
    r["metrics"][M.EVAL_LOSS] = 2.0 + n
    return r


def _sweep(folder: Path, files: dict[str, object]) -> Path:
    atomic_write_json(folder / "sweep.json", {"name": "s"})
    for name, data in files.items():
        path = folder / "trials" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data if isinstance(data, str) else json.dumps(data))
    return folder


def test_records_carry_status_members_that_still_compare_as_strings():
    rec = TrialRecord.from_result(new_result(status="oom", reason="OutOfMemoryError: x", trial=4))
    assert rec.status is Status.OOM and rec.problem is None and rec.number == 4
    assert rec.status == "oom" and f"{rec.status}" == "oom" and json.dumps(rec.status) == '"oom"'
    assert Counter([rec.status, "oom"]) == {"oom": 2}  # a member and its string are one key
    ok = TrialRecord.from_result(_ok(1, 5.0, 10.0))
    assert ok.status is Status.OK and ok.ok and ok.peak_bytes == 5.0 and ok.tokens_per_s == 10.0
    assert as_status(None) is Status.ERROR and as_status("pruned") is Status.PRUNED
    assert as_status(RUNNING) == "running" and not isinstance(as_status(RUNNING), Status)


def test_an_old_file_with_missing_keys_loads_without_a_note(tmp_path):
    old = {"status": "oom", "reason": "OutOfMemoryError: x", "metrics": {M.PEAK_MEMORY_BYTES: 5}}
    sweep = load_sweep(str(_sweep(tmp_path, {"0000.json": _ok(0, 4.0, 9.0), "0001.json": old})))
    t = sweep.trials[1]
    assert (t.number, t.status, t.reason, t.peak_bytes) == (1, Status.OOM, "OutOfMemoryError: x", 5.0)
    assert t.problem is None and t.overrides == [] and t.estimate is None and t.meta == {}
    no_reason = TrialRecord.from_result({"status": "error"}, number=7)
    assert (no_reason.number, no_reason.reason) == (7, "no reason recorded")
    assert sweep.notes == []


def test_a_file_that_fails_the_schema_still_loads_with_the_problem_noted(tmp_path):
    bad_metric = _ok(1, 3.0, 8.0) | {"overrides": "adapter.r=16"}  # not a list
    bad_metric["metrics"][M.TOKENS_PER_S] = "fast"
    files = {
        "0000.json": _ok(0, 4.0, 9.0),
        "0001.json": bad_metric,
        "0002.json": _ok(2, 2.0, 7.0) | {"status": "done"},  # a status outside the contract
        "0003.json": _ok(3, 1.0, 6.0) | {"schema": 99},  # written by a newer vramsweep
    }
    sweep = load_sweep(str(_sweep(tmp_path, files)))
    t0, t1, t2, t3 = sweep.trials
    assert t0.problem is None and t0.status is Status.OK
    assert "result.overrides='adapter.r=16'" in t1.problem
    assert t1.status is Status.OK and t1.peak_bytes == 3.0 and t1.tokens_per_s is None  # what could be read
    assert t2.status == "done" and not isinstance(t2.status, Status) and t2.reason == "no reason recorded"
    assert "result.schema=99" in t3.problem and t3.status is Status.OK and t3.peak_bytes == 1.0
    notes = [n for n in sweep.notes if "does not follow the result schema" in n]
    assert [n.split(":")[0] for n in notes] == ["trial 0001", "trial 0002", "trial 0003"]
    assert "0001.json" in notes[0] and "read what could be read" in notes[0]
    report = build_report(sweep, importances=False)  # the report builds over them all
    assert report.tables["best"].rows
