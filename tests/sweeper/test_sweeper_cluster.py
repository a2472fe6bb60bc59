"""Launcher mode when jobs go wrong: lost jobs are infrastructure, not trial outcomes.

Real ``submitit_local`` jobs (each trial its own process, started by submitit) with the fake trial; the
SLURM-only paths (a job that left the queue, a failed ``sbatch``) with stand-ins for ``squeue`` and the
executor. The same on a real single-node SLURM cluster: ``tests/sweeper/test_sweeper_slurm.py`` (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from vramsweep.sweeper import launch

TESTS = Path(__file__).parents[1]


def _cmd(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "adapter.r=4,8",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.progress=false",
        f"hydra.sweeper.study_name={name}",
        *extra,
    ]


def _env(tmp_path: Path, fault: str) -> dict[str, str]:
    fake = {"faults": {"adapter.r=8": fault}, "marker_dir": str(tmp_path / "m")}
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, VRAMSWEEP_FAKE=json.dumps(fake), PYTHONPATH=path)


def _study(tmp_path: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/sweeps/{name}/study.db")


def _ok_points(tmp_path: Path, name: str) -> list[str]:
    res = [json.loads(p.read_text()) for p in (tmp_path / "sweeps" / name / "trials").glob("*.json")]
    return sorted(r["overrides"][-1] for r in res if r["status"] == "ok")


@pytest.mark.slow
def test_a_killed_job_is_lost_infrastructure_retried_in_the_run_and_on_rerun(tmp_path):
    """A job SIGKILLed mid-trial (what a preempted or cancelled job looks like from inside) used to end its
    trial ``error`` for good, and the same command then said "nothing to run". Now the point is retried
    within the run (``retry_stale``), and when no retry is left a re-run of the same command runs it; the
    last line says so. Every point ends ``ok`` exactly once."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    env = _env(tmp_path, "kill_once")
    # 1. in-run retry
    p = subprocess.run(_cmd(tmp_path, "inrun"), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    trials = _study(tmp_path, "inrun").trials
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 2 and len(trials) == 3, trials
    lost = next(t for t in trials if t.state == TrialState.FAIL)
    assert lost.system_attrs.get("vramsweep:job_lost") == "gone", lost.system_attrs
    assert "lost infrastructure, not a result: retried (1/3 in this run)" in lost.user_attrs["reason"]
    assert _ok_points(tmp_path, "inrun") == ["adapter.r=4", "adapter.r=8"]
    assert "2 ok" in p.stdout and "error" not in p.stdout.split("study total:")[1].splitlines()[0]
    # 2. no retry left in the run: the last line says how to retry; the same command finishes it
    env = _env(tmp_path / "b", "kill_once")
    cmd = _cmd(tmp_path, "rerun", "hydra.sweeper.retry_stale=0")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert "launcher job was lost" in last and "re-run the same command" in last, p.stdout
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "nothing to run" not in p.stdout, p.stdout + p.stderr
    assert "re-run" not in p.stdout.strip().splitlines()[-1]
    assert _ok_points(tmp_path, "rerun") == ["adapter.r=4", "adapter.r=8"]
    states = [t.state for t in _study(tmp_path, "rerun").trials]
    assert states.count(TrialState.COMPLETE) == 2 and TrialState.RUNNING not in states


@pytest.mark.slow
def test_ctrl_c_cancels_the_sweeps_launcher_jobs_and_exits_within_seconds(tmp_path):
    """Ctrl-C in launcher mode used to wait for every submitted job (> 60 s with a hung trial). It now
    cancels this sweep's jobs, exits 1 within seconds, leaves no job process behind, and the same
    command resumes."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    env = _env(tmp_path, "hang_once")
    cmd = _cmd(tmp_path, "cc")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = tmp_path / "m"
    deadline = time.monotonic() + 180
    while not list(marker.glob("once-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert list(marker.glob("once-*")), "the hung trial never started"
    time.sleep(1.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1, out
    assert took < 20, f"Ctrl-C took {took:.1f} s"
    assert "cancelled this sweep's 1 launcher job(s)" in out, out
    assert "re-run the same command" in out.strip().splitlines()[-1], out
    hung = int(next(marker.glob("once-*")).read_text().split()[0])
    time.sleep(1.0)
    assert not _alive(hung), "the cancelled job's process is still running"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _ok_points(tmp_path, "cc") == ["adapter.r=4", "adapter.r=8"]


def _start_with_a_hung_job(tmp_path: Path, name: str) -> tuple[subprocess.Popen, list[str], dict, int]:
    """A launcher-mode sweep (submitit_local, n_jobs=2) whose adapter.r=8 job hangs once; returns when it
    hangs: ``(sweeper, command, env, pid of the hung trial)``."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    env = _env(tmp_path, "hang_once")
    cmd = _cmd(tmp_path, name)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = tmp_path / "m"
    deadline = time.monotonic() + 180
    while not list(marker.glob("once-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert list(marker.glob("once-*")), "the hung trial never started"
    time.sleep(1.0)
    return p, cmd, env, int(next(marker.glob("once-*")).read_text().split()[0])


@pytest.mark.slow
def test_sigterm_is_handled_like_ctrl_c_in_launcher_mode(tmp_path):
    """SIGTERM (kill, a scheduler, a container stop) killed the sweeper in 0.04 s and left its jobs
    running: the re-run retried their points as stale while the orphans finished (points ran twice). It
    is now Ctrl-C: the jobs are cancelled and said, the exit is 1, and the re-run runs each point once."""
    p, cmd, env, hung = _start_with_a_hung_job(tmp_path, "term")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert "SIGTERM: cancelled this sweep's " in out and "could not cancel" not in out, out
    assert "ABORTED: interrupted (SIGTERM)" in out, out
    time.sleep(1.0)
    assert not _alive(hung), "the cancelled job's process is still running"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _ok_points(tmp_path, "term") == ["adapter.r=4", "adapter.r=8"]


@pytest.mark.slow
def test_a_rerun_stops_the_orphaned_job_of_a_killed_sweeper_before_retrying_its_point(tmp_path):
    """A sweeper SIGKILLed with a job running left an orphan the re-run knew nothing of: its point was
    retried beside it. The job is kept in the study at submission; the re-run stops it (and says so)
    before it retries the point, which then ends ok once."""
    p, cmd, env, hung = _start_with_a_hung_job(tmp_path, "orphan")
    p.kill()
    p.wait(timeout=30)  # not communicate(): the orphan holds the pipe open
    assert _alive(hung), "the orphan should outlive its sweeper"
    running = [t for t in _study(tmp_path, "orphan").trials if t.state == TrialState.RUNNING]
    assert any(t.system_attrs.get(launch.JOB, {}).get("kind") == "local" for t in running), running
    talk = [*cmd, "hydra.sweeper.progress=true"]  # its notes are progress lines
    r = subprocess.run(talk, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outlived its sweeper: stopped before its point is retried" in r.stderr + r.stdout, r.stderr
    assert not _alive(hung), "the orphan still runs after the re-run"
    assert _ok_points(tmp_path, "orphan") == ["adapter.r=4", "adapter.r=8"]


def test_a_job_that_cannot_be_cancelled_is_said_and_its_trial_kept(tmp_path, capsys):
    """With the controller down scancel failed, yet Ctrl-C said "cancelled (scancel 33)" and the point
    was re-enqueued beside job 33. What could not be cancelled is said, and its trial number returned
    (the trial stays RUNNING for a re-run to adopt)."""

    class Stuck(_FakeSlurmJob):
        def cancel(self, check: bool = True) -> None:
            raise subprocess.CalledProcessError(
                1, "scancel", "slurm_load_jobs error: Unable to contact slurm controller"
            )

    jobs = _jobs()
    jobs._numbers = {"42": 3}
    jobs._live = {"42": Stuck(tmp_path)}
    assert jobs.cancel_all("SIGTERM") == {3}
    err = capsys.readouterr().err
    assert "could not cancel launcher job(s) 42 (scancel failed" in err and "cancelled this sweep" not in err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


class _FakeSlurmJob:
    """What :class:`launch._SubmititJobs` reads of a submitit SLURM job."""

    def __init__(self, tmp_path: Path):
        self.job_id = "42"
        self.paths = SimpleNamespace(result_pickle=tmp_path / "42_result.pkl", stderr=tmp_path / "42.err")
        self.cancelled = 0

    def cancel(self, check: bool = True) -> None:
        self.cancelled += 1

    def results(self):
        raise AssertionError("no result pickle: results() must not be waited for")


def _jobs() -> launch._SubmititJobs:
    jobs = launch._SubmititJobs.__new__(launch._SubmititJobs)
    jobs.kind, jobs._lock, jobs._live, jobs.cancelled = "slurm", threading.Lock(), {}, threading.Event()
    return jobs


def _req(tmp_path: Path) -> launch._Request:
    return launch._Request(
        SimpleNamespace(result_path=str(tmp_path / "0000.json"), number=0), [], job_id="42"
    )


@pytest.mark.parametrize(
    ("states", "lost"),
    [
        (["RUNNING", "CANCELLED"], "CANCELLED"),  # scancel, no accounting: squeue still shows it
        (["PENDING", None], "UNKNOWN"),  # gone from the controller (past MinJobAge)
        (["RUNNING", "PREEMPTED"], "PREEMPTED"),
        (["RUNNING", "NODE_FAIL"], "NODE_FAIL"),
        (["RUNNING", "TIMEOUT"], None),  # its own limit: a result, not retried
    ],
)
def test_a_slurm_job_that_left_the_queue_without_a_result_is_lost_within_bounded_time(
    tmp_path, monkeypatch, states, lost
):
    """Without accounting submitit polls ``sacct`` forever for a cancelled job (the trial stays RUNNING).
    The runner asks the controller (``squeue -t all``) and calls a job that left without a result lost
    within the settle time, whatever ``sacct`` says."""
    seq = iter(states)
    last = [states[0]]

    def fake_state(job_id):
        last[0] = next(seq, last[0])
        return last[0]

    monkeypatch.setattr(launch, "slurm_state", fake_state)
    monkeypatch.setattr(launch, "_sacct_state", lambda job_id: None)  # no accounting
    monkeypatch.setattr(launch, "PROBE_S", 0.05)
    monkeypatch.setattr(launch, "SETTLE_S", 0.5)
    req, job = _req(tmp_path), _FakeSlurmJob(tmp_path)
    t0 = time.monotonic()
    _jobs()._wait(req, job)
    assert time.monotonic() - t0 < 5
    assert "without a result" in (req.error or "")
    if lost is None:
        assert req.lost is None and "TIMEOUT" in req.error
    else:
        assert req.lost == {"kind": "gone", "state": lost, "job_id": "42"}


def test_an_unreachable_controller_is_not_a_lost_job(tmp_path, monkeypatch):
    """``squeue`` failing (controller restarting) says nothing about the job: keep waiting for it."""
    calls = []

    def fake_state(job_id):
        calls.append(1)
        if len(calls) > 5:
            (tmp_path / "42_result.pkl").write_bytes(b"x")  # the job finished meanwhile
        return "?"

    monkeypatch.setattr(launch, "slurm_state", fake_state)
    monkeypatch.setattr(launch, "PROBE_S", 0.01)
    monkeypatch.setattr(launch, "SETTLE_S", 0.01)
    job = _FakeSlurmJob(tmp_path)
    job.results = lambda: ["returned"]
    req = _req(tmp_path)
    _jobs()._wait(req, job)
    assert req.lost is None and req.ret == "returned"


def test_a_failed_submission_is_not_a_result_and_a_rerun_runs_it(tmp_path, capsys):
    """``sbatch`` failing (controller down) used to end the trials ``error`` and the study "complete".
    Now the point is lost infrastructure: retried within ``retry_stale`` with a back-off, then the sweep
    stops with the reason and nothing is lost: the same command later runs every point."""
    from vramsweep.sweeper.engine import Sweep, plan_from_args
    from vramsweep.sweeper.trialproc import execute

    class FakeJobs:
        def __init__(self, down: bool):
            self.down = down

        def run(self, req):
            if self.down:
                req.error = "the job could not be submitted: FailedJobError: sbatch: error: Unable to contact slurm controller"
                req.lost = {"kind": "submit", "state": None, "job_id": None}
            else:
                execute(req.spec)

        def cancel_all(self):
            pass

    class Runner(launch.LauncherRunner):
        def __init__(self, down: bool, sweep_dir: Path):
            super().__init__(None, sweep_dir)
            self.down = down

        def start(self):
            self.jobs = FakeJobs(self.down)

    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "adapter.r=4,8",
        "hydra.sweeper.isolation=launcher",
        "hydra.sweeper.study_name=down",
        "hydra.sweeper.retry_stale=1",
        "hydra.sweeper.progress=false",
    ]
    plan = plan_from_args(args)
    assert Sweep(plan, runner=Runner(True, plan.folder)).run() == 1
    out = capsys.readouterr().out
    assert (
        "ABORTED: the launcher could not submit jobs" in out and "Unable to contact slurm controller" in out
    )
    assert "re-run the same command" in out.strip().splitlines()[-1], out
    # lost jobs are not results: not "error" in the study total (it said 1 error)
    total = next(line for line in out.splitlines() if "study total:" in line)
    assert "error" not in total and "1 launcher job lost (not results)" in total, total
    study = _study(tmp_path, "down")
    assert not [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert all(
        t.system_attrs.get("vramsweep:job_lost") == "submit"
        for t in study.trials
        if t.state == TrialState.FAIL
    )

    assert _finished(args) is None  # not "complete": a re-run must run it
    plan = plan_from_args(args)
    assert Sweep(plan, runner=Runner(False, plan.folder)).run() == 0
    assert _ok_points(tmp_path, "down") == ["adapter.r=4", "adapter.r=8"]
    assert _finished(args) is not None
    # the report: one record per point, the lost jobs a note (it counted "2 ok, 4 error")
    from vramsweep.report.load import load_sweep

    data = load_sweep(str(tmp_path / "sweeps" / "down"))
    assert sorted(str(t.status) for t in data.trials) == ["ok", "ok"], [t.status for t in data.trials]
    (note,) = [n for n in data.notes if "launcher job(s) lost" in n]
    assert (
        note.startswith("launcher job(s) lost to the infrastructure", 2) and "each point was retried" in note
    ), note


def test_a_clipped_abort_reason_ends_at_a_word():
    from vramsweep.sweeper.workers import _clip

    text = "sbatch: error: Unable to contact slurm controller (connect failure) " * 10
    out = _clip(text, 100)
    assert len(out) <= 100 and out.endswith("…") and text.startswith(out[:-1]) and out[-2] != " "
    assert text[len(out) - 1] == " "  # cut where a word ended
    assert _clip("short", 100) == "short"


# ------------------------------------------------------------------------------------- small ones (28.6)


def test_an_uninstalled_launcher_names_the_installed_ones_and_the_package():
    """``hydra/launcher=joblib`` without the plugin said "(allowed: )"."""
    from vramsweep.config.compose import translate_hydra_error

    err = translate_hydra_error(RuntimeError("In 'train': Could not find 'hydra/launcher/joblib'"))
    text = str(err)
    assert "hydra-joblib-launcher" in text and "basic" in err.allowed, text
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    assert {"submitit_local", "submitit_slurm"} <= set(err.allowed)


def test_a_trial_summary_always_has_reason_and_mfu():
    from vramsweep.record.result import new_result
    from vramsweep.report.wandb_run import design_role, summary_of

    s = summary_of(new_result(status="ok", sweep="s", trial=0, overrides=[]))
    # no `mfu: null` (W&B's reader drops null summary values): mfu/reason says why it is missing
    assert s["reason"] == "" and "mfu" not in s and s["mfu/reason"] == "not measured (trial status ok)"
    assert design_role({"kind": "search", "sampler": "grid", "repeat": 0}) == "grid"


def test_a_sweep_folder_copied_without_its_wal_holds_the_study(tmp_path):
    """The study is checkpointed at the end of a sweep: ``study.db`` alone has every trial."""
    import shutil

    from vramsweep.sweeper.engine import Sweep, plan_from_args

    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "adapter.r=4,8",
        "hydra.sweeper.isolation=inprocess",
        "hydra.sweeper.study_name=wal",
        "hydra.sweeper.progress=false",
    ]
    assert Sweep(plan_from_args(args)).run() == 0
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tmp_path / "sweeps" / "wal" / "study.db", copy / "study.db")  # no -wal, no -shm
    study = optuna.load_study(study_name="wal", storage=f"sqlite:///{copy}/study.db")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ("?", "the SLURM controller has not answered for"),  # slurmctld stopped: 300 s of silence before
        ("PENDING", "job 42 PENDING for"),
        ("REQUEUE_HOLD", "job 42 REQUEUE_HOLD for"),  # a requeued job held ~2.5 min without a line before
    ],
)
def test_a_job_waited_on_without_news_is_said_every_interval(tmp_path, monkeypatch, capsys, state, needle):
    """While a SLURM job stays queued or the controller does not answer, the sweep says so after
    WAIT_NOTE_S and again every WAIT_NOTE_S; a running job gets no such line."""
    calls = []

    def fake_state(job_id):
        calls.append(1)
        if len(calls) > 12:
            (tmp_path / "42_result.pkl").write_bytes(b"x")
        return state if len(calls) > 2 else "RUNNING"

    monkeypatch.setattr(launch, "slurm_state", fake_state)
    monkeypatch.setattr(launch, "PROBE_S", 0.0)
    monkeypatch.setattr(launch, "WAIT_NOTE_S", 1.2)
    monkeypatch.setattr(launch.time, "sleep", lambda s: time_shift.append(s))
    time_shift: list[float] = []
    real = time.monotonic
    monkeypatch.setattr(launch.time, "monotonic", lambda: real() + sum(time_shift))
    job = _FakeSlurmJob(tmp_path)
    job.results = lambda: ["returned"]
    _jobs()._wait(_req(tmp_path), job)
    lines = [x for x in capsys.readouterr().err.splitlines() if needle in x]
    # 10 probes 0.5 s apart in that state = 5 s: the first line after 1.2 s, then every 1.2 s
    assert 3 <= len(lines) <= 4 and all(x.startswith("vramsweep: trial 0000: ") for x in lines), lines


def _finished(args: list[str]):
    """The finished-study fast path on ``vramsweep train -m <args>``'s draft plan, as ``run_sweep`` calls it."""
    from vramsweep.sweeper.fastpath import finished_study
    from vramsweep.sweeper.plan import compose_sweep, draft_plan

    sweeper, task, task_args = compose_sweep(args)
    return finished_study(draft_plan(sweeper, task, task_args), task)
