"""Every GPU busy (issue 54): ``n_jobs: auto`` is one worker per visible GPU, ``trials_per_gpu`` puts several
capped trials on one big card, and throughput measured beside another trial is marked ``shared``.

No GPU here: the device list and card memory are faked (``VRAMSWEEP_FAKE_GPUS``, or NVML / the environment
stood in for), as the isolation tests fake CUDA; the trials are the fake trial in real trial processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramsweep.config.compose import ConfigError
from vramsweep.record.units import GIB
from vramsweep.sweeper import gpus as G
from vramsweep.sweeper import run_multirun
from vramsweep.sweeper.settings import SweeperConf, check_setting

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.preload=[fakes]",
]
RTX4080 = G.Profile("rtx4080_16gb", "cuda", 16.0, 15.0, 629145600, True)


def _conf(**kw) -> SweeperConf:
    return SweeperConf(**kw)


# ------------------------------------------------------------------------------------------- the device list


def test_cpu_host_is_one_worker(monkeypatch):
    monkeypatch.delenv(G.FAKE_ENV, raising=False)
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "0")
    lay = G.plan_layout(_conf(), "fork", G.Profile())
    assert (lay.n_jobs, lay.gpus, lay.line) == (1, (), "1 worker on CPU")


def test_cuda_visible_devices_is_the_list_without_nvml(monkeypatch):
    """A host whose environment names GPUs 2 and 3: two workers, one on each (no NVML: memory unknown)."""
    monkeypatch.delenv(G.FAKE_ENV, raising=False)
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(G, "_nvml_gpus", lambda: None)
    lay = G.plan_layout(_conf(), "fork", RTX4080)
    assert (lay.n_jobs, lay.gpus, lay.per_gpu) == (2, ("2", "3"), 1)
    assert lay.line == "2 workers on GPUs 2,3" and "unknown" in lay.why


def test_nvml_lists_the_gpus_without_cuda(monkeypatch):
    """No CUDA_VISIBLE_DEVICES: NVML's count and memory (a stand-in pynvml module); torch is not asked."""
    calls = []

    class Mem:
        total = 80 * GIB

    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetMemoryInfo=lambda h: Mem(),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv(G.FAKE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("VRAMSWEEP_CUDA_HOST", "1")
    monkeypatch.setattr(G, "_torch_child_gpus", lambda: pytest.fail("torch asked although NVML answered"))
    gpus, source = G.visible_gpus()
    assert source == "NVML" and [g.id for g in gpus] == ["0", "1", "2", "3"]
    assert calls == ["init", "shutdown"]
    lay = G.plan_layout(_conf(), "fork", G.Profile("h100_80gb", "cuda", 80.0, 78.0, 838860800, True))
    assert lay.line == "4 workers on GPUs 0,1,2,3" and lay.per_gpu == 1  # the profile is the card: no cap


def test_explicit_n_jobs_and_cuda_devices_still_win(monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80,80,80,80")
    lay = G.plan_layout(_conf(n_jobs=2, cuda_devices=["1", "3"]), "fork", G.Profile())
    assert (lay.n_jobs, lay.gpus) == (2, ("1", "3"))


def test_launcher_and_inprocess_keep_one_job_by_default(monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80,80")
    assert G.plan_layout(_conf(), "launcher", RTX4080).n_jobs == 1
    assert G.plan_layout(_conf(n_jobs=8), "launcher", RTX4080).n_jobs == 8
    assert G.plan_layout(_conf(n_jobs=8), "inprocess", RTX4080).n_jobs == 1


# ------------------------------------------------------------------------------------------- trials per GPU


def test_k_from_card_and_cap():
    """80 GiB card, rtx4080_16gb (15 GiB cap, context counted as 1 GiB), 1 GiB reserve: ⌊79 ÷ 16⌋ = 4;
    the profile's own card, an uncapped profile or a CPU profile: 1."""
    assert G.seats_per_gpu(80 * GIB, RTX4080, 1.0)[0] == 4
    assert G.seats_per_gpu(80 * GIB, RTX4080, 0.0)[0] == 5
    assert G.seats_per_gpu(16 * GIB, RTX4080, 1.0)[0] == 1
    assert G.seats_per_gpu(80 * GIB, G.Profile("rtx4080_16gb", "cuda", 16.0, 15.0, 0, False), 1.0)[0] == 1
    assert G.seats_per_gpu(80 * GIB, G.Profile(), 1.0)[0] == 1
    assert G.seats_per_gpu(None, RTX4080, 1.0)[0] == 1
    assert G.seats_per_gpu(80 * GIB, G.Profile(**{**RTX4080.__dict__, "swept": True}), 1.0)[0] == 1


@settings(max_examples=200, deadline=None)
@given(
    card=st.floats(8, 200),
    cap=st.floats(0.5, 40),
    ctx=st.integers(0, 3 * GIB),
    reserve=st.floats(0, 4),
)
def test_k_capped_trials_always_fit_the_card(card, cap, ctx, reserve):
    """For every card, cap, context and reserve: k seats of (cap + context) fit in (card − reserve), and one
    more would not (or k is 1, the card not shared)."""
    hw = G.Profile("p", "cuda", cap, cap, ctx, True)
    card_b = int(card * GIB)
    k, _ = G.seats_per_gpu(card_b, hw, reserve)
    seat = hw.cap_bytes + hw.context_bytes
    if k > 1:
        assert k * seat <= card_b - reserve * GIB < (k + 1) * seat
    elif card_b > cap * GIB * G.BIGGER_THAN:
        assert 2 * seat > card_b - reserve * GIB


def test_auto_fills_a_fake_80gb_card_with_four_emulated_16gb_trials(monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80")
    lay = G.plan_layout(_conf(), "fork", RTX4080)
    assert (lay.n_jobs, lay.gpus, lay.per_gpu) == (4, ("0",), 4)
    assert lay.line == "4 workers on GPU 0, up to 4 trials per GPU"


def test_trials_per_gpu_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80")
    with pytest.raises(ConfigError, match=r"trials_per_gpu=6 does not fit") as e:
        G.plan_layout(_conf(trials_per_gpu=6), "fork", RTX4080)
    assert e.value.key == "hydra.sweeper.trials_per_gpu"
    with pytest.raises(ConfigError, match="needs a per-trial memory cap"):
        G.plan_layout(_conf(trials_per_gpu=2), "fork", G.Profile())
    assert G.plan_layout(_conf(trials_per_gpu=3), "fork", RTX4080).n_jobs == 3
    swept = G.plan_layout(_conf(trials_per_gpu=2), "fork", G.Profile(**{**RTX4080.__dict__, "swept": True}))
    assert (
        swept.per_gpu == 2 and "not checked against the card's memory" in swept.notes[0]
    )  # said, not silent


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("n_jobs", "auto", True),
        ("n_jobs", 4, True),
        ("n_jobs", "many", False),
        ("n_jobs", 0, False),
        ("trials_per_gpu", "auto", True),
        ("trials_per_gpu", 2, True),
        ("trials_per_gpu", 65, False),
        ("share_below", 0.0, False),
        ("gpu_reserve_gib", -1, False),
    ],
)
def test_settings_take_auto_or_their_range(key, value, ok):
    if ok:
        check_setting(key, value)
        return
    with pytest.raises(ConfigError) as e:
        check_setting(key, value)
    assert e.value.key == f"hydra.sweeper.{key}"
    if key in ("n_jobs", "trials_per_gpu"):
        assert "auto (" in str(e.value.allowed)


def test_needs_gpu_alone_from_the_estimate():
    cfg = types.SimpleNamespace(
        hardware=types.SimpleNamespace(budget_gib=15.0), optimizer=types.SimpleNamespace(name="adamw")
    )
    assert G.needs_gpu_alone(cfg, {"required_bytes": 10 * GIB}, 0.9) is None
    assert "within 10%" in G.needs_gpu_alone(cfg, {"required_bytes": 14 * GIB}, 0.9)
    assert G.needs_gpu_alone(cfg, None, 0.9) == "no memory estimate"
    cfg.optimizer.name = "paged_adamw_8bit"
    assert "paged" in G.needs_gpu_alone(cfg, {"required_bytes": 1 * GIB}, 0.9)


# ------------------------------------------------------------------------------------------- seats at run time


def test_seats_spread_then_share_and_say_who_shared():
    seats = G.GpuSeats(("0", "1"), 2)
    assert [seats.take(n, False) for n in (1, 2)] == ["0", "1"]  # spread before sharing
    assert seats.take(3, False) == "0"
    assert seats.take(4, False) == "1"
    assert seats.give_back("0", 1) == [3]
    assert seats.take(5, False) == "0"  # the least busy GPU
    assert seats.give_back("0", 3) == [1, 5]  # everyone who ran beside it, before or after it started
    assert seats.give_back("1", 4) == [2]
    assert seats.give_back("0", 5) == [3]
    assert seats.busy() == {"0": [], "1": [2]}


def test_a_trial_that_must_run_alone_waits_for_an_empty_gpu_and_holds_it():
    seats = G.GpuSeats(("0",), 4)
    seats.take(1, False)
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(seats.take(2, True)))
    t.start()
    t.join(0.5)
    assert got == [] and t.is_alive()  # waits: trial 1 is on the GPU
    stop = threading.Event()
    late: list[str | None] = []
    t2 = threading.Thread(target=lambda: late.append(seats.take(3, False, stop)))
    t2.start()
    t2.join(0.5)
    assert late == []  # the GPU is held for trial 2: no shared trial starts there meanwhile
    assert seats.give_back("0", 1) == []
    t.join(5)
    assert got == ["0"]
    assert seats.give_back("0", 2) == []  # alone: nobody shared it
    t2.join(5)
    assert late == ["0"]


def test_a_waiting_trial_gives_up_when_the_sweep_stops():
    seats = G.GpuSeats(("0",), 1)
    seats.take(1, False)
    stop = threading.Event()
    stop.set()
    assert seats.take(2, False, stop) is None


# ------------------------------------------------------------------------------------------- whole sweeps


def _overlaps(markers: Path, numbers: list[int]) -> int:
    """Most trials running at once, from the fake trial's start/end marker times."""
    events = []
    for n in numbers:
        events += [
            (markers.joinpath(f"start-{n}").stat().st_mtime, 1),
            (markers.joinpath(f"end-{n}").stat().st_mtime, -1),
        ]
    most = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        most = max(most, now)
    return most


def _results(root: Path, name: str) -> dict[int, dict]:
    return {
        int(p.stem): json.loads(p.read_text()) for p in (root / "sweeps" / name / "trials").glob("*.json")
    }


def test_a_fake_4_gpu_host_runs_4_trials_at_once_by_default(tmp_path, monkeypatch, capfd):
    """The default (n_jobs=auto) on a 4-GPU host: 4 workers, each trial with one GPU of its own in
    CUDA_VISIBLE_DEVICES, 4 running at once, nothing marked shared; sweep.json records the workers."""
    markers = tmp_path / "m"
    monkeypatch.setenv(G.FAKE_ENV, "80,80,80,80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 3.0, "marker_dir": str(markers)}))
    code = run_multirun(
        [f"results_dir={tmp_path}", *FAKE, "adapter.r=4,8,12,16", "sweep.name=four", "train.steps=3"]
    )
    assert code == 0
    out = capfd.readouterr()
    assert "4 workers on GPUs 0,1,2,3, each trial in a" in out.out + out.err
    res = _results(tmp_path, "four")
    assert sorted(res) == [0, 1, 2, 3] and all(r["status"] == "ok" for r in res.values())
    assert sorted(r["meta"]["cuda_visible_devices"] for r in res.values()) == ["0", "1", "2", "3"]
    assert all(r["meta"]["gpu_share"]["shared"] is False for r in res.values())
    assert _overlaps(markers, [0, 1, 2, 3]) == 4
    workers = json.loads((tmp_path / "sweeps" / "four" / "sweep.json").read_text())["workers"]
    assert workers["n_jobs"] == 4 and workers["cuda_devices"] == ["0", "1", "2", "3"]
    assert workers["line"] == "4 workers on GPUs 0,1,2,3"


def test_a_fake_80gb_card_runs_4_emulated_16gb_trials_marked_shared(tmp_path, monkeypatch, capfd):
    """One 80 GiB card, hardware=rtx4080_16gb: 4 trials at once on GPU 0, each result's throughput marked
    shared with the trials that ran beside it (exact: the sweeper saw them). Each trial's estimate is composed
    in the sweeper before its seat is taken (2-3 s each on this loaded 2-core host), hence 15 s trials."""
    markers = tmp_path / "m"
    monkeypatch.setenv(G.FAKE_ENV, "80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 15.0, "marker_dir": str(markers)}))
    args = [
        f"results_dir={tmp_path}",
        *FAKE,
        "hardware=rtx4080_16gb",
        "adapter.r=4,8,12,16",
        "sweep.name=emu",
    ]
    # the confirm stage off: its trial 0 would write the same start marker as this stage's trial 0
    assert run_multirun([*args, "train.steps=3", "+sweep.confirm=0"]) == 0
    out = capfd.readouterr()
    assert "4 workers on GPU 0, up to 4 trials per GPU" in out.out + out.err
    res = _results(tmp_path, "emu")
    assert all(r["meta"]["cuda_visible_devices"] == "0" for r in res.values())
    assert _overlaps(markers, [0, 1, 2, 3]) == 4
    for n, r in res.items():
        share = r["meta"]["gpu_share"]
        assert share["shared"] is True and share["exact"] is True and share["trials_per_gpu"] == 4
        assert share["with"] == sorted(set(res) - {n})
    _report_marks_shared(tmp_path / "sweeps" / "emu")


def _report_marks_shared(folder: Path) -> None:
    """The report shows each trial's GPU as shared, and pick's tokens/s leaves shared figures out (marked,
    no tie broken by them); the memory figures stay."""
    from vramsweep.report import build_report, load_sweep
    from vramsweep.report.pick import candidates

    sweep = load_sweep(str(folder))
    assert all(t.timing_disturbed.startswith("shared GPU 0 with trial(s)") for t in sweep.trials)
    trials = build_report(sweep, importances=False).tables["trials"]
    assert [c.header for c in trials.columns][-1] == "GPU"
    assert {trials.columns[-1].cell(r) for r in trials.rows} == {"0 shared"}
    for c in candidates(sweep, [t for t in sweep.trials if t.ok]):
        assert c.tokens_per_s is None and c.speed_loaded and c.peak_bytes is not None


def test_share_below_makes_every_trial_run_alone(tmp_path, monkeypatch):
    """The same sweep with share_below tiny: every estimate is "near its cap", so each trial holds the card
    alone: one at a time, none marked shared, the reason recorded."""
    markers = tmp_path / "m"
    monkeypatch.setenv(G.FAKE_ENV, "80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 0.6, "marker_dir": str(markers)}))
    args = [f"results_dir={tmp_path}", *FAKE, "hardware=rtx4080_16gb", "adapter.r=4,8,12", "sweep.name=alone"]
    assert run_multirun([*args, "hydra.sweeper.share_below=0.0001", "train.steps=3"]) == 0
    res = _results(tmp_path, "alone")
    assert _overlaps(markers, [0, 1, 2]) == 1
    for r in res.values():
        share = r["meta"]["gpu_share"]
        assert share["shared"] is False and share["with"] == [] and "cap" in share["alone"]


def test_the_trial_process_marks_shared_conservatively_until_the_sweeper_knows(tmp_path):
    """A result whose sweeper died before rewriting it keeps the trial's own mark: shared wherever another
    trial could have run beside it."""
    from vramsweep.sweeper.trialproc import provisional_share

    assert provisional_share({"device": "0", "per_gpu": 4, "alone": None})["shared"] is True
    assert provisional_share({"device": "0", "per_gpu": 4, "alone": "near its cap"})["shared"] is False
    assert provisional_share({"device": "0", "per_gpu": 1, "alone": "one trial per GPU"})["shared"] is False
    assert provisional_share({"device": "0", "per_gpu": 4, "alone": None})["exact"] is False
    assert os.environ.get(G.FAKE_ENV) is None


def test_a_gpu_whose_trial_crashed_takes_no_trial_until_its_probe_passes(tmp_path, monkeypatch, capfd):
    """Two fake GPUs; the adapter.r=4 trial is SIGKILLed, the adapter.r=8 trial raises a CUDA OOM. Only the
    killed trial's GPU is probed (an OOM leaves the GPU as it was); it fails its probe, so no later trial
    runs on it, and every point still runs once."""
    markers = tmp_path / "m"
    monkeypatch.setenv(G.FAKE_ENV, "80,80")
    fake = {
        "faults": {"adapter.r=4": "kill", "adapter.r=8": "oom"},
        "sleep_s": 0.5,
        "marker_dir": str(markers),
    }
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps(fake))
    probed: list[str] = []

    def probe(gpu: str) -> str | None:
        probed.append(gpu)
        return "the probe allocation failed (exit 1): CUDA error: an illegal memory access (faked)"

    monkeypatch.setattr(G, "probe_gpu", probe)
    args = [
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=4,8,12,16,20,24",
        "sweep.name=probe",
        "train.steps=3",
    ]
    assert run_multirun(args) == 0
    res = _results(tmp_path, "probe")
    killed = next(r for r in res.values() if "adapter.r=4" in r["overrides"])
    assert killed["status"] == "error" and "SIGKILL" in killed["reason"]
    bad = killed["meta"]["gpu_share"]["device"]  # written by the sweeper: the trial died
    assert probed == [bad]
    assert "failed its probe" in capfd.readouterr().out
    died_at = (tmp_path / "sweeps" / "probe" / "trials" / f"{killed['trial']:04d}.json").stat().st_mtime
    later = [r for r in res.values() if markers.joinpath(f"start-{r['trial']}").stat().st_mtime > died_at]
    assert later and all(r["meta"]["gpu_share"]["device"] != bad for r in later)
    points = sorted(r["overrides"][-1] for r in res.values())
    assert len(points) == len(set(points)) == 6


def test_a_gpu_that_passes_its_probe_is_used_again(tmp_path, monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"faults": {"adapter.r=4": "raise"}}))
    probed: list[str] = []
    monkeypatch.setattr(G, "probe_gpu", lambda gpu: probed.append(gpu))
    assert run_multirun([f"results_dir={tmp_path}", *FAKE, "adapter.r=4,8,12", "sweep.name=reuse"]) == 0
    res = _results(tmp_path, "reuse")
    assert probed == ["0"] and sorted(r["status"] for r in res.values()) == ["error", "ok", "ok"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_killed_sweeper_on_shared_gpus_then_rerun_runs_every_point_once(tmp_path, sig):
    """The sweeper (one fake 80 GiB card, 4 emulated 16 GB seats) is SIGKILLed - or SIGTERMed, handled as
    Ctrl-C - while the adapter.r=8 trial hangs beside others; the same command again finishes the sweep:
    every point ok exactly once, nothing left running or waiting."""
    markers = tmp_path / "m"
    fake = {"faults": {"adapter.r=8": "hang_once"}, "sleep_s": 1.0, "marker_dir": str(markers)}
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, VRAMSWEEP_FAKE=json.dumps(fake), VRAMSWEEP_FAKE_GPUS="80", PYTHONPATH=path)
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        *FAKE,
        "hardware=rtx4080_16gb",
        "adapter.r=4,8,12,16,20,24",
        "sweep.name=kill",
        "train.steps=3",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        t0 = time.time()
        while not list(markers.glob("once-*")):
            assert proc.poll() is None and time.time() - t0 < 180, "the hanging trial never started"
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name="kill", storage=f"sqlite:///{tmp_path}/sweeps/kill/study.db")
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    ok = [t.user_attrs["overrides"][-1] for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(ok) == sorted(f"adapter.r={r}" for r in (4, 8, 12, 16, 20, 24)), ok
    res = _results(tmp_path, "kill")
    ok_files = [r["overrides"][-1] for r in res.values() if r["status"] == "ok"]
    assert sorted(ok_files) == sorted(ok)  # one ok result per point: nothing ran twice


@pytest.mark.slow  # ~40 s: a sweep of two 12 s fake trials through the real CLI
def test_the_gpu_share_smoke_dry_runs_on_cpu(tmp_path):
    """scripts/gpu_share_smoke.py --dry-run: two trials under two caps share the faked card, each marked
    shared with the other, then the chosen config alone (the confirm stage); every finding passes."""
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "gpu_share_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_share_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert smoke.main(["--dry-run", "--out", str(tmp_path / "out")]) == 0
    found = json.loads((tmp_path / "out" / "share_smoke.json").read_text())["findings"]
    assert len(found) == 10 and all(f["ok"] for f in found)


def test_confirm_stage_reruns_the_chosen_config_alone_and_pick_ranks_on_it(tmp_path, monkeypatch, capfd):
    """Two configs shared the fake 80 GiB card; sweep.confirm (auto) re-runs the one pick chooses (the best
    eval loss, single runs) alone in <sweep>/confirm: its result is not shared, the report's confirm table
    shows shared vs alone, pick's tokens/s for it is the alone figure. The same command again runs nothing."""
    monkeypatch.setenv(G.FAKE_ENV, "80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 12.0}))
    args = [f"results_dir={tmp_path}", *FAKE, "hardware=rtx4080_16gb", "adapter.r=4,16", "sweep.name=conf"]
    assert run_multirun([*args, "train.steps=3"]) == 0
    out = capfd.readouterr().out
    assert "vramsweep: confirm: 1 config(s) pick chooses between" in out
    assert "1 worker(s) on GPU(s) 0, one trial per GPU" in out
    folder = tmp_path / "sweeps" / "conf"
    main = _results(tmp_path, "conf")
    assert all(r["meta"]["gpu_share"]["shared"] for r in main.values())
    best = min(main.values(), key=lambda r: r["metrics"]["eval_loss"])
    confirm = {int(p.stem): json.loads(p.read_text()) for p in (folder / "confirm" / "trials").glob("*.json")}
    assert len(confirm) == 1
    (c,) = confirm.values()
    assert c["overrides"] == best["overrides"] and c["meta"]["design"] == {
        "kind": "confirm",
        "role": "confirm",
        "of": best["trial"],
    }
    assert c["meta"]["gpu_share"]["shared"] is False and c["status"] == "ok"
    from vramsweep.report import build_report, load_sweep
    from vramsweep.report.pick import candidates

    sweep = load_sweep(str(folder))
    table = build_report(sweep, importances=False).tables["confirm"]
    assert [r["trial"] for r in table.rows] == [best["trial"]]
    assert table.rows[0]["tokens_per_s_alone"] == c["metrics"]["tokens_per_s"]
    ranked = {cand.number: cand for cand in candidates(sweep, [t for t in sweep.trials if t.ok])}
    assert ranked[best["trial"]].tokens_per_s == c["metrics"]["tokens_per_s"]
    assert not ranked[best["trial"]].speed_loaded
    other = next(n for n in ranked if n != best["trial"])
    assert ranked[other].tokens_per_s is None and ranked[other].speed_loaded
    assert run_multirun([*args, "train.steps=3"]) == 0  # again: both stages complete, nothing runs
    assert len(list((folder / "confirm" / "trials").glob("*.json"))) == 1


@pytest.mark.slow  # ~60 s: the confirm test's sweep again with the stage off
def test_confirm_0_runs_no_confirm_stage(tmp_path, monkeypatch):
    monkeypatch.setenv(G.FAKE_ENV, "80")
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 12.0}))
    args = [f"results_dir={tmp_path}", *FAKE, "hardware=rtx4080_16gb", "adapter.r=4,16", "sweep.name=off"]
    assert run_multirun([*args, "+sweep.confirm=0", "train.steps=3"]) == 0
    assert all(r["meta"]["gpu_share"]["shared"] for r in _results(tmp_path, "off").values())
    assert not (tmp_path / "sweeps" / "off" / "confirm").exists()


