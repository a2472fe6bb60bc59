"""A copied or moved sweep folder re-runs (docs/SWEEPS.md): ``sweep.json`` names the folder's own default
storage by where it lies now, so the copy is the same sweep (before: "belongs to sweep 'demo' ... this is
sweep 'demo'", the absolute storage path of the original)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import optuna

SRC = str(Path(__file__).parents[2] / "src")
TESTS = str(Path(__file__).parents[1])


def _sweep(root: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={root}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.preload=[fakes]",
        "hydra.sweeper.isolation=inprocess",
        "adapter.r=4,8",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=mv",
        *extra,
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{SRC}:{TESTS}", "VRAMSWEEP_FAKE": "{}", "HOME": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_copied_sweep_folder_re_runs_and_a_moved_one_resumes(tmp_path):
    first, elsewhere = tmp_path / "a", tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _sweep(first, tmp_path, "hydra.sweeper.n_trials=1")
    assert done.returncode == 0, done.stderr[-2000:]
    moved = tmp_path / "b"
    shutil.copytree(first, moved)
    shutil.rmtree(first)  # moved: the original is gone
    again = _sweep(moved, elsewhere)  # from another folder, the second point still to run
    assert again.returncode == 0, again.stderr[-2000:]
    study = optuna.load_study(study_name="mv", storage=f"sqlite:///{moved / 'sweeps' / 'mv' / 'study.db'}")
    assert len([t for t in study.trials if t.state.is_finished()]) == 2
    assert not first.exists()
    recorded = json.loads((moved / "sweeps" / "mv" / "sweep.json").read_text())
    assert str(first) not in json.dumps(recorded)

    copy = tmp_path / "c"  # a copy of the finished sweep re-runs too (it has nothing left to run)
    shutil.copytree(moved, copy)
    done_again = _sweep(copy, elsewhere)
    assert done_again.returncode == 0, done_again.stderr[-2000:]
    assert (moved / "sweeps" / "mv" / "study.db").is_file()
