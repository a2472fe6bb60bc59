"""The vramsweep Hydra sweeper: plugin discovery, search space, designs, outcomes, resume, pruning, budget.

Trials here are the fake trial (``fakes``): milliseconds each, deterministic metrics,
run through the real fork-server isolation. Real-trial sweeps are in ``test_sweeps.py`` (slow).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import optuna
import pytest
from optuna.trial import TrialState

from fakes import landscape, parse_overrides
from vramsweep.config import ConfigError
from vramsweep.record.units import GIB
from vramsweep.sweeper import run_multirun
from vramsweep.sweeper.design import ablation_points, stacking_points
from vramsweep.sweeper.outcome import CONSTRAINT_KEY, classify
from vramsweep.sweeper.settings import Objective, parse_objectives
from vramsweep.sweeper.space import cli_sweep_params, grid_points, merge_overrides, parse_params

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.preload=[fakes]",
]


def sweep(tmp_path: Path, *args: str) -> int:
    return run_multirun([f"results_dir={tmp_path}", *FAKE, *args])


def load(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/sweeps/{name}/study.db")


def results(tmp_path: Path, name: str) -> dict[int, dict]:
    out = {}
    for p in sorted((tmp_path / "sweeps" / name / "trials").glob("*.json")):
        out[int(p.stem)] = json.loads(p.read_text())
    return out


# ---------------------------------------------------------------------------------------------- plugin


def test_hydra_discovers_the_plugin_and_its_config():
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    names = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)]
    assert "hydra_plugins.vramsweep_sweeper.vramsweep_sweeper.VramsweepSweeper" in names
    node = ConfigStore.instance().load("hydra/sweeper/vramsweep.yaml").node
    for key in ("n_trials", "storage", "sampler", "direction", "study_name", "n_jobs", "params", "pruner"):
        assert key in node


# ---------------------------------------------------------------------------------------------- space


def test_override_grammar_to_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    dims, fixed = parse_params(
        {
            "quant": "choice(none, nf4, nf4_dq)",
            "adapter.r": "range(8,33,8)",
            "train.lr": "tag(log, interval(1e-5, 1e-2))",
            "context.max_tokens": "interval(128, 1024)",
            "adapter.targets": "choice([q_proj,v_proj], all-linear)",
            "train.steps": "5",
        },
        int_keys=["context.max_tokens"],
    )
    by = {d.key: d for d in dims}
    assert fixed == ["train.steps=5"]
    assert isinstance(by["quant"].distribution(), CategoricalDistribution)
    assert by["adapter.r"].distribution() == IntDistribution(8, 32, step=8)
    lr = by["train.lr"].distribution()
    assert isinstance(lr, FloatDistribution) and lr.log and lr.low == 1e-5
    assert by["context.max_tokens"].distribution() == IntDistribution(128, 1024)
    # non-scalar choices keep their override text
    assert by["adapter.targets"].text("[q_proj,v_proj]") == "[q_proj,v_proj]"
    params, fixed_cli = cli_sweep_params(["quant=none,nf4", "adapter.r=choice(8,16)", "train.steps=3"])
    assert params == {"quant": "none,nf4", "adapter.r": "choice(8,16)"} and fixed_cli == ["train.steps=3"]
    assert grid_points(parse_params(params)[0]) == [
        {"quant": "none", "adapter.r": 8},
        {"quant": "none", "adapter.r": 16},
        {"quant": "nf4", "adapter.r": 8},
        {"quant": "nf4", "adapter.r": 16},
    ]
    with pytest.raises(ConfigError, match="discrete"):
        grid_points([by["train.lr"]])
    assert merge_overrides(["quant=none", "adapter.r=8"], ["quant=nf4"]) == ["adapter.r=8", "quant=nf4"]


def test_objectives_and_directions():
    assert parse_objectives(None) == [Objective("eval_loss", "minimize")]
    objs = parse_objectives([{"metric": "peak_memory_bytes", "direction": "minimize"}, "tokens_per_s"])
    assert objs == [Objective("peak_memory_bytes", "minimize"), Objective("tokens_per_s", "maximize")]
    assert (
        parse_objectives(["eval_loss", "tokens_per_s"], ["maximize", "minimize"])[0].direction == "maximize"
    )
    with pytest.raises(ConfigError, match="unknown objective"):
        parse_objectives(["vram"])
    with pytest.raises(ConfigError, match="direction"):
        parse_objectives(["eval_loss"], ["minimize", "maximize"])


def test_ablation_and_stacking_designs_follow_the_contract():
    pts = ablation_points(
        ["quant=none", "optimizer=adamw"], [["quant=nf4"], ["optimizer=adamw_8bit"]], repeats=2
    )
    assert len(pts) == 6
    assert pts[0].design == {"kind": "ablation", "role": "baseline", "change": [], "repeat": 0}
    assert pts[1].design == {"kind": "ablation", "role": "factor", "change": ["quant=nf4"], "repeat": 0}
    assert "train.seed=1" in pts[3].overrides and pts[3].design["repeat"] == 1
    assert pts[1].params == {"quant": "nf4", "optimizer": "adamw", "train.seed": "0"}
    st = stacking_points(["quant=none"], ["quant=nf4_dq", "checkpointing=on"])
    assert [p.design["step"] for p in st] == [0, 1, 2]
    assert st[2].design == {
        "kind": "stacking",
        "step": 2,
        "added": "checkpointing=on",
        "applied": ["quant=nf4_dq", "checkpointing=on"],
        "repeat": 0,
    }
    assert st[2].overrides == ["quant=nf4_dq", "checkpointing=on"]


# ---------------------------------------------------------------------------------------------- outcomes


def _res(status="ok", peak=1.0 * GIB, loss=2.0, budget=2.0, **metrics):
    return {
        "status": status,
        "reason": None,
        "config": {"hardware": {"budget_gib": budget}},
        "metrics": {"peak_memory_bytes": peak, "eval_loss": loss, "train_loss": loss, **metrics},
        "meta": {},
    }


def test_outcome_classification():
    objs = [Objective("eval_loss", "minimize")]
    ok = classify(_res(), objs)
    assert (ok.state, ok.values, ok.constraint, ok.failure) == ("COMPLETE", [2.0], -1.0, False)
    over = classify(_res(peak=3.0 * GIB), objs)
    assert over.state == "COMPLETE" and over.constraint == pytest.approx(1.0)  # measured, infeasible
    oom = classify(_res("oom", peak=None, loss=None), objs)
    assert oom.state == "PRUNED" and oom.constraint > 0 and not oom.failure
    nan = _res(loss=float("nan"))
    out = classify(nan, objs)
    assert out.state == "FAIL" and nan["status"] == "diverged"
    missing = classify(_res(), [Objective("mfu", "maximize")])
    assert missing.state == "FAIL" and missing.failure and "mfu" in missing.note
    inf = classify(_res(tokens_per_s=math.inf), [Objective("tokens_per_s", "maximize")])
    assert inf.state == "FAIL" and inf.failure
    assert classify(_res("unsupported"), objs).failure is False
    assert classify(_res("error"), objs).failure is True
    assert classify(_res("pruned"), objs).state == "PRUNED"


# ---------------------------------------------------------------------------------------------- sweeps


def test_search_sweep_end_to_end(tmp_path, capsys):
    rc = sweep(
        tmp_path,
        "quant=none,nf4",
        "adapter.r=choice(4,8,16,32)",
        "train.lr=tag(log,interval(1e-4,1e-2))",
        "hydra.sweeper.n_trials=5",
        "hydra.sweeper.study_name=s1",
        "hydra.sweeper.sampler={name: tpe, seed: 1}",
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert f"results: {tmp_path}/sweeps/s1" in out and out.count("/5 trial ") == 5
    study = load(tmp_path, "s1")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    res = results(tmp_path, "s1")
    assert sorted(res) == [0, 1, 2, 3, 4]
    for n, r in res.items():
        t = study.trials[n]
        assert r["status"] == t.user_attrs["status"] == "ok"
        assert t.user_attrs["result_path"] == f"trials/{n:04d}.json"
        assert r["meta"]["design"] == {"kind": "search"}
        assert r["overrides"][-3:] == [
            f"quant={t.params['quant']}",
            f"adapter.r={t.params['adapter.r']}",
            f"train.lr={t.params['train.lr']!r}",
        ]
        assert t.values[0] == pytest.approx(r["metrics"]["eval_loss"])
    info = json.loads((tmp_path / "sweeps" / "s1" / "sweep.json").read_text())
    assert info["objectives"] == [{"metric": "eval_loss", "direction": "minimize"}]
    assert info["storage"].startswith("sqlite:///") and info["study_name"] == "s1" and info["n_total"] == 5


def test_rerun_runs_exactly_the_remainder(tmp_path, capsys):
    args = [
        "adapter.r=range(2,64,2)",
        "hydra.sweeper.study_name=r1",
        "hydra.sweeper.sampler=random",
        "hydra.sweeper.dedup=false",
    ]
    assert sweep(tmp_path, *args, "hydra.sweeper.n_trials=3") == 0
    capsys.readouterr()
    assert sweep(tmp_path, *args, "hydra.sweeper.n_trials=5") == 0
    out = capsys.readouterr().out
    assert "resuming" in out and out.count("/5 trial ") == 2
    assert sweep(tmp_path, *args, "hydra.sweeper.n_trials=5") == 0  # nothing left: no new trial
    assert capsys.readouterr().out.count("/5 trial ") == 0
    study = load(tmp_path, "r1")
    assert len(study.trials) == 5 and all(t.state == TrialState.COMPLETE for t in study.trials)
    assert sorted(results(tmp_path, "r1")) == [0, 1, 2, 3, 4]


def test_budget_makes_trials_infeasible_and_never_best(tmp_path):
    budget = 0.08  # GiB: the fake's rank-256 adapter (lowest loss) peaks above it, ranks 4 and 16 below
    assert (
        sweep(
            tmp_path,
            "adapter.r=4,16,256",
            "hydra.sweeper.sampler=grid",
            f"hardware.budget_gib={budget}",
            "hydra.sweeper.study_name=b1",
        )
        == 0
    )
    study = load(tmp_path, "b1")
    assert len(study.trials) == 3
    feasible, infeasible = [], []
    for t in study.trials:
        peak = landscape(parse_overrides(t.user_attrs["overrides"]))["peak_memory_bytes"] / GIB
        assert t.constraints[CONSTRAINT_KEY] == pytest.approx(peak - budget)
        (feasible if peak <= budget else infeasible).append(t)
        assert t.user_attrs["feasible"] is (peak <= budget)
    assert feasible and infeasible
    # the infeasible rank-256 trial has the lowest loss, yet it is never best
    assert min(study.trials, key=lambda t: t.values[0]) in infeasible
    assert study.best_trial.number == min(feasible, key=lambda t: t.values[0]).number
    assert all(t.user_attrs["feasible"] for t in study.best_trials)


def test_pruning_reports_through_storage_and_keeps_partial_metrics(tmp_path):
    rc = sweep(
        tmp_path,
        "train.lr=tag(log,interval(1e-6,1e-2))",
        "train.eval_every=5",
        "hydra.sweeper.n_trials=8",
        "hydra.sweeper.sampler={name: random, seed: 3}",
        "hydra.sweeper.pruner={name: median, n_startup_trials: 2}",
        "hydra.sweeper.study_name=p1",
    )
    assert rc == 0
    study = load(tmp_path, "p1")
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert pruned, "a median pruner over lr in [1e-6, 1e-2] prunes the low-lr trials"
    res = results(tmp_path, "p1")
    for t in pruned:
        r = res[t.number]
        assert r["status"] == t.user_attrs["status"] == "pruned"
        assert t.intermediate_values  # reported by the trial process through the storage
        assert r["metrics"]["eval_loss"] is not None and r["meta"]["steps_run"] < 30
        assert r["meta"]["eval_curve"][0][0] == 5
    assert all(t.intermediate_values for t in study.trials if t.state == TrialState.COMPLETE)


def test_stacking_design_meta(tmp_path):
    assert sweep(tmp_path, "sweep=memory_stack") == 0
    res = results(tmp_path, "memory_stack")
    # eval_loss is an objective: 3 seed repeats by default, repeat-major
    assert [r["meta"]["design"]["step"] for r in res.values()] == [0, 1, 2, 3, 4, 5] * 3
    assert [r["meta"]["design"]["repeat"] for r in res.values()] == [0] * 6 + [1] * 6 + [2] * 6
    last = res[5]
    assert last["meta"]["design"]["added"] == "vocab=sliced"
    assert set(last["meta"]["design"]["applied"]) <= set(last["overrides"])


def test_ablation_sweep_inprocess_and_dashboard_loads_it(tmp_path):
    rc = sweep(tmp_path, "sweep=vocab_slicing", "hydra.sweeper.isolation=inprocess")
    assert rc == 0
    res = results(tmp_path, "vocab_slicing")
    assert [r["meta"]["design"]["role"] for r in res.values()] == ["baseline", "factor", "baseline", "factor"]
    assert [r["meta"]["design"]["repeat"] for r in res.values()] == [0, 0, 1, 1]
    # optuna-dashboard serves the study unchanged
    from optuna_dashboard._app import create_app

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/sweeps/vocab_slicing/study.db")
    app = create_app(storage)

    def get(path: str) -> dict:
        env: dict = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()}
        setup_testing_defaults(env)
        status: list[str] = []
        body = b"".join(app(env, lambda s, h, exc_info=None: status.append(s)))
        assert status[0].startswith("200"), (path, status, body[:300])
        return json.loads(body)

    studies = get("/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == ["vocab_slicing"]
    detail = get(f"/api/studies/{studies[0]['study_id']}")
    assert len(detail["trials"]) == 4
    assert {a["key"] for a in detail["trials"][0]["user_attrs"]} >= {
        "status",
        "result_path",
        "peak_memory_bytes",
    }
    assert detail["objective_names"] == ["peak_memory_bytes", "tokens_per_s", "eval_loss"]


def test_failure_rate_cap_aborts_with_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"faults": {str(i): "raise" for i in range(10)}}))
    rc = sweep(
        tmp_path,
        "adapter.r=range(1,100)",
        "hydra.sweeper.n_trials=10",
        "hydra.sweeper.study_name=f1",
        "hydra.sweeper.max_failure_rate=0.5",
        "hydra.sweeper.min_trials_for_failure_rate=3",
    )
    out = capsys.readouterr().out
    assert rc == 1 and "ABORTED" in out
    study = load(tmp_path, "f1")
    states = [t.state for t in study.trials]
    assert states.count(TrialState.FAIL) == 3 and states.count(TrialState.WAITING) == 7
    assert study.trials[0].user_attrs["reason"].startswith("RuntimeError: injected failure")


def test_duplicate_points_are_not_rerun(tmp_path, capsys):
    """A random sampler over 6 points re-proposes measured ones: each copy takes the earlier outcome (the
    sampler learns it) without running, and does not count: the study measures all 6 points."""
    rc = sweep(
        tmp_path,
        "quant=none,nf4,nf4_dq",
        "adapter.r=4,8",
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.sampler={name: random, seed: 0}",
        "hydra.sweeper.study_name=d1",
    )
    assert rc == 0
    study = load(tmp_path, "d1")
    dups = [t for t in study.trials if "duplicate_of" in t.user_attrs]
    ran = [t for t in study.trials if "duplicate_of" not in t.user_attrs]
    assert dups, "six draws of a random sampler over six points repeat some"
    assert len(ran) == 6 and len({tuple(sorted(t.params.items())) for t in ran}) == 6
    res = results(tmp_path, "d1")
    for t in dups:
        src = study.trials[t.user_attrs["duplicate_of"]]
        assert t.params == src.params and t.values == src.values
        assert res[t.number]["meta"]["duplicate_of"] == src.number and res[t.number]["meta"]["wall_s"] == 0.0
    assert "6 ok" in capsys.readouterr().out  # the summary counts measured points only


def test_launcher_isolation_runs_trials_as_hydra_jobs(tmp_path):
    """``isolation=launcher`` hands batches of n_jobs trials to Hydra's launcher (basic here, submitit on
    a cluster); each job runs the trial spec and writes the result JSON next to the study."""
    rc = sweep(
        tmp_path,
        "adapter.r=4,8,16",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.isolation=launcher",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.study_name=l1",
    )
    assert rc == 0
    study = load(tmp_path, "l1")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    assert sorted(results(tmp_path, "l1")) == [0, 1, 2]
    jobs = tmp_path / "sweeps" / "l1" / "jobs"
    assert (jobs / "0000.spec.json").exists() and (jobs / "2" / ".hydra" / "overrides.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "sweeps").iterdir()) == ["l1"]  # no stray default folder


def test_a_hydra_launcher_on_the_command_line_means_launcher_mode():
    """``hydra/launcher=submitit_slurm`` alone hands trials to that launcher; an explicit isolation wins
    (and says the launcher is not used); Hydra's basic launcher never switches."""
    from vramsweep.sweeper.launch import BASIC_LAUNCHER, choose_isolation

    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert choose_isolation("fork", slurm, ["hydra/launcher=submitit_slurm"]) == ("launcher", None)
    iso, note = choose_isolation(
        "spawn", slurm, ["hydra/launcher=submitit_slurm", "hydra.sweeper.isolation=spawn"]
    )
    assert iso == "spawn" and "SlurmLauncher" in note and "not used" in note
    assert choose_isolation("fork", BASIC_LAUNCHER, []) == ("fork", None)
    assert choose_isolation("launcher", BASIC_LAUNCHER, ["hydra.sweeper.isolation=launcher"]) == (
        "launcher",
        None,
    )


