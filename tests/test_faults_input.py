"""Bad input that still got a traceback or was accepted (issue 40 items 5, 7, 8): each case exits 2 with one
line ``vramsweep <verb>: error: ...`` naming the key, and writes nothing (the harness of
``tests/test_bad_inputs.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_bad_inputs import FAKE
from test_bad_inputs import test_bad_input as check_bad_input
from vramsweep.cli import main

LONG = "n" * 256  # one byte over a file name's limit
SWEEP = ["-m", "adapter.r=8,16", *FAKE]
UNNAMED = ["-m", "adapter.r=8,16", *FAKE[:2]]  # without study_name, so sweep.name names the sweep

# (id, verb, argv with {placeholders}, env, substring of the one line)
CASES: list[tuple[str, str, list[str], dict[str, str], str]] = [
    # item 5: a path component over 255 bytes (was OSError: File name too long)
    ("long-results-dir", "train", [f"results_dir={{root}}/{LONG}"], {}, "is 256 bytes long"),
    ("long-results-dir-cjk", "train", ["results_dir='{root}/" + "資" * 86 + "'"], {}, "is 258 bytes long"),
    ("long-cache", "train", [], {"VRAMSWEEP_CACHE": f"/tmp/{LONG}"}, "VRAMSWEEP_CACHE=/tmp/nnn"),
    ("long-report", "report", [f"{{root}}/{LONG}"], {}, "is 256 bytes long"),
    ("long-config-dir", "train", [f"--config-dir={{root}}/{LONG}"], {}, "--config-dir: the name"),
    ("long-sweep-name", "train", [*UNNAMED, f"sweep.name={LONG}"], {}, "sweep.name is 256 bytes long"),
    # item 7: sweep.name=.. wrote into results_dir itself
    (
        "sweep-name-dotdot",
        "train",
        [*UNNAMED, "sweep.name=.."],
        {},
        "sweep.name='..' must be a plain file name",
    ),
    ("sweep-name-dot", "train", [*UNNAMED, "sweep.name=."], {}, "sweep.name='.' must be a plain file name"),
    # item 5: search-space syntax and sweeper settings that raised
    (
        "range-step-0",
        "train",
        ["-m", "adapter.r=range(1,10,0)", *FAKE],
        {},
        "adapter.r=range(1,10,0): range step 0",
    ),
    (
        "nested-choice",
        "train",
        ["-m", "adapter.r=choice(choice(8,16),32)", *FAKE],
        {},
        "a choice cannot hold another sweep",
    ),
    (
        "pruner-negative",
        "train",
        [*SWEEP, "hydra.sweeper.sampler=tpe", "hydra.sweeper.pruner={name:median,n_startup_trials:-1}"],
        {},
        "hydra.sweeper.pruner={'name': 'median', 'n_startup_trials': -1}: Number of startup trials",
    ),
    # item 8: values accepted or the wrong key named
    (
        "cuda-devices-negative",
        "train",
        [*SWEEP, "hydra.sweeper.cuda_devices=[-1]"],
        {},
        "has '-1', not a device",
    ),
    (
        "preload-missing",
        "train",
        [*SWEEP, "hydra.sweeper.preload=[no_such_module_xyz]"],
        {},
        "hydra.sweeper.preload has 'no_such_module_xyz', a module that cannot be imported",
    ),
    (
        "custom-search-space-unresolved",
        "train",
        [*SWEEP, "hydra.sweeper.custom_search_space=no_such_mod.configure"],
        {},
        "hydra.sweeper.custom_search_space='no_such_mod.configure' does not resolve",
    ),
    (
        "custom-search-space-in-trial-mode",
        "train",
        [*SWEEP, "hydra.sweeper.custom_search_space=os.path.join"],
        {},
        "is for function mode",
    ),
]


@pytest.mark.parametrize(("case_id", "verb", "argv", "env", "needle"), CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line_with_nothing_written(
    tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle
):
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle)


def test_a_symlink_loop_under_results_dir_is_refused_before_the_trial(tmp_path, capsys, monkeypatch):
    """The pre-flight probed the first existing folder above the loop and passed; the result write failed
    after the training."""
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    before = sorted(Path(tmp_path).rglob("*"))
    assert main(["train", f"results_dir={tmp_path / 'a' / 'res'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("vramsweep train: error: results_dir=")
        and "symlink loop" in err[0]
    )
    assert sorted(Path(tmp_path).rglob("*")) == before


def test_sweep_node_as_a_list_is_one_line(tmp_path, capsys, monkeypatch):
    """A user's sweep file whose ``sweep:`` is a list: ``AttributeError: 'list' object has no attribute 'get'``."""
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "uc" / "sweep"
    conf.mkdir(parents=True)
    (conf / "lst.yaml").write_text("# @package _global_\nsweep:\n  - a\n  - b\n")
    before = sorted(Path(tmp_path).rglob("*"))
    code = main(
        [
            "train",
            "-m",
            f"--config-dir={tmp_path / 'uc'}",
            "sweep=lst",
            *FAKE[:2],
            f"results_dir={tmp_path}/r",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "sweep: is a list, not a mapping" in err[0], err
    assert sorted(Path(tmp_path).rglob("*")) == before
