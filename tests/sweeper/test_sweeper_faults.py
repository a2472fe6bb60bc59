"""Fault tests: failures are data, kills are survived, resume is exact, bad spaces never start.

All with the fake trial function (``fakes``), run through the real fork-server
isolation; the sweeper kill test runs the sweeper as a separate process and SIGKILLs it mid-trial.
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
import psutil
import pytest
from optuna.trial import TrialState, create_trial

from vramsweep.sweeper import run_multirun
from vramsweep.sweeper.storage import HEARTBEAT, OWNER, SLOT

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.preload=[fakes]",
]


def load(root: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{root}/sweeps/{name}/study.db")


def results(root: Path, name: str) -> dict[int, dict]:
    return {
        int(p.stem): json.loads(p.read_text())
        for p in sorted((root / "sweeps" / name / "trials").glob("*.json"))
    }


# ---------------------------------------------------------------------------------------------- trial faults


@pytest.mark.parametrize("isolation", ["inprocess", "fork"])
def test_result_that_breaks_the_contract_is_that_trials_error(tmp_path, isolation, monkeypatch):
    """A trial function that returns ``eval_loss="x"`` fails its own trial with the key named; the sweep
    goes on (in-process it used to abort with ``internal error in worker 0: ResultSchemaError``; forked,
    the reason said only that the process exited before writing its result)."""
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"faults": {"adapter.r=8": "bad_metric"}}))
    rc = run_multirun(
        [
            f"results_dir={tmp_path}",
            *FAKE,
            "adapter.r=4,8,16",
            "hydra.sweeper.study_name=bad",
            f"hydra.sweeper.isolation={isolation}",
            "hydra.sweeper.progress=false",
        ]
    )
    assert rc == 0
    res = results(tmp_path, "bad")
    assert [res[n]["status"] for n in range(3)] == ["ok", "error", "ok"]
    assert "metrics.eval_loss" in res[1]["reason"] and "contract" in res[1]["reason"]
    assert "adapter.r=8" in res[1]["overrides"]


@pytest.fixture(scope="module")
def faulty_sweep(tmp_path_factory):
    """One grid sweep of 5 points: trial 1 is SIGKILLed, 2 raises CUDA OOM, 3 returns a NaN loss."""
    root = tmp_path_factory.mktemp("faults")
    saved = os.environ.get("VRAMSWEEP_FAKE")
    os.environ["VRAMSWEEP_FAKE"] = json.dumps({"faults": {"1": "kill", "2": "oom", "3": "nan"}})
    try:
        rc = run_multirun(
            [
                f"results_dir={root}",
                *FAKE,
                "hydra.sweeper.preload=[fakes,torch]",
                "adapter.r=4,8,16,32,64",
                "hydra.sweeper.sampler=grid",
                "hydra.sweeper.study_name=tf",
            ]
        )
    finally:
        if saved is None:
            os.environ.pop("VRAMSWEEP_FAKE", None)
        else:
            os.environ["VRAMSWEEP_FAKE"] = saved
    return rc, load(root, "tf"), results(root, "tf")


def test_sweep_survives_trial_faults(faulty_sweep):
    rc, study, res = faulty_sweep
    assert rc == 0
    assert [res[n]["status"] for n in range(5)] == ["ok", "error", "oom", "diverged", "ok"]
    assert study.trials[4].state == TrialState.COMPLETE  # the sweep went on after the kill


def test_killed_trial_is_an_error_with_its_signal(faulty_sweep):
    _, study, res = faulty_sweep
    t = study.trials[1]
    assert t.state == TrialState.FAIL and t.user_attrs["status"] == "error"
    assert "SIGKILL" in t.user_attrs["reason"] and "SIGKILL" in res[1]["reason"]
    assert res[1]["meta"]["design"] == {"kind": "search", "sampler": "grid", "repeat": 0}


def test_injected_cuda_oom_is_oom_and_infeasible(faulty_sweep):
    _, study, res = faulty_sweep
    t = study.trials[2]
    assert res[2]["status"] == t.user_attrs["status"] == "oom"
    assert "OutOfMemoryError" in res[2]["reason"]
    assert t.state == TrialState.PRUNED and t.constraints["vram_over_budget_gib"] > 0
    assert all(b.number != 2 for b in study.best_trials)


def test_injected_nan_is_diverged(faulty_sweep):
    _, study, res = faulty_sweep
    assert res[3]["status"] == study.trials[3].user_attrs["status"] == "diverged"
    assert study.trials[3].state == TrialState.FAIL
    assert res[3]["metrics"]["eval_loss"] is None  # NaN is stored as null, the reason says why
    assert "nan" in res[3]["reason"].lower()


# ---------------------------------------------------------------------------------------------- sweeper kill


def _wait_for(path: Path, timeout: float = 90.0) -> None:
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout:
            raise TimeoutError(path)
        time.sleep(0.1)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_kill_9_of_the_sweeper_then_rerun_finishes_exactly_the_remainder(tmp_path):
    markers = tmp_path / "markers"
    env = dict(os.environ, VRAMSWEEP_FAKE=json.dumps({"faults": {"1": "hang"}, "marker_dir": str(markers)}))
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=4,8,16,32",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=k1",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_for(markers / "start-1")
        trial_pid = int((markers / "start-1").read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(trial_pid), "the trial process must die with its sweeper (no orphan writing results)"
    study = load(tmp_path, "k1")
    assert [t.state for t in study.trials] == [
        TrialState.COMPLETE,
        TrialState.RUNNING,
        TrialState.WAITING,
        TrialState.WAITING,
    ]
    # re-run the same command: the dead worker's trial is failed and retried, the rest runs once
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "left RUNNING by a dead worker" in done.stdout
    study = load(tmp_path, "k1")
    states = [t.state for t in study.trials]
    assert states == [
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.COMPLETE,
        TrialState.COMPLETE,
        TrialState.COMPLETE,
    ]
    assert study.trials[4].user_attrs["retry_of"] == 1 and study.trials[4].params == study.trials[1].params
    assert "stale" in study.trials[1].user_attrs["reason"]
    res = results(tmp_path, "k1")
    ok = [r for r in res.values() if r["status"] == "ok"]
    assert len(ok) == 4 and sorted(r["overrides"][-1] for r in ok) == sorted(
        f"adapter.r={r}" for r in (4, 8, 16, 32)
    )  # every point exactly once: no duplicated result
    assert res[1]["status"] == "error" and res[4]["meta"]["retry_of"] == 1
    assert not list((tmp_path / "sweeps" / "k1" / "trials").glob(".*.tmp"))


def _plant_stale_trial(root: Path, name: str, *, slot: int, params: dict, host: str = "another-host") -> int:
    """Make the study look like a worker on another machine died while running ``slot``."""
    from optuna.distributions import CategoricalDistribution

    study = load(root, name)
    study.add_trial(create_trial(state=TrialState.WAITING, system_attrs={"fixed_params": params, SLOT: slot}))
    storage = study._storage
    tid = study.trials[-1]._trial_id
    assert storage.set_trial_state_values(tid, TrialState.RUNNING)
    trial = optuna.Trial(study, tid)
    for k, v in params.items():
        trial.suggest_categorical(k, [v] if not isinstance(v, int) else [4, 8, 16, 32])
    del CategoricalDistribution
    storage.set_trial_system_attr(tid, OWNER, {"host": host, "pid": 12345, "ctime": 0.0})
    storage.set_trial_system_attr(tid, HEARTBEAT, time.time() - 3600)
    trial.set_user_attr("overrides", [f"adapter.r={params['adapter.r']}"])
    return study.trials[-1].number


def test_stale_trial_of_another_machine_is_failed_and_retried_once(tmp_path):
    args = [
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=choice(4,8,16,32)",
        "hydra.sweeper.study_name=h1",
        "hydra.sweeper.sampler={name: random, seed: 0}",
        "hydra.sweeper.dedup=false",
    ]
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 0
    stale = _plant_stale_trial(tmp_path, "h1", slot=2, params={"adapter.r": 16})
    assert run_multirun([*args, "hydra.sweeper.n_trials=3"]) == 0
    study = load(tmp_path, "h1")
    t = study.trials[stale]
    assert (
        t.state == TrialState.FAIL
        and "stale" in t.user_attrs["reason"]
        and "another-host" in t.user_attrs["reason"]
    )
    retry = [x for x in study.trials if x.user_attrs.get("retry_of") == stale]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].params == {"adapter.r": 16}
    assert sum(x.state == TrialState.COMPLETE for x in study.trials) == 3


def test_stale_trial_with_a_result_file_is_told_from_it_not_rerun(tmp_path):
    args = [
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=choice(4,8,16,32)",
        "hydra.sweeper.study_name=h2",
        "hydra.sweeper.sampler={name: random, seed: 0}",
        "hydra.sweeper.dedup=false",
    ]
    assert run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    stale = _plant_stale_trial(tmp_path, "h2", slot=1, params={"adapter.r": 8})
    # the trial had finished and written its JSON when its worker died (before telling the study)
    src = results(tmp_path, "h2")[0]
    src["trial"] = stale
    src["meta"]["optuna"] = src["meta"]["optuna"] | {"trial_number": stale, "values": [1.5]}
    (tmp_path / "sweeps" / "h2" / "trials" / f"{stale:04d}.json").write_text(json.dumps(src))
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 0
    study = load(tmp_path, "h2")
    assert len(study.trials) == 2 and study.trials[stale].state == TrialState.COMPLETE
    assert study.trials[stale].values == [1.5]


# ---------------------------------------------------------------------------------------------- bad spaces


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["quant=choice(none,nf5)"], "quant=nf5"),
        (["adapter.rank=choice(8,16)"], "adapter.rank"),
        (["adapter.r=choice(8,abc)"], "adapter.r"),
        (["train.lr=choice(0.001,5.0)"], "train.lr"),
        (["sweep=quant", "sweep.factors=[['quant=nf5']]"], "quant=nf5"),
        (["quant=nf5", "adapter.r=8,16"], "quant=nf5"),  # Hydra: unknown option of a fixed override
        (["adapter.r=choice(8,16"], "choice(8,16"),  # Hydra: syntax
        (["quant=none,nf4", "hydra.sweeper.sampler=simulated_annealing"], "hydra.sweeper.sampler"),
        (["quant=none,nf4", "hydra.sweeper.objectives=[vram]"], "vram"),
    ],
)
def test_bad_search_space_is_rejected_before_any_trial(tmp_path, capsys, args, needle):
    rc = run_multirun([f"results_dir={tmp_path}", *FAKE, "hydra.sweeper.study_name=bad", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err  # our "error: ..." or Hydra's own message for a command line it cannot parse
    assert not (tmp_path / "sweeps").exists()  # nothing written


# ---------------------------------------------------------------------------------------------- one study a folder

INPROC = [*FAKE[:1], "hydra.sweeper.isolation=inprocess", "hydra.sweeper.progress=false"]


def _hashes(folder: Path) -> dict[str, bytes]:
    """The folder's files (not SQLite's -wal/-shm: this process's pooled connections keep them open)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(("-wal", "-shm"))
    }