@pytest.mark.parametrize(
    ("value", "ok"), [(None, True), ("auto", True), (0, True), (3, True), (-1, False), ("x", False)]
)
def test_sweep_confirm_takes_auto_or_a_count(value, ok):
    from vramsweep.sweeper.settings import SweepConfig

    if ok:
        assert SweepConfig.from_dict({"confirm": value}).confirm == value
        return
    with pytest.raises(ConfigError, match="sweep.confirm") as e:
        SweepConfig.from_dict({"confirm": value})
    assert e.value.key == "sweep.confirm"


def test_a_slot_is_owned_before_it_turns_running(tmp_path):
    """The kill -9 fuzz with 4 workers left a trial RUNNING without an owner (the sweeper died between
    pop_slot's RUNNING and the owner stamp): no re-run could tell it from a live one for grace_s. The owner
    is now stamped first: a death right after the RUNNING write leaves an owned trial."""
    import optuna
    from optuna.trial import TrialState

    from vramsweep.sweeper.storage import OWNER, SLOT, pop_slot

    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", study_name="s")
    study.enqueue_trial({}, skip_if_exists=False)
    storage = study._storage
    (t,) = study.get_trials(deepcopy=False)
    storage.set_trial_system_attr(t._trial_id, SLOT, 0)
    real = storage.set_trial_state_values

    def die_after_running(trial_id, state, values=None):
        real(trial_id, state=state, values=values)
        raise KeyboardInterrupt  # the process dies right after the RUNNING write

    storage.set_trial_state_values = die_after_running

    def claim(tid):
        storage.set_trial_system_attr(tid, OWNER, {"host": "h", "pid": 1})

    with pytest.raises(KeyboardInterrupt):
        pop_slot(study, 1, claim=claim)
    (t,) = study.get_trials(deepcopy=False)
    assert t.state == TrialState.RUNNING and t.system_attrs[OWNER] == {"host": "h", "pid": 1}