def test_the_sweeper_process_never_imports_torch(tmp_path):
    """CUDA can only be initialised where torch is imported: trials do it in their own processes."""
    import subprocess
    import sys

    code = (
        "import sys; from vramsweep.sweeper import run_multirun; "
        f"rc = run_multirun({[f'results_dir={tmp_path}', *FAKE, 'adapter.r=4,8', 'hydra.sweeper.study_name=t0']!r}); "
        "print('RC', rc, 'TORCH', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "RC 0 TORCH False" in out, out


def test_a_bad_optimizer_keyword_is_refused_once_before_any_trial_without_torch(tmp_path):
    """A bad ``optimizer.kwargs`` failed every trial on its own (exit 1, one result JSON each): the sweep's
    parent now refuses it once, exit 2, naming the key, with no trial run and torch still not imported
    (the class's ``__init__`` is read from source)."""
    import subprocess
    import sys

    args = [
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=4,8",
        "+optimizer.kwargs.foo=1",
        "hydra.sweeper.study_name=o1",
    ]
    code = (
        "import sys; from vramsweep.sweeper import run_multirun; "
        f"rc = run_multirun({args!r}); "
        "print('RC', rc, 'TORCH', 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RC 2 TORCH False" in p.stdout, p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "AdamW takes no keyword 'foo' (optimizer.kwargs.foo)" in errors[0], p.stderr
    assert not list(tmp_path.rglob("*.json")), sorted(tmp_path.rglob("*"))


def test_local_workers_share_one_sqlite_study(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"sleep_s": 0.6}))
    rc = sweep(
        tmp_path,
        "train.lr=tag(log,interval(1e-5,1e-2))",
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.n_jobs=3",
        "hydra.sweeper.study_name=j1",
    )
    assert rc == 0
    trials = load(tmp_path, "j1").trials
    assert len(trials) == 6 and all(t.state == TrialState.COMPLETE for t in trials)
    spans = [(t.datetime_start, t.datetime_complete) for t in trials]
    overlapping = sum(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])
    assert overlapping >= 2, "trials ran concurrently"


