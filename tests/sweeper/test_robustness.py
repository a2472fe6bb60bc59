"""Sweep robustness: umask-honouring writes, pre-flight checks, exact recovery of killed points, progress
lines and summaries."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from vramsweep.record.result import atomic_write_json, atomic_write_text
from vramsweep.sweeper import run_multirun

# ---------------------------------------------------------------------------------------------- umask


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        p = atomic_write_text(tmp_path / "a.md", "x\n")
        q = atomic_write_json(tmp_path / "sub" / "b.json", {"a": 1})
        # rewriting an existing file keeps the umask's mode too (not the temp file's 0600)
        atomic_write_json(q, {"a": 2})
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == mode
    assert stat.S_IMODE(q.stat().st_mode) == mode
    assert json.loads(Path(q).read_text()) == {"a": 2}
    assert not list(tmp_path.rglob(".*.tmp"))


# ---------------------------------------------------------------------------------------------- lost points


def _sweeper_cmd(root: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={root}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.isolation=inprocess",
        "adapter.r=4,8,16",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=lost",
        *extra,
    ]


def _kill_when_started(cmd: list[str], env: dict, marker: Path) -> None:
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        t0 = time.time()
        while not marker.exists():
            assert proc.poll() is None, "the sweeper ended before the hanging trial started"
            assert time.time() - t0 < 120, f"timed out waiting for {marker}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow  # ~20 s: three sweeper processes started and SIGKILLed
def test_a_point_killed_three_times_is_recovered_exactly_once(tmp_path, monkeypatch, capsys):
    """The sweeper is SIGKILLed three times while the same design point (adapter.r=8) runs. With
    retry_stale=2 the third loss is final and the summary says how to recover; a re-run with
    retry_stale=3 completes the point: every point ok exactly once, the loss count in its result."""
    markers = tmp_path / "markers"
    hang = dict(
        os.environ, VRAMSWEEP_FAKE=json.dumps({"faults": {"adapter.r=8": "hang"}, "marker_dir": str(markers)})
    )
    cmd = _sweeper_cmd(tmp_path, "hydra.sweeper.retry_stale=2")
    for number in (1, 3, 4):  # the r=8 point's trial numbers: first try, then a retry after each kill
        _kill_when_started(cmd, hang, markers / f"start-{number}")
    # the re-runs in-process (faster than a fresh interpreter): same entry point as `python -m vramsweep.sweeper`
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    capsys.readouterr()
    assert run_multirun(cmd[3:]) == 0
    out = capsys.readouterr().out
    assert "lost for good" in out and "hydra.sweeper.retry_stale=3" in out, out
    assert run_multirun(_sweeper_cmd(tmp_path, "hydra.sweeper.retry_stale=3")[3:]) == 0
    assert "lost for good" not in capsys.readouterr().out
    study = optuna.load_study(study_name="lost", storage=f"sqlite:///{tmp_path}/sweeps/lost/study.db")
    states = {t.number: t.state for t in study.trials}
    assert [states[n] for n in (1, 3, 4)] == [TrialState.FAIL] * 3
    assert states[5] == TrialState.COMPLETE and study.trials[5].params == {"adapter.r": 8}
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    res = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "sweeps/lost/trials").glob("*.json")}
    ok = sorted(r["overrides"][-1] for r in res.values() if r["status"] == "ok")
    assert ok == ["adapter.r=16", "adapter.r=4", "adapter.r=8"]  # every point once, no duplicate
    assert res[5]["meta"]["retries"] == 3 and res[5]["meta"]["retry_of"] == 4
    assert [res[n]["meta"]["retries"] for n in (1, 3, 4)] == [0, 1, 2]
    assert "not retried again" in res[4]["reason"] and "retried (1/2)" in res[1]["reason"]


def test_ctrl_c_requeue_is_bounded_like_a_dead_worker(tmp_path):
    """Ctrl-C re-enqueues the running point within ``retry_stale`` (it used to re-enqueue forever)."""
    import threading

    from vramsweep.sweeper.engine import Sweep, plan_from_args

    saved = os.environ.get("VRAMSWEEP_FAKE")
    os.environ["VRAMSWEEP_FAKE"] = json.dumps(
        {"faults": {"adapter.r=8": "hang"}, "marker_dir": str(tmp_path / "m")}
    )
    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.preload=[fakes]",
        "adapter.r=4,8",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=cc",
        "hydra.sweeper.retry_stale=1",
        "hydra.sweeper.progress=false",
    ]
    try:
        for attempt in range(2):
            sweep = Sweep(plan_from_args(args))
            marker = tmp_path / "m" / f"start-{(1, 2)[attempt]}"

            def interrupt(marker=marker):
                while not marker.exists():
                    time.sleep(0.05)
                import _thread

                _thread.interrupt_main()

            threading.Thread(target=interrupt, daemon=True).start()
            assert sweep.run() == 1
    finally:
        if saved is None:
            os.environ.pop("VRAMSWEEP_FAKE", None)
        else:
            os.environ["VRAMSWEEP_FAKE"] = saved
    study = optuna.load_study(study_name="cc", storage=f"sqlite:///{tmp_path}/sweeps/cc/study.db")
    # trial 1 interrupted -> retried as 2; 2 interrupted -> bound reached: no third WAITING copy
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL]
    assert "interrupted" in study.trials[2].user_attrs["reason"]
    assert "not retried again" in study.trials[2].user_attrs["reason"]


# ---------------------------------------------------------------------------------------------- progress


def concurrent_trial(overrides, *, sweep=None, trial=None, **kw):
    """A fake trial that, while trial 0 runs, lets "another worker" finish the next waiting slot."""
    from fakes import fake_trial
    from vramsweep.sweeper.storage import pop_slot

    if trial == 0:
        url = os.environ["CONCURRENT_STUDY_URL"]
        study = optuna.load_study(study_name="conc", storage=url)
        tid = pop_slot(study, 3)
        study.tell(optuna.Trial(study, tid), [1.0] * len(study.directions))
    return fake_trial(overrides, sweep=sweep, trial=trial, **kw)


def test_progress_counts_come_from_the_study_with_several_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CONCURRENT_STUDY_URL", f"sqlite:///{tmp_path}/sweeps/conc/study.db")
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    rc = run_multirun(
        [
            f"results_dir={tmp_path}",
            "hydra.sweeper.trial_fn=test_robustness:concurrent_trial",
            "hydra.sweeper.isolation=inprocess",
            "adapter.r=4,8,16",
            "hydra.sweeper.sampler=grid",
            "hydra.sweeper.study_name=conc",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    # this worker ran trials 0 and 2; trial 1 was finished by the other worker meanwhile
    assert len(lines) == 2, out
    assert " 2/3 trial 0000" in lines[0] and " 3/3 trial 0002" in lines[1], out


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_live_progress_line_on_a_terminal_and_quiet_otherwise():
    from vramsweep.sweeper.progress import Progress

    tty, log = _Stream(True), _Stream(False)
    for stream in (tty, log):
        p = Progress(20, stream=stream)
        p.finished("trial 0000 ok", wall_s=10.0, done=5, running=2, best="eval_loss 2.314 (trial 0003)")
        p.update(running=3)
        p.stop()
    assert "\r" in tty.text and "5/20 done, 3 running" in tty.text
    assert "ETA 50 s" in tty.text  # 15 left x 10 s / 3 running
    assert "best eval_loss 2.314 (trial 0003)" in tty.text
    assert log.text.count("\n") == 1 and "\r" not in log.text and "ETA" not in log.text  # CI: one line
    assert " 5/20 trial 0000 ok" in log.text


def test_progress_false_silences_trial_lines_but_never_a_note():
    """hydra.sweeper.progress=false drops the per-trial lines and the bar; a note (a trial's error reason, a
    job that could not be stopped, a GPU that failed its probe) is still printed."""
    from vramsweep.sweeper.progress import Progress

    tty, log = _Stream(True), _Stream(False)
    for stream in (tty, log):
        p = Progress(3, stream=stream, enabled=False)
        p.say("vramsweep: 1 job could not be stopped")
        p.finished("trial 0000 ok", wall_s=1.0, done=1)
        p.update(running=1)
        p.stop()
        assert stream.text == "vramsweep: 1 job could not be stopped\n", stream.text


def test_finished_study_rerun_is_fast_and_never_imports_torch(tmp_path):
    """A finished study re-run prints its summary without composing every point or starting the fork
    server (which imports torch)."""
    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.isolation=inprocess",
        "sweep=demo",
    ]
    assert run_multirun(args) == 0
    probe = (
        "import sys, time\n"
        "import vramsweep.sweeper.engine as e, vramsweep.sweeper.validate as v\n"
        "def boom(*a, **k): raise AssertionError('validated a finished study')\n"
        "v.validate_design = v.validate_space = boom\n"
        "inner = e.run_sweep\n"
        "def timed(*a, **k):\n"
        "    t0 = time.perf_counter(); rc = inner(*a, **k)\n"
        "    print('RUN_SWEEP_S', round(time.perf_counter() - t0, 3), file=sys.stderr); return rc\n"
        "e.run_sweep = timed\n"
        # the imports any use of a study pays (optuna, its SQL models, alembic) are not the sweeper's work
        "import optuna, optuna.storages._rdb.models, alembic.command, alembic.migration, alembic.script\n"
        "from vramsweep.sweeper import run_multirun\n"
        "if __name__ == '__main__':\n"
        "    rc = run_multirun(sys.argv[1:])\n"
        "    print('TORCH', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    p = subprocess.run(
        [
            sys.executable,
            str(script),
            *args[:-2],
            "hydra.sweeper.preload=[fakes]",
            "sweep=demo",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TORCH False" in p.stderr, p.stderr
    assert "is complete" in p.stdout and "nothing to run" in p.stdout
    secs = float(p.stderr.split("RUN_SWEEP_S", 1)[1].split()[0])
    print(f"finished-study sweeper: {secs} s")
    # measured 0.13 s on 2 loaded cores (imports excluded); it composed every point before (~5 s)
    assert secs < 1.0, f"the sweeper took {secs} s on a finished study"


# ---------------------------------------------------------------------------------------------- polish


def _result(status="ok", peak=None, budget=0.0, reason=None):
    from vramsweep.record.result import new_result

    r = new_result(status=status, reason=reason, config={"hardware": {"budget_gib": budget}})
    r["metrics"]["peak_memory_bytes"] = peak
    if peak:
        r["metrics"]["memory_kind"] = "cpu_tracked"
    return r


def test_failed_trial_summary_has_no_none_and_over_budget_is_said(capsys):
    from vramsweep.cli import print_result

    print_result(_result("error", reason="injected"), "r.json")
    out = capsys.readouterr().out
    assert "None" not in out and "n/a MiB" not in out
    assert "peak memory: not measured" in out and "status: error (injected)" in out
    print_result(_result("ok", peak=3 * 2**30, budget=2.0), "r.json")
    assert "status: over budget" in capsys.readouterr().out
    print_result(_result("ok", peak=1 * 2**30, budget=2.0), "r.json")
    assert "status: ok" in capsys.readouterr().out


def test_trial_line_formats_values_and_says_over_budget():
    from vramsweep.sweeper.progress import plural, trial_line

    r = _result("ok", peak=3 * 2**30, budget=2.0)
    line = trial_line(7, r, 1.0, [], ["train.lr=0.00022258235696668132", "adapter.r=16", "quant=nf4"])
    assert "trial 0007 over budget" in line
    assert "train.lr=2.23e-04 adapter.r=16 quant=nf4" in line
    assert plural(1, "trial") == "1 trial" and plural(2, "trial") == "2 trials"


def test_sweep_summary_says_1_trial_and_no_pruning_warning_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.isolation=inprocess",
        "hydra.sweeper.study_name=one",
        "train.lr=interval(1e-5,1e-3)",
        "hydra.sweeper.n_trials=1",
    ]
    assert run_multirun(args) == 0
    out, err = capsys.readouterr()
    assert "this run: 1 trial in" in out, out
    assert "pruning is on" not in err  # a default search: the default pruner simply never prunes
    assert "train.lr=" in out and "e-0" in out  # the sampled lr printed as 2.23e-04, not 0.000222...
    from vramsweep.sweeper.engine import plan_from_args

    plan_from_args([*args[:-1], "hydra.sweeper.pruner=sha", "hydra.sweeper.study_name=two"])
    assert "pruning is on but train.eval_every=0" in capsys.readouterr().err  # chosen: actionable


def test_bitsandbytes_kernels_noise_is_dropped_on_and_off_a_terminal(monkeypatch):
    import io
    import logging

    import vramsweep  # noqa: F401  (installs the filter)

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Keep()
    log.addHandler(h)
    try:
        msg = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install kernels`"
        tty = io.StringIO()
        tty.isatty = lambda: True  # type: ignore[method-assign]
        monkeypatch.setattr(sys, "stderr", tty)
        log.warning(msg, "x")
        log.warning("another warning")
        assert seen == ["another warning"]
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: dropped too (not actionable; a
        log.warning(msg, "x")  # production run keeps it as one line in its warnings.log: test_noise.py)
        assert seen == ["another warning"]
    finally:
        log.removeHandler(h)


def test_report_says_torn_results_on_the_terminal(tmp_path, capsys, monkeypatch):
    from vramsweep.cli import main

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.isolation=inprocess",
        "hydra.sweeper.study_name=torn",
        "adapter.r=4,8",
        "hydra.sweeper.sampler=grid",
    ]
    assert run_multirun(args) == 0
    folder = tmp_path / "sweeps" / "torn"
    p = folder / "trials" / "0001.json"
    p.write_text(p.read_text()[:40])  # torn
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    err = capsys.readouterr().err
    assert "vramsweep report: warning: skipped 0001.json: unreadable" in err, err


def test_lost_point_is_reported_and_retried_after_raising_the_bound(tmp_path, capsys, monkeypatch):
    """Fast version of the kill test: a point whose worker died (planted stale trial of another host) with
    retry_stale=0 ends as error for good and the summary names the fix; re-running with retry_stale=1
    completes it, its result recording one earlier loss."""
    from vramsweep.sweeper.storage import HEARTBEAT, OWNER, SLOT

    def plant(slot: int, r: int) -> int:  # a worker on another machine died while running this point
        from optuna.trial import create_trial

        study = optuna.load_study(study_name="h3", storage=f"sqlite:///{tmp_path}/sweeps/h3/study.db")
        study.add_trial(
            create_trial(
                state=TrialState.WAITING, system_attrs={"fixed_params": {"adapter.r": r}, SLOT: slot}
            )
        )
        tid = study.trials[-1]._trial_id
        assert study._storage.set_trial_state_values(tid, TrialState.RUNNING)
        optuna.Trial(study, tid).suggest_categorical("adapter.r", [4, 8])
        study._storage.set_trial_system_attr(tid, OWNER, {"host": "another-host", "pid": 1, "ctime": 0.0})
        study._storage.set_trial_system_attr(tid, HEARTBEAT, time.time() - 3600)
        return study.trials[-1].number

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    args = [
        f"results_dir={tmp_path}",
        "hydra.sweeper.trial_fn=fakes:fake_trial",
        "hydra.sweeper.isolation=inprocess",
        "adapter.r=4,8",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.study_name=h3",
    ]
    assert run_multirun([*args, "hydra.sweeper.n_trials=1"]) == 0
    stale = plant(1, 8)
    capsys.readouterr()
    assert run_multirun([*args, "hydra.sweeper.retry_stale=0"]) == 0
    out = capsys.readouterr().out
    assert "lost for good" in out and "hydra.sweeper.retry_stale=1" in out, out
    assert run_multirun([*args, "hydra.sweeper.retry_stale=1"]) == 0
    study = optuna.load_study(study_name="h3", storage=f"sqlite:///{tmp_path}/sweeps/h3/study.db")
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == stale]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].params == {"adapter.r": 8}
    res = json.loads((tmp_path / "sweeps/h3/trials" / f"{retry[0].number:04d}.json").read_text())
    assert res["status"] == "ok" and res["meta"]["retries"] == 1
