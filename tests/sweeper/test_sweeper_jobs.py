"""Launcher sweeps stay exact when jobs outlive their sweeper (docs/CLUSTER.md): a re-run stops every job
the study recorded for a lost point (a PENDING one included) before the point is retried, refuses to run
anything while the controller cannot stop them, never takes the interrupted sweeper's own placeholder for a
result, and an aborted sweep exits non-zero. The launcher is faked (its jobs, ``scancel`` through
``stop_orphan``) as the other launcher tests do; the real-cluster check is not part of this file."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from vramsweep.config import ConfigError
from vramsweep.sweeper import launch
from vramsweep.sweeper.engine import Sweep, plan_from_args
from vramsweep.sweeper.trialproc import execute


class _Jobs:
    """Each submission records a SLURM job id; ``lose``: the job is lost (as a Ctrl-C that could not cancel
    it leaves it queued), else the trial runs here."""

    def __init__(self, runner, lose: bool, log: list):
        self.runner, self.lose, self.log = runner, lose, log

    def run(self, req):
        job_id = f"{700 + req.spec.number}"
        self.runner.on_submit(req.spec, {"kind": "slurm", "id": job_id})
        self.log.append(("run", req.spec.number))
        req.job_id = job_id
        if self.lose:
            req.error = f"job {job_id} (slurm) ended NODE_FAIL without a result"
            req.lost = {"kind": "gone", "state": "NODE_FAIL", "job_id": job_id}
        else:
            execute(req.spec)

    def cancel_all(self):
        pass


class _Runner(launch.LauncherRunner):
    def __init__(self, lose: bool, sweep_dir: Path, log: list):
        super().__init__(None, sweep_dir)
        self.lose, self.log = lose, log

    def start(self):
        self.jobs = _Jobs(self, self.lose, self.log)


ARGS = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "adapter.r=4,8,16",
    "hydra.sweeper.sampler=grid",
    "hydra.sweeper.isolation=launcher",
    "hydra.sweeper.study_name=jobs",
    "hydra.sweeper.retry_stale=0",
    "hydra.sweeper.progress=false",
]


def test_a_rerun_stops_the_recorded_jobs_of_lost_points_before_retrying_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    plan = plan_from_args([f"results_dir={tmp_path}", *ARGS])
    log: list = []
    Sweep(plan, runner=_Runner(True, plan.folder, log)).run()  # every job lost (retry_stale=0): left
    assert "re-run the same command to run them" in capsys.readouterr().out
    lost = {f"{700 + n}" for _, n in log}
    assert len(lost) == 3

    # the controller is down: the lost jobs (maybe still PENDING) cannot be stopped, so nothing runs
    def down(rec):
        log.append(("stop", rec["id"]))
        return True, f"scancel {rec['id']} failed: Unable to contact slurm controller"

    monkeypatch.setattr("vramsweep.sweeper.recovery.stop_orphan", down)
    log.clear()
    with pytest.raises(ConfigError, match="could not be stopped.*run them twice"):
        Sweep(plan, runner=_Runner(False, plan.folder, log)).run()
    assert not [e for e in log if e[0] == "run"], log

    # the controller answers: every recorded job is stopped first, then each point runs once
    def up(rec):
        log.append(("stop", rec["id"]))
        return True, None

    monkeypatch.setattr("vramsweep.sweeper.recovery.stop_orphan", up)
    log.clear()
    assert Sweep(plan, runner=_Runner(False, plan.folder, log)).run() == 0
    first_run = next(i for i, e in enumerate(log) if e[0] == "run")
    assert {e[1] for e in log[:first_run] if e[0] == "stop"} == lost, log
    assert sorted(n for kind, n in log if kind == "run") == [3, 4, 5]  # the retries, once each
    study = optuna.load_study(study_name="jobs", storage=f"sqlite:///{plan.folder / 'study.db'}")
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 3
    log.clear()  # asked once: a later re-run does not ask the controller again
    assert Sweep(plan, runner=_Runner(False, plan.folder, log)).run() == 0
    assert log == []


def test_the_interrupted_sweepers_own_placeholder_is_not_taken_for_a_result(tmp_path, monkeypatch):
    """After SIGTERM the interrupted sweeper left a trial RUNNING (its job could not be cancelled) with its
    own ``cancelled (interrupted)`` placeholder as the result file; the re-run stopped the job and then told
    that placeholder as the point's result, so the point never ran."""
    import json

    from optuna.trial import create_trial

    from vramsweep.sweeper.launch import JOB
    from vramsweep.sweeper.storage import HEARTBEAT, OWNER, SLOT

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    args = [f"results_dir={tmp_path}", *ARGS[:2], "adapter.r=4,8", *ARGS[2:]]
    plan = plan_from_args([*args, "hydra.sweeper.n_trials=1"])
    log: list = []
    assert Sweep(plan, runner=_Runner(False, plan.folder, log)).run() == 0
    study = optuna.load_study(study_name="jobs", storage=f"sqlite:///{plan.folder / 'study.db'}")
    study.add_trial(
        create_trial(state=TrialState.WAITING, system_attrs={"fixed_params": {"adapter.r": 8}, SLOT: 1})
    )
    t = study.trials[-1]
    assert study._storage.set_trial_state_values(t._trial_id, TrialState.RUNNING)
    optuna.Trial(study, t._trial_id).suggest_categorical("adapter.r", [4, 8])
    study._storage.set_trial_system_attr(t._trial_id, OWNER, {"host": "another-host", "pid": 1, "ctime": 0.0})
    study._storage.set_trial_system_attr(t._trial_id, HEARTBEAT, 0.0)
    study._storage.set_trial_system_attr(t._trial_id, JOB, {"kind": "slurm", "id": "901"})
    placeholder = json.loads((plan.folder / "trials" / "0000.json").read_text())
    placeholder.update(
        trial=t.number,
        status="error",
        reason="launcher job failed without a result: job 901 cancelled (interrupted)",
        overrides=["adapter.r=8"],
    )
    placeholder["meta"]["lost_job"] = {"kind": "interrupted", "state": "CANCELLED", "job_id": "901"}
    (plan.folder / "trials" / f"{t.number:04d}.json").write_text(json.dumps(placeholder))

    monkeypatch.setattr("vramsweep.sweeper.recovery.stop_orphan", lambda rec: (True, None))
    log.clear()
    plan = plan_from_args([*args, "hydra.sweeper.n_trials=2", "hydra.sweeper.retry_stale=1"])
    assert Sweep(plan, runner=_Runner(False, plan.folder, log)).run() == 0
    assert [kind for kind, _ in log] == ["run"], log  # the point ran (once), after its job was stopped
    study = optuna.load_study(study_name="jobs", storage=f"sqlite:///{plan.folder / 'study.db'}")
    done = [x.params["adapter.r"] for x in study.trials if x.state == TrialState.COMPLETE]
    assert sorted(done) == [4, 8]