def test_two_differently_named_sweeps_in_one_folder_the_second_is_refused(tmp_path, capsys):
    """``hydra.sweep.dir`` shared by sweeps ``a`` and ``b`` (one study.db, two studies): ``b`` overwrote
    ``a``'s ``trials/0000.json`` and ``0001.json``. The folder belongs to ``a``: ``b`` exits 2 in one line,
    nothing in the folder changes."""
    folder = tmp_path / "shared"
    base = [f"results_dir={tmp_path}", *INPROC, f"hydra.sweep.dir={folder}"]
    assert run_multirun([*base, "sweep.name=a", "adapter.r=4,8"]) == 0
    before = _hashes(folder)
    capsys.readouterr()
    assert run_multirun([*base, "sweep.name=b", "adapter.r=16,32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "belongs to sweep 'a'" in err[0] and "hydra.sweep.dir" in err[0], err
    assert _hashes(folder) == before


def test_two_sweeps_of_one_name_started_together_one_is_refused(tmp_path, monkeypatch):
    """Same ``sweep.name``, different points, started together: both passed the identity check (nobody
    had stored one yet) and mixed their points (``sweep.json`` of the loser, trials of the winner). The
    check runs under a lock on the folder: the second waits, sees the first's identity, and is refused."""
    import threading

    from vramsweep.config.compose import ConfigError
    from vramsweep.sweeper.engine import plan_from_args
    from vramsweep.sweeper.study import StudyBook

    original = StudyBook.check_identity

    def slow_check(self):  # the first sweep pauses between its check and its writes
        original(self)
        if threading.current_thread().name == "first":
            time.sleep(1.5)

    monkeypatch.setattr(StudyBook, "check_identity", slow_check)
    base = [f"results_dir={tmp_path}", *INPROC, "sweep.name=same"]
    books = {
        n: StudyBook(plan_from_args([*base, f"adapter.r={r}"]))
        for n, r in (("first", "4,8"), ("second", "16,32"))
    }
    errors: dict[str, BaseException] = {}

    def open_(name: str) -> None:
        try:
            books[name].open()
        except ConfigError as exc:
            errors[name] = exc

    threads = [threading.Thread(target=open_, args=(n,), name=n) for n in books]
    threads[0].start()
    time.sleep(0.5)
    threads[1].start()
    for t in threads:
        t.join(60)
    assert list(errors) == ["second"], errors
    assert "was started by a different sweep" in str(errors["second"])
    sweep_json = json.loads((tmp_path / "sweeps" / "same" / "sweep.json").read_text())
    study = load(tmp_path, "same")
    assert sweep_json["identity"] == study.user_attrs["vramsweep:identity"] == books["first"].plan.identity


def test_results_the_study_does_not_know_are_never_overwritten(tmp_path, capsys):
    """A study that lost commits (a killed sweep's folder copied without ``study.db-wal``) knows trial 0000
    only; the re-run gave number 1 to a new trial and overwrote ``0001.json`` silently. Now it exits 2 in
    one line naming the file, and nothing in the folder changes; with the study's commits back it runs."""
    import shutil

    folder = tmp_path / "sweeps" / "wal"
    args = [f"results_dir={tmp_path}", *INPROC, "sweep.name=wal", "adapter.r=4,8"]
    assert run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    shutil.copy(folder / "study.db", tmp_path / "old.db")  # the study as it was after trial 0000
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 0
    shutil.copy(folder / "study.db", tmp_path / "full.db")
    shutil.copy(tmp_path / "old.db", folder / "study.db")  # lost the commits of trial 0001
    before = _hashes(folder)
    capsys.readouterr()
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0001.json" in err[0] and "study.db-wal" in err[0], err
    assert _hashes(folder) == before
    (folder / "study.db").unlink()  # no study at all, results on disk: refused too
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 2
    assert "study 'wal' does not exist" in capsys.readouterr().err
    shutil.copy(tmp_path / "full.db", folder / "study.db")
    assert run_multirun([*args, "hydra.sweeper.n_trials=2"]) == 0


def test_a_refused_sweep_takes_back_the_folders_it_made(tmp_path, capsys):
    """The checks run under a lock on the folder, so the folder exists before them; when they refuse (here:
    one storage, the same study name, other points, a new folder) the folders made for it go again."""
    db = f"hydra.sweeper.storage=sqlite:///{tmp_path / 'shared.db'}"
    base = [f"results_dir={tmp_path}", *INPROC, db, "sweep.name=x"]
    assert run_multirun([*base, f"hydra.sweep.dir={tmp_path / 'one'}", "adapter.r=4,8"]) == 0
    capsys.readouterr()
    new = tmp_path / "two" / "deeper"
    assert run_multirun([*base, f"hydra.sweep.dir={new}", "adapter.r=16,32"]) == 2
    assert "was started by a different sweep" in capsys.readouterr().err
    assert not (tmp_path / "two").exists()


def test_a_heartbeat_that_keeps_failing_says_so_once():
    """A heartbeat stamp that fails (the storage refuses writes) used to be silent while another host reaped
    this worker's live trials after ``grace_s``: now it is said once while it keeps failing, and once when
    stamps work again."""
    from types import SimpleNamespace

    from vramsweep.sweeper.recovery import LostTrials

    class Storage:
        ok = False
        stamped: list[int] = []

        def set_trial_system_attr(self, tid, key, value):
            if not self.ok:
                raise OSError("database is locked")
            self.stamped.append(tid)

    said: list[str] = []
    plan = SimpleNamespace(heartbeat_s=10.0, grace_s=120.0)
    book = SimpleNamespace(plan=plan, running={3, 4}, storage=Storage(), say=said.append)
    lost = LostTrials(book)
    for _ in range(5):
        lost.stamp_running()
    assert len(said) == 1, said
    assert "heartbeat" in said[0] and "OSError: database is locked" in said[0] and "grace_s=120" in said[0]
    book.storage.ok = True
    lost.stamp_running()
    lost.stamp_running()
    assert len(said) == 2 and "stamped again" in said[1] and sorted(book.storage.stamped) == [3, 3, 4, 4]