def test_sweep_json_records_every_setting(tmp_path):
    """``sweep.json`` holds every ``hydra.sweeper.*`` setting (each :class:`SweeperConf` field), given ones
    with their typed value, derived ones (``DERIVED``) as resolved; it used to leave out 13 of them."""
    from dataclasses import fields

    from vramsweep.sweeper.plan import DERIVED
    from vramsweep.sweeper.settings import SweeperConf

    given = {"retry_stale": 1, "heartbeat_s": 5.0, "grace_s": 60.0, "dedup": False, "share_below": 0.8}
    args = [f"hydra.sweeper.{k}={str(v).lower()}" for k, v in given.items()]
    assert (
        sweep(tmp_path, "adapter.r=4,8", "hydra.sweeper.study_name=every", "hydra.sweeper.n_jobs=1", *args)
        == 0
    )
    info = json.loads((tmp_path / "sweeps" / "every" / "sweep.json").read_text())
    missing = [f.name for f in fields(SweeperConf) if f.name not in info]
    assert not missing, f"sweep.json leaves out {missing}"
    assert {k: info[k] for k in given} == given
    assert info["preload"] == ["fakes"] and info["trials_per_gpu"] == "auto" and info["progress"] is True
    assert info["n_jobs"] == 1 and info["study_name"] == "every" and set(DERIVED) <= set(info)


