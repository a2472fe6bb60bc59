"""``vramsweep report`` on result files and databases that would mislead it."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import atomic_write_json, new_result
from vramsweep.record.status import Status
from vramsweep.report import load_sweep

pytestmark = pytest.mark.torchfree


def _ok(n: int) -> dict:
    r = new_result(status=Status.OK, sweep="s", trial=n, overrides=[f"adapter.r={8 * (n + 1)}"])
    r["metrics"][M.PEAK_MEMORY_BYTES], r["metrics"][M.TOKENS_PER_S], r["metrics"][M.EVAL_LOSS] = (
        1e6,
        10.0,
        2.0,
    )
    return r


def _sweep(folder: Path, files: dict[str, dict]) -> Path:
    atomic_write_json(folder / "sweep.json", {"name": "s"})
    (folder / "trials").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / "trials" / name).write_text(json.dumps(data))
    return folder


def test_the_file_name_wins_over_the_trial_field_and_the_disagreement_is_a_note(tmp_path):
    """``0004.json`` saying ``"trial": 7`` counted trial 7 twice and dropped the real trial 7."""
    files = {f"{n:04d}.json": _ok(n) for n in range(8)}
    files["0004.json"] = _ok(4) | {"trial": 7}
    data = load_sweep(str(_sweep(tmp_path / "s", files)))
    assert [t.number for t in data.trials] == list(range(8))
    assert [t.overrides for t in data.trials if t.number == 7] == [["adapter.r=64"]]  # the real trial 7
    assert any('0004.json says "trial": 7; counted as trial 0004' in n for n in data.notes), data.notes
    assert not any("duplicate" in n for n in data.notes), data.notes


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_report_of_a_live_sweep_changes_no_byte_of_its_database_files(tmp_path):
    """A live sweep (a writer holds the WAL open): ``report`` read it with ``mode=ro``, which still writes
    the ``-shm`` WAL index; the database, ``-wal`` and ``-shm`` must stay byte-identical, and the trial
    committed only to the WAL must be read."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = tmp_path / "s"
    folder.mkdir()
    url = f"sqlite:///{folder / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    writer = sqlite3.connect(folder / "study.db")  # the sweep: WAL on, its connection open
    try:
        assert writer.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        writer.execute("PRAGMA wal_autocheckpoint=0")
        study = optuna.load_study(study_name="s", storage=url)
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)  # committed to the -wal only
        assert (folder / "study.db-wal").stat().st_size > 0 and (folder / "study.db-shm").exists()
        before = _digest(folder)
        data = load_sweep(str(folder))
        assert _digest(folder) == before, "report wrote into the live sweep's database files"
        assert len(data.trials) == 3
    finally:
        writer.close()


def test_a_fifo_in_trials_is_skipped_with_a_note_not_read(tmp_path):
    """A FIFO named ``0002.json`` in ``trials/`` hung ``report`` forever (open() waits for a writer)."""
    import os
    import threading

    folder = _sweep(tmp_path / "s", {f"{n:04d}.json": _ok(n) for n in range(2)})
    fifo = folder / "trials" / "0002.json"
    os.mkfifo(fifo)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("data", load_sweep(str(folder))), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("report blocked on a FIFO in trials/")
    data = out["data"]
    assert [t.number for t in data.trials] == [0, 1]
    assert any("0002.json" in n and "not a regular file" in n for n in data.notes), data.notes
