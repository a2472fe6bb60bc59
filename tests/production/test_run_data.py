"""Data fingerprints of a production run (docs/RUNS.md "Changed data"): every checkpoint records the sha256 of
the data files; a resume on changed data exits 2 naming the file and both hashes, nothing written; the opt-in
``train.resume_on_changed_data=true`` continues and records the change; a hash pinned beside the path is
checked; the resume's config check reads the checkpoint's own config (deleting ``config.yaml`` skips nothing).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from _run_folders import folder_hash
from conftest import FAST
from vramsweep.cli import main
from vramsweep.data.chatset import generate_chats
from vramsweep.production.checkpoint import latest_checkpoint

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _write(path: Path, chats: list[dict]) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _args(run: Path, data: Path, *extra: str) -> list[str]:
    return [
        "train",
        *(o for o in FAST if not o.startswith("data.num_")),  # the records are the file's
        "data=jsonl",
        f"data.path={data}",
        f"results_dir={run.parent}",
        f"train.output_dir={run}",
        "train.save_every=2",
        *extra,
    ]


@pytest.fixture
def stopped(tmp_path, monkeypatch) -> tuple[Path, Path, str]:
    """A run on a JSONL file stopped after step 2 (its checkpoint), then the file edited in place."""
    data = tmp_path / "chats.jsonl"
    old = _write(data, generate_chats(12, 7))
    run = tmp_path / "run"
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@3")
    assert main(_args(run, data)) == 1
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    ckpt = latest_checkpoint(run)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["data"] == {"data.path": {"path": str(data.resolve()), "sha256": old}}
    result = json.loads((run / "result.json").read_text())
    assert result["meta"]["data_sources"]["data.path"]["sha256"] == old
    return run, data, old


def test_resume_on_changed_data_exits_2_naming_the_file_and_both_hashes(stopped, capsys):
    """Before: steps 1-2 on the old records and 3-4 on the new, status ok, one adapter."""
    run, data, old = stopped
    new = _write(data, generate_chats(12, 8))
    before = folder_hash(run)
    capsys.readouterr()
    assert main(_args(run, data, "train.resume=auto")) == 2
    err = [
        ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("data: ")
    ]  # summary
    assert len(err) == 1 and err[0].startswith("vramsweep train: error:"), err
    assert f"data.path={data.resolve()}" in err[0] and old[:16] in err[0] and new[:16] in err[0]
    assert "train.resume_on_changed_data=true" in err[0]
    assert folder_hash(run) == before

    # the explicit opt-in continues on the new data and says so in the result
    assert main(_args(run, data, "train.resume=auto", "train.resume_on_changed_data=true")) == 0
    res = json.loads((run / "result.json").read_text())
    assert res["meta"]["resumed_from"]["next_step"] == 2
    [change] = res["meta"]["data_changed_on_resume"]
    assert change == {"key": "data.path", "path": str(data.resolve()), "was": old, "now": new, "at_step": 2}
    assert res["meta"]["data_sources"]["data.path"]["sha256"] == new
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert state["data"]["data.path"]["sha256"] == new and state["data_changes"] == [change]


def test_resume_on_the_same_data_continues(stopped):
    run, data, _ = stopped
    assert main(_args(run, data, "train.resume=auto")) == 0
    res = json.loads((run / "result.json").read_text())
    assert res["status"] == "ok" and "data_changed_on_resume" not in res["meta"]


def test_the_config_check_does_not_depend_on_config_yaml(stopped, capsys):
    """Before: deleting config.yaml skipped the resume's config check."""
    run, data, _ = stopped
    (run / "config.yaml").unlink()
    before = folder_hash(run)
    capsys.readouterr()
    assert main(_args(run, data, "train.resume=auto", "train.lr=0.01")) == 2
    err = capsys.readouterr().err.strip()
    assert "train.lr" in err and "state.json" in err, err
    assert folder_hash(run) == before


