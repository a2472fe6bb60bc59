"""``train.threads``: ``auto`` (the default) takes the cores this process may use, its share among the
sweep's concurrent trials, less the cores other processes keep busy; a trial records the count it used.
Not torch-free: ``vramsweep.measure`` imports torch, so the Python 3.12 job skips this file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FAST
from vramsweep.config import ConfigError, compose
from vramsweep.measure import threads as th
from vramsweep.record.threads_env import CONCURRENT_ENV


@settings(max_examples=300, deadline=None)
@given(
    usable=st.integers(1, 256),
    concurrent=st.integers(1, 64),
    busy=st.one_of(st.none(), st.floats(0, 300, allow_nan=False)),
    torch_default=st.integers(1, 256),
)
def test_auto_is_at_least_one_and_never_more_than_its_share_or_torchs_default(
    usable, concurrent, busy, torch_default
):
    n, why = th.decide(usable, concurrent, busy, torch_default)
    assert 1 <= n <= max(1, min(usable // concurrent, torch_default)) and why
    if busy is not None:  # more load on the cores never means more threads
        assert th.decide(usable, concurrent, busy + 1.0, torch_default)[0] <= n


@pytest.mark.parametrize(
    "usable, concurrent, busy, default, want",
    [
        (2, 1, 0.1, 2, 2),  # idle 2-core laptop: torch's default
        (2, 1, 1.9, 2, 1),  # one competing 2-thread matmul job: 1 (torch's default oversubscribes)
        (2, 1, 0.9, 2, 1),  # a 1-thread job on one core: the other core
        (2, 2, 0.0, 2, 1),  # two trials at once: one core each
        (16, 4, 0.0, 8, 4),  # a share of 16 cores, under torch's (physical-core) default
        (16, 1, 0.0, 8, 8),  # never more than torch's default (hyper-threads)
        (16, 1, 6.2, 8, 8),  # 10 of 16 cores free: still torch's 8
        (16, 1, 12.0, 8, 4),
        (4, 1, None, 4, 4),  # load unmeasurable: the share
    ],
)
def test_auto_decisions(usable, concurrent, busy, default, want):
    assert th.decide(usable, concurrent, busy, default)[0] == want


def test_fixed_settings_are_kept_and_zero_is_torchs_default():
    assert th.choose("3", torch_default=2).threads == 3
    assert th.choose(1, torch_default=2).threads == 1
    zero = th.choose("0", torch_default=2)
    assert zero.threads == 2 and zero.setting == "0"


def test_auto_reads_the_affinity_and_the_sweeps_concurrency(monkeypatch):
    monkeypatch.setattr(th.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(th, "busy_other_cores", lambda s=0: 0.0)
    assert th.choose("auto", torch_default=8).threads == 1  # one core in the mask
    monkeypatch.setattr(th.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv(CONCURRENT_ENV, "4")
    got = th.choose("auto", torch_default=8)
    assert got.threads == 2 and got.concurrent_trials == 4 and got.usable_cores == 8


def test_a_competing_process_counts_as_busy():
    """A process spinning on a core of this one's mask shows up in the sample (other work on a shared
    machine only adds to it)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = th.busy_other_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy >= 0.5, busy


@pytest.mark.parametrize("bad", ["abc", "-1", "2000", "1.5"])
def test_a_bad_thread_setting_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError) as info:
        compose([f"train.threads={bad}"])
    assert info.value.key == "train.threads" and "auto" in str(info.value)


def test_thread_settings_compose():
    assert compose([]).train.threads == "auto"
    assert int(compose(["train.threads=1"]).train.threads) == 1


def test_the_sweeper_tells_its_trials_how_many_run_at_once(tmp_path):
    from vramsweep.sweeper.trialproc import TrialSpec

    plan = SimpleNamespace(
        folder=tmp_path,
        n_workers=2,
        layout=None,
        cuda_devices=None,
        name="s",
        study_key="s",
        storage_url=None,
        goals=[],
        trial_fn=None,
        pruner_spec="none",
        pruning_active=False,
        budget_gib=0.0,
        preflight=False,
        isolation="process",
    )
    job = SimpleNamespace(
        number=0, trial=SimpleNamespace(_trial_id=0), slot=0, overrides=[], design={}, retry_of=None
    )
    assert TrialSpec.for_job(job, plan).env[CONCURRENT_ENV] == "2"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to tell 1 thread from torch's default")
@pytest.mark.parametrize("setting", ["1", "auto"])
def test_a_trial_records_the_threads_it_used(tmp_path, setting):
    import torch

    from vramsweep.trial import run_trial

    torch.set_num_threads(2)  # what torch starts with on 2 cores
    over = [*FAST, "train.steps=3", f"results_dir={tmp_path}", f"train.threads={setting}"]
    res = run_trial(compose(over), result_path=tmp_path / "r.json", overrides=over)
    assert res["status"] == "ok", res.get("reason")
    used = res["meta"]["threads"]
    assert used["setting"] == setting
    assert res["meta"]["timing_conditions"]["torch_threads"] == used["threads"]
    assert res["meta"]["cpu_bf16"]["native"] is True  # what train.dtype=auto read (the suite pins it)
    assert res["config"]["train"]["dtype"] == "bf16"
    if setting == "1":
        assert used["threads"] == 1
    else:
        assert used["usable_cores"] >= 1 and used["why"]