def test_a_sweep_that_prints_aborted_exits_non_zero(tmp_path, monkeypatch, capsys):
    """Three of four aborted launcher sweeps exited 0 after printing ABORTED: the exit follows the reason."""
    from vramsweep.sweeper.workers import WorkerPool

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")

    def stops_without_the_event(self, idx):
        self.state.abort_reason = "the launcher's controller stopped answering"

    monkeypatch.setattr(WorkerPool, "run_worker", stops_without_the_event)
    plan = plan_from_args([f"results_dir={tmp_path}", *ARGS])
    assert Sweep(plan, runner=_Runner(False, plan.folder, [])).run() == 1
    assert "ABORTED: the launcher's controller stopped answering" in capsys.readouterr().out


class _SlowCancelJobs(_Jobs):
    """Jobs that wait until cancelled; cancelling them fails (the controller is down) and takes a while, as
    ``scancel`` does against a stopped ``slurmctld``: the workers see the cancellation begin long before
    it is known which jobs could not be cancelled."""

    def __init__(self, runner, log: list):
        super().__init__(runner, False, log)
        self.stop = __import__("threading").Event()
        self.numbers: dict[str, int] = {}

    def run(self, req):
        job_id = f"{700 + req.spec.number}"
        self.numbers[job_id] = req.spec.number
        self.runner.on_submit(req.spec, {"kind": "slurm", "id": job_id})
        self.log.append(("run", req.spec.number))
        req.job_id = job_id
        self.stop.wait()
        req.error = f"job {job_id} cancelled (interrupted)"
        req.lost = {"kind": "interrupted", "state": "CANCELLED", "job_id": job_id}

    def cancel_all(self, why="Ctrl-C"):
        import time

        self.stop.set()
        time.sleep(1.0)  # scancel timing out against a stopped controller
        return set(self.numbers.values())


