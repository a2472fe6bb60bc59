"""Sweeps on a real single-node SLURM cluster through ``hydra/launcher=submitit_slurm``.

The cluster (munge, slurmctld, slurmd on localhost; slurmdbd on a local MariaDB for accounting) is
started by ``scripts/slurm_local.sh start`` - as root, no systemd, ~3 s once installed (``.ci/run``
installs the Debian packages). Skipped, with the reason, where SLURM is not installed or cannot start;
fails instead when CI says the cluster is up (``VRAMSWEEP_REQUIRE_SLURM=1``), as the PostgreSQL test does.
Each job runs the tests' fake trial (seconds). Every wait is bounded and says what it waited for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from conftest import slurm_cluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm(slurm):
    """conftest's cluster, started again after this module's tests: left as found, up, with accounting."""
    yield
    slurm_cluster("start")


def _sweep(tmp_path: Path, name: str, points: str, fault: str | None, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        points,
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.timeout_min=5",
        "hydra.sweeper.progress=false",
        f"hydra.sweeper.study_name={name}",
        *extra,
    ]


def _env(tmp_path: Path, fault: str | None) -> dict[str, str]:
    fake = {"faults": {"adapter.r=8": fault} if fault else {}, "marker_dir": str(tmp_path / "m")}
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, VRAMSWEEP_FAKE=json.dumps(fake), PYTHONPATH=path)


def _wait_for(what: str, check, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the sweep exited ({proc.returncode}) while waiting for {what}:\n{out[-3000:]}")
        time.sleep(0.3)
    squeue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
    pytest.fail(f"no {what} within {timeout:.0f} s; squeue:\n{squeue}")


def _study(tmp_path: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/sweeps/{name}/study.db")


def _results(tmp_path: Path, name: str) -> dict[int, dict]:
    trials = tmp_path / "sweeps" / name / "trials"
    return {int(p.stem): json.loads(p.read_text()) for p in trials.glob("*.json")}


def _job_ids(tmp_path: Path, name: str) -> list[str]:
    sub = tmp_path / "sweeps" / name / ".submitit"
    return sorted(d.name for d in sub.iterdir() if d.is_dir() and d.name.isdigit())


def _sacct(ids: list[str]) -> dict[str, str]:
    p = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(ids)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    return dict(line.split("|")[:2] for line in p.stdout.split() if "|" in line)


def _sacct_times(ids: list[str]) -> dict[str, tuple[str, str]]:
    """JobID -> (Start, End) as ISO text (comparable as strings; ``None``/``Unknown`` for a job that never
    started)."""
    p = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,Start,End", "-j", ",".join(ids)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    return {f[0]: (f[1], f[2]) for line in p.stdout.split() if len(f := line.split("|")) == 3}


def _cancel_the_hung_job(tmp_path: Path, proc: subprocess.Popen) -> str:
    flag = _wait_for("job of the hung trial", lambda: next((tmp_path / "m").glob("once-*"), None), 180, proc)
    job_id = flag.read_text().split()[1]
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    return job_id


def _check_exact(tmp_path: Path, name: str, points: list[int], lost: bool = True) -> list:
    """Every point ``ok`` exactly once, with its result JSON; the only other trials are failed ones (lost
    jobs, unless ``lost=False``: trials an interrupted sweeper left running, closed by the re-run)."""
    trials = _study(tmp_path, name).trials
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["adapter.r"] for t in done) == points, trials
    res = _results(tmp_path, name)
    for t in done:
        assert res[t.number]["status"] == "ok" and res[t.number]["metrics"]["eval_loss"] == t.values[0]
    others = [t for t in trials if t.state != TrialState.COMPLETE]
    assert all(
        t.state == TrialState.FAIL and (t.system_attrs.get("vramsweep:job_lost") or not lost) for t in others
    ), others
    return others


def test_a_sweep_on_slurm_survives_scancel_and_a_controller_down(slurm, tmp_path):
    # 1. three trials as real sbatch jobs; one is scancelled mid-trial and retried in the run
    name = "scancel"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _sweep(tmp_path, name, "adapter.r=4,8,12", "hang_once", "hydra.sweeper.n_jobs=3"),
        env=_env(tmp_path, "hang_once"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    cancelled = _cancel_the_hung_job(tmp_path, proc)
    out, _ = proc.communicate(timeout=300)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    lost = _check_exact(tmp_path, name, [4, 8, 12])
    assert len(lost) == 1 and lost[0].params["adapter.r"] == 8
    reason = lost[0].user_attrs["reason"]
    assert f"job {cancelled} (slurm) ended CANCELLED" in reason and "retried (1/3 in this run)" in reason, (
        reason
    )
    ids = _job_ids(tmp_path, name)
    assert len(ids) == 4 and cancelled in ids, ids  # 3 points + the retry, each its own sbatch job
    states = _wait_for("accounting records of the jobs", lambda: (s := _sacct(ids)) and len(s) == 4 and s, 60)
    assert states[cancelled].startswith("CANCELLED") and sorted(states.values()).count("COMPLETED") == 3, (
        states
    )
    print(f"\nSLURM sweep of 3 trials, one scancelled and retried: {wall:.1f} s")

    # 2. controller down: sbatch fails -> a clear error, exit 1, nothing lost; back up -> the same command
    #    runs every point once
    name = "down"
    cmd = _sweep(
        tmp_path, name, "adapter.r=4,8", None, "hydra.sweeper.n_jobs=2", "hydra.sweeper.retry_stale=1"
    )
    assert slurm_cluster("ctld-stop").returncode == 0
    try:
        t0 = time.monotonic()
        p = subprocess.run(
            cmd, env=_env(tmp_path, None), capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        down_s = time.monotonic() - t0
    finally:
        up = slurm_cluster("ctld-start")
    assert up.returncode == 0, up.stderr
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert (
        "ABORTED: the launcher could not submit jobs" in out and "Unable to contact slurm controller" in out
    ), out
    assert "re-run the same command" in p.stdout.strip().splitlines()[-1], out
    assert not [t for t in _study(tmp_path, name).trials if t.state == TrialState.COMPLETE]
    t0 = time.monotonic()
    p = subprocess.run(
        cmd, env=_env(tmp_path, None), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stdout + p.stderr
    _check_exact(tmp_path, name, [4, 8])
    print(f"controller down: error after {down_s:.1f} s; re-run when up: {time.monotonic() - t0:.1f} s")


def _node_cpus() -> int:
    p = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=30)
    return int(p.stdout.split()[0])


def _queued(ids: list[str]) -> list[str]:
    p = subprocess.run(
        ["squeue", "-h", "-o", "%i", "-t", "PD,R,CG,CF,S", "-j", ",".join(ids)],
        capture_output=True,
        text=True,
    )
    return [j for j in p.stdout.split() if j in ids]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_sweep_with_the_controller_down_exits_non_zero_and_the_rerun_runs_each_point_once(
    slurm, tmp_path, sig
):
    """Three points as sbatch jobs that each take the whole node (one RUNNING, two PENDING); slurmctld is
    stopped mid-sweep and the sweeper interrupted (Ctrl-C or SIGTERM): it cannot cancel the jobs, says so,
    prints ABORTED and exits non-zero. With the controller back, the same command stops every job the
    study recorded (the PENDING ones too) before it retries the points, takes no placeholder of its own
    for a result, and runs each point once: no old job left queued, three COMPLETED retries."""
    name = "interrupted"
    cmd = _sweep(
        tmp_path,
        name,
        "adapter.r=4,8,12",
        None,
        "hydra.sweeper.n_jobs=3",
        "hydra.sweeper.retry_stale=1",
        f"hydra.launcher.cpus_per_task={_node_cpus()}",
    )
    slow = dict(
        _env(tmp_path, None), VRAMSWEEP_FAKE=json.dumps({"sleep_s": 900, "marker_dir": str(tmp_path / "m")})
    )
    proc = subprocess.Popen(
        cmd, env=slow, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    _wait_for("one job running", lambda: next((tmp_path / "m").glob("start-*"), None), 180, proc)
    _wait_for("three jobs submitted", lambda: len(_job_ids(tmp_path, name)) == 3, 60, proc)
    old = _job_ids(tmp_path, name)
    assert len(_queued(old)) == 3, old  # one RUNNING, two PENDING
    assert slurm_cluster("ctld-stop").returncode == 0
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=300)
    finally:
        up = slurm_cluster("ctld-start")
    assert up.returncode == 0, up.stderr
    assert proc.returncode != 0, out
    assert "ABORTED" in out and "could not cancel launcher job(s)" in out, out
    assert "Traceback" not in out, out

    t0 = time.monotonic()
    p = subprocess.run(
        cmd, env=_env(tmp_path, None), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "Traceback" not in out, out
    assert len(_check_exact(tmp_path, name, [4, 8, 12], lost=False)) == 3  # the interrupted trials
    _wait_for("the interrupted jobs gone from the queue", lambda: not _queued(old), 60)
    ids = _job_ids(tmp_path, name)
    assert len(ids) == 6, ids  # the three interrupted jobs and one retry per point
    states = _wait_for("accounting records of the jobs", lambda: (s := _sacct(ids)) and len(s) == 6 and s, 60)
    assert all(states[j].startswith("CANCELLED") for j in old), states
    assert sorted(states[j] for j in ids if j not in old) == ["COMPLETED"] * 3, states
    times = _sacct_times(ids)  # every interrupted job had ended before the first retry started
    assert max(times[j][1] for j in old) <= min(times[j][0] for j in ids if j not in old), times
    starts = sorted(p.name for p in (tmp_path / "m").glob("start-*"))
    assert len(starts) == 4, starts  # the one interrupted while running, then each point once
    print(f"\ninterrupted ({sig.name}) with the controller down; re-run: {time.monotonic() - t0:.1f} s")


def test_without_accounting_a_cancelled_job_is_lost_within_bounded_time(slurm, tmp_path):
    """``AccountingStorageType=none``: ``sacct`` knows nothing, submitit used to wait for minutes with
    the trial RUNNING; the runner asks ``squeue`` and retries the point within seconds."""
    p = slurm_cluster("start", "--no-accounting")
    assert p.returncode == 0, p.stderr
    try:
        name = "noacct"
        proc = subprocess.Popen(
            _sweep(tmp_path, name, "adapter.r=4,8", "hang_once", "hydra.sweeper.n_jobs=2"),
            env=_env(tmp_path, "hang_once"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        cancelled = _cancel_the_hung_job(tmp_path, proc)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        lost = _check_exact(tmp_path, name, [4, 8])
        assert len(lost) == 1 and f"job {cancelled} (slurm) ended CANCELLED" in lost[0].user_attrs["reason"]
        print(f"\nno accounting: scancel -> retried and finished in {time.monotonic() - t0:.1f} s")
    finally:
        assert slurm_cluster("start").returncode == 0  # accounting back on
