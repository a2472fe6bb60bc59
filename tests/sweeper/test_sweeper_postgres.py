"""Many workers on one study in a real PostgreSQL server: exactly n_trials, no duplicates, no lock errors.

Starts its own throw-away cluster (initdb + pg_ctl, loopback port, temp dir; as the ``postgres`` user
when run as root), or uses ``VRAMSWEEP_PG_URL``. Skipped when neither is available (fails instead with
``VRAMSWEEP_REQUIRE_PG=1``). CI installs the server binaries in ``.ci/run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.postgres

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.preload=[fakes]",
]


def test_four_workers_five_trials_each_make_exactly_twenty(pg_url, tmp_path):
    import optuna
    from optuna.trial import TrialState

    name = f"pg-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, VRAMSWEEP_FAKE=json.dumps({"sleep_s": 0.2}))
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=range(1,4000)",
        "train.lr=tag(log,interval(1e-5,1e-2))",
        "hydra.sweeper.sampler=tpe",
        "hydra.sweeper.n_trials=20",
        f"hydra.sweeper.storage={pg_url}",
        f"hydra.sweeper.study_name={name}",
        "hydra.sweeper.dedup=false",
    ]
    # four independent sweeper processes started at once on a fresh database (the create-study race)
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        low = err.lower()
        assert "traceback" not in low and "lock" not in low and "deadlock" not in low, err
    from vramsweep.sweeper.settings import normalise_storage_url

    study = optuna.load_study(study_name=name, storage=normalise_storage_url(pg_url))
    trials = study.trials
    assert len(trials) == 20 and sorted(t.number for t in trials) == list(range(20))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({t.system_attrs["vramsweep:slot"] for t in trials}) == 20
    owners = {t.system_attrs["vramsweep:owner"]["pid"] for t in trials}
    assert len(owners) >= 2, "the four workers shared the work"
    files = sorted((tmp_path / "sweeps" / name / "trials").glob("*.json"))
    assert [int(f.stem) for f in files] == list(range(20))
    assert sum(out.count("/20 trial ") for out, _ in outs) == 20  # each trial reported once


def test_submitit_local_jobs_on_postgres_one_job_killed(pg_url, tmp_path):
    """``hydra/launcher=submitit_local`` alone puts the sweeper in launcher mode: every trial is a real
    submitit job (its own process, started by submitit), the study lives in PostgreSQL, and a job killed
    mid-trial (SIGKILL: no result, submitit raises for it) is lost infrastructure, not a result: its point
    is retried in the same run, the others' results and statuses intact, every point ``ok``
    exactly once, nothing left RUNNING."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import optuna
    from optuna.trial import TrialState

    from vramsweep.sweeper.settings import normalise_storage_url

    name = f"sub-{uuid.uuid4().hex[:8]}"
    fake = {"faults": {"adapter.r=8": "kill_once"}, "marker_dir": str(tmp_path / "m")}
    env = dict(os.environ, VRAMSWEEP_FAKE=json.dumps(fake))
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "adapter.r=4,8,12,16",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        "hydra.sweeper.n_jobs=4",
        f"hydra.sweeper.storage={pg_url}",
        f"hydra.sweeper.study_name={name}",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert "each trial in a Hydra launcher job" in p.stdout + p.stderr
    study = optuna.load_study(study_name=name, storage=normalise_storage_url(pg_url))
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]  # the killed trial + its retry
    lost = [t for t in trials if t.state == TrialState.FAIL]
    assert len(lost) == 1 and lost[0].params["adapter.r"] == 8, trials
    assert (
        "launcher job" in lost[0].user_attrs["reason"]
        and "retried (1/3 in this run)" in lost[0].user_attrs["reason"]
    )
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["adapter.r"] for t in done) == [4, 8, 12, 16]
    assert all(t.user_attrs["status"] == "ok" for t in done)
    sweep_dir = tmp_path / "sweeps" / name
    res = {int(f.stem): json.loads(f.read_text()) for f in (sweep_dir / "trials").glob("*.json")}
    assert sorted(res) == [0, 1, 2, 3, 4]
    for t in done:
        assert res[t.number]["status"] == "ok" and res[t.number]["metrics"]["eval_loss"] == t.values[0]
    # each trial ran as a submitit job (its own log folder), in this sweep's folder
    jobs = [d for d in (sweep_dir / ".submitit").iterdir() if d.is_dir() and d.name != "%j"]
    assert len(jobs) == 5, jobs
    assert not (tmp_path / "sweeps" / "multirun").exists()
    print(f"submitit_local sweep of 4 trials: {wall:.1f} s")