def test_a_new_setting_is_recorded_without_another_edit():
    """The record is read off the dataclass: a field added to :class:`SweeperConf` is in ``sweep.json`` with
    no edit of ``Plan.public_dict`` (here a subclass with one more field stands in for the new setting)."""
    from dataclasses import dataclass, replace

    from vramsweep.sweeper.plan import compose_sweep, pinned_plan
    from vramsweep.sweeper.settings import SweeperConf

    @dataclass
    class Newer(SweeperConf):
        new_setting_of_a_test: str = "fast"

    sweeper, task, args = compose_sweep(["adapter.r=4,8"])
    plan, _ = pinned_plan(sweeper, task, args)
    newer = replace(plan, conf=Newer(**{k: getattr(plan.conf, k) for k in SweeperConf.__dataclass_fields__}))
    assert newer.public_dict()["new_setting_of_a_test"] == "fast"
    assert "new_setting_of_a_test" not in plan.public_dict()


def test_the_settings_are_resolved_once_per_run(tmp_path, monkeypatch, capsys):
    """One plan build per run: the finished-study fast path reads the same draft plan the validated path
    completes (it used to resolve the settings twice: once for the fast path, once for the sweep)."""
    from vramsweep.sweeper import plan as plan_mod

    calls = []
    resolve = plan_mod.resolve_settings
    monkeypatch.setattr(plan_mod, "resolve_settings", lambda *a, **k: calls.append(1) or resolve(*a, **k))
    args = ["adapter.r=4,8", "hydra.sweeper.study_name=once"]
    assert sweep(tmp_path, *args) == 0
    assert len(calls) == 1
    assert sweep(tmp_path, *args) == 0  # complete: the fast path's summary
    assert len(calls) == 2 and "is complete" in capsys.readouterr().out