class _SlowCancelRunner(_Runner):
    def start(self):
        self.jobs = _SlowCancelJobs(self, self.log)


def test_jobs_that_could_not_be_cancelled_are_stopped_by_the_rerun_however_slow_the_cancel(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C with the controller down: cancelling the jobs fails only after a while, the workers must wait
    for that answer. They used to re-enqueue the points at once (the failed cancels not known yet), so
    the re-run retried them while the uncancelled jobs stayed queued: 6 jobs for 3 points."""
    import _thread
    import threading
    import time

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    plan = plan_from_args([f"results_dir={tmp_path}", *ARGS, "hydra.sweeper.n_jobs=3"])
    log: list = []
    runner = _SlowCancelRunner(False, plan.folder, log)

    def ctrl_c():
        while len([e for e in log if e[0] == "run"]) < 3:
            time.sleep(0.02)
        _thread.interrupt_main()

    threading.Thread(target=ctrl_c, daemon=True).start()
    assert Sweep(plan, runner=runner).run() == 1
    assert "ABORTED: interrupted (Ctrl-C); 3 trials left running" in capsys.readouterr().out
    study = optuna.load_study(study_name="jobs", storage=f"sqlite:///{plan.folder / 'study.db'}")
    left = [t for t in study.trials if t.state == TrialState.RUNNING]
    assert len(left) == 3, study.trials  # their jobs may still run: left for the re-run to stop
    from vramsweep.sweeper.storage import HEARTBEAT, OWNER

    for t in left:  # the interrupted sweeper's process ended (this test ran it in-process)
        study._storage.set_trial_system_attr(t._trial_id, OWNER, {"host": "gone", "pid": 1, "ctime": 0.0})
        study._storage.set_trial_system_attr(t._trial_id, HEARTBEAT, 0.0)

    stopped: list = []

    def stop(rec):
        stopped.append(rec["id"])
        log.append(("stop", rec["id"]))
        return True, None

    monkeypatch.setattr("vramsweep.sweeper.recovery.stop_orphan", stop)
    states = {"700": "RUNNING", "701": "PENDING", "702": "PENDING"}  # one job runs, two wait for its node
    monkeypatch.setattr("vramsweep.sweeper.orphans.slurm_state", lambda job_id: states.get(job_id))
    log.clear()
    plan = plan_from_args(
        [f"results_dir={tmp_path}", *ARGS, "hydra.sweeper.n_jobs=3", "hydra.sweeper.retry_stale=1"]
    )
    assert Sweep(plan, runner=_Runner(False, plan.folder, log)).run() == 0
    assert sorted(stopped) == ["700", "701", "702"], log  # every uncancelled job stopped ...
    assert stopped[-1] == "700", stopped  # the PENDING ones before the RUNNING one (it would free the node)
    first_run = next(i for i, e in enumerate(log) if e[0] == "run")
    assert all(e[0] == "stop" for e in log[:first_run]) and len(log[:first_run]) == 3, log  # ... first
    assert len([e for e in log if e[0] == "run"]) == 3, log  # then each point once
    study = optuna.load_study(study_name="jobs", storage=f"sqlite:///{plan.folder / 'study.db'}")
    done = [t.params["adapter.r"] for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(done) == [4, 8, 16]


def test_a_rerun_stops_the_pending_jobs_before_the_running_one(tmp_path, monkeypatch):
    """On the real cluster (tests/sweeper/test_sweeper_slurm.py) the re-run stopped the lost jobs in trial
    order: cancelling the RUNNING one freed the node and SLURM started a PENDING one before its own cancel
    came (a point started a second time, then cancelled). The PENDING ones are stopped first."""
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    plan = plan_from_args([f"results_dir={tmp_path}", *ARGS])
    log: list = []
    Sweep(plan, runner=_Runner(True, plan.folder, log)).run()  # every job lost (retry_stale=0): left
    states = {"700": "RUNNING", "701": "PENDING", "702": "PENDING"}
    monkeypatch.setattr("vramsweep.sweeper.orphans.slurm_state", lambda job_id: states.get(job_id))
    stopped: list = []

    def stop(rec):
        stopped.append(rec["id"])
        return True, None

    monkeypatch.setattr("vramsweep.sweeper.recovery.stop_orphan", stop)
    assert Sweep(plan, runner=_Runner(False, plan.folder, [])).run() == 0
    assert sorted(stopped[:2]) == ["701", "702"] and stopped[2:] == ["700"], stopped
