"""A single run's folder and its last line: names cut by bytes with a hash suffix, the
folder made before the training, and ``result: <path>`` only for a file that was written."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from vramsweep.config.paths import NAME_MAX
from vramsweep.production.run import RUN_NAME_BYTES, default_result_path, run_name


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.path=/data/" + "資料" * 40 + ".jsonl"],  # an 80-character CJK file name: 240 bytes
        ["data.instructions='" + "é" * 300 + "'"],
        ["adapter.r=8", "x=" + "a" * 500],
    ],
)
def test_run_names_fit_a_file_name_in_bytes(tmp_path, overrides):
    from vramsweep.config import compose

    name = run_name(overrides)
    assert len(name.encode()) <= RUN_NAME_BYTES
    path = default_result_path(compose([f"results_dir={tmp_path}"], rules="none"), overrides)
    assert len(path.parent.name.encode()) <= NAME_MAX
    path.parent.mkdir(parents=True)  # was OSError: File name too long
    path.write_text("{}")


def test_cut_names_keep_a_hash_of_the_whole_name():
    a, b = run_name(["x=" + "資" * 100 + "1"]), run_name(["x=" + "資" * 100 + "2"])
    assert a != b and a[:-9] == b[:-9] and a[-9] == "-" and len(a[-8:]) == 8
    assert run_name(["quant=nf4", "adapter.r=16"]) == "quant-nf4_adapter.r-16"  # short names unchanged
    assert "/" not in run_name(["data.path=/a/b"]) and "\x00" not in run_name(["x=a\x00b"])


def test_the_last_line_names_no_file_that_was_never_written(tmp_path, monkeypatch, capsys):
    """Disk full at the result write: ``result: <path>`` was printed for a file that does not exist."""
    from vramsweep.cli import main

    monkeypatch.setattr("vramsweep.trial._train", lambda cfg, result, reporter, logger: None)

    def full(path, result):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("vramsweep.trial.write_result", full)
    assert main(["train", f"results_dir={tmp_path}"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("result: not written (no space left on device: "), last
    assert not list(Path(tmp_path).rglob("result.json"))


def test_a_result_that_cannot_be_written_for_another_reason_is_an_error_not_a_traceback(
    tmp_path, monkeypatch
):
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    monkeypatch.setattr("vramsweep.trial._train", lambda cfg, result, reporter, logger: None)

    def denied(path, result):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("vramsweep.trial.write_result", denied)
    path = tmp_path / "r" / "result.json"
    res = run_trial(compose([f"results_dir={tmp_path}"], rules="all"), result_path=path)
    assert res["status"] == "error" and res["reason"] == f"cannot write the result {path}: Permission denied"
    assert res["meta"]["result_path"] is None