def test_a_pinned_hash_is_checked_before_anything_is_written(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    sha = _write(data, generate_chats(12, 7))
    run = tmp_path / "run"
    _write(data, generate_chats(12, 9))  # the file changed since the sweep that pinned it
    assert main(_args(run, data, f"data.path_sha256={sha}")) == 2
    err = [
        ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("data: ")
    ]  # summary
    assert len(err) == 1 and "data.path_sha256" in err[0] and sha[:16] in err[0], err
    assert not run.exists()


def _as_before_fingerprints(run: Path, *keys: str) -> None:
    """Every checkpoint's ``state.json`` without ``keys``: as written before vramsweep recorded them."""
    for state_file in run.glob("checkpoints/*/state.json"):
        state = json.loads(state_file.read_text())
        for key in keys:
            state.pop(key, None)
        state_file.write_text(json.dumps(state))


def test_a_checkpoint_from_before_data_hashes_resumes_saying_so_and_records_them_now(stopped, capsys):
    """A checkpoint without data hashes has nothing to compare: the resume continues on the file, says in one
    line that it cannot verify it, and records the file's hash (the result and the later checkpoints), so a
    later resume checks it."""
    run, data, old = stopped
    _as_before_fingerprints(run, "data")
    capsys.readouterr()
    assert main(_args(run, data, "train.resume=auto")) == 0
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "before vramsweep recorded data hashes" in ln]
    assert len(said) == 1, err
    assert (
        f"data.path={data.resolve()} (sha256 {old[:16]})" in said[0] and "recording its hash now" in said[0]
    )
    res = json.loads((run / "result.json").read_text())
    assert res["status"] == "ok"
    [entry] = res["meta"]["data_changed_on_resume"]
    assert entry == {
        "key": "data.path",
        "path": str(data.resolve()),
        "was": None,
        "now": old,
        "unverified": True,
        "at_step": 2,
    }
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert state["data"]["data.path"]["sha256"] == old and state["data_changes"] == [entry]


def test_a_checkpoint_from_before_it_kept_the_config_needs_config_yaml(stopped, capsys):
    """Without the config in the checkpoint and without ``config.yaml`` nothing says which config the run
    had: the resume is refused (exit 2, nothing written) instead of skipping the check."""
    run, data, _ = stopped
    _as_before_fingerprints(run, "config")
    (run / "config.yaml").unlink()
    before = folder_hash(run)
    capsys.readouterr()
    assert main(_args(run, data, "train.resume=auto")) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot check the config" in err and "restore config.yaml" in err, err
    assert folder_hash(run) == before


def test_config_yaml_holds_the_data_files_absolute_and_is_read_from_another_folder(tmp_path, monkeypatch):
    """``config.yaml`` holds ``data.path`` absolute and resolved, as typed in a comment (as ``run.json`` holds
    the base folder): the held-out records ``export --merge`` measures on are found from any folder, and a
    resume that types the same relative path is the same config."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from vramsweep.production.use import held_out_ids

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    data = project / "chats.jsonl"
    _write(data, generate_chats(12, 7))
    run = tmp_path / "run"
    monkeypatch.chdir(project)
    monkeypatch.setenv("VRAMSWEEP_FAULT", "error@1")
    assert main(_args(run, Path("chats.jsonl"))) == 1  # stopped before its first checkpoint
    monkeypatch.delenv("VRAMSWEEP_FAULT")
    text = (run / "config.yaml").read_text()
    assert f"# data.path: {data.resolve()} (absolute, resolved; typed 'chats.jsonl')" in text, text
    assert OmegaConf.load(run / "config.yaml").data.path == str(data.resolve())
    assert main(_args(run, Path("chats.jsonl"), "train.resume=auto")) == 0  # not a changed config
    monkeypatch.chdir(elsewhere)
    assert held_out_ids(run, AutoTokenizer.from_pretrained(str(run / "tokenizer")))
