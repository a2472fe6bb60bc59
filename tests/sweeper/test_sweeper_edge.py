"""``sweep.edge_start``: a search with a memory budget starts at the edge of the budget, and
the points the estimator puts over it are recorded before the first trial (no trial process, not counted
toward ``n_trials``) with their excess as the sampler's constraint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from vramsweep.config import ConfigError
from vramsweep.config.compose import compose
from vramsweep.estimate import estimate
from vramsweep.sweeper import run_multirun
from vramsweep.sweeper.edge import (
    EDGE_ATTR,
    EDGE_K,
    MAX_CANDIDATES,
    FastConfigs,
    candidates,
    pick_edge,
    screen,
)
from vramsweep.sweeper.outcome import CONSTRAINT_KEY
from vramsweep.sweeper.plan import edge_start_setting
from vramsweep.sweeper.settings import EDGE_DEFAULTS, SweepConfig
from vramsweep.sweeper.space import merge_overrides, params_to_overrides, parse_params, space_size
from vramsweep.sweeper.storage import SCREENED, SLOT

FAKE = ["hydra.sweeper.trial_fn=fakes:fake_trial", "hydra.sweeper.preload=[fakes]"]
BUDGET = 0.06  # GiB: the estimator puts every checkpointing=off point of the tiny model over it (+10 %)
SPACE = {
    "quant": "none,nf4",
    "adapter.r": "4,16,64",
    "train.lr": "1e-4,3e-4,1e-3,3e-3",
    "checkpointing": "off,on",
}
FIXED = [f"hardware.budget_gib={BUDGET}", "train.steps=4"]
EDGE_ON = ["+sweep.edge_start=true"]  # the start is an option (EDGE_DEFAULTS)


def _real_required(point: dict, dims: list) -> float:
    cfg = compose(merge_overrides(FIXED, params_to_overrides(point, dims)), rules="none")
    return float(estimate(cfg)["required_bytes"])


def test_edge_points_fit_and_sit_at_the_edge_of_the_budget():
    dims, _ = parse_params(SPACE)
    found = screen(FIXED, dims, seed=0)
    assert found.estimated == 48 and found.fits > 0  # a 48-point space is estimated whole
    fast = FastConfigs(FIXED, dims)
    ratios = {}
    for p in candidates(dims, 0, 64):
        est = estimate(fast.config(p))
        ratios[repr(sorted(p.items()))] = est["required_bytes"] / est["budget_bytes"]
    best_fit = max(r for r in ratios.values() if r <= 1.1)  # inside the budget + the pre-flight's margin
    assert len(found.edge) == EDGE_K
    budget = BUDGET * 2**30
    for point in found.edge:  # inside the budget, at its edge
        est = estimate(fast.config(point))
        assert est["required_bytes"] <= 1.1 * budget and est["required_bytes"] == pytest.approx(
            best_fit * budget
        )
    assert _real_required(found.edge[0], dims) == pytest.approx(best_fit * budget)  # and from a real compose
    # the highest fitting peak has four learning rates: the start spans them (diverse in the other knobs)
    assert sorted(p["train.lr"] for p in found.edge) == [1e-4, 3e-4, 1e-3, 3e-3]
    # every point over the budget by more than the pre-flight margin is recorded, no other
    over = sorted(r for r in ratios.values() if r > 1.1)
    assert sorted(e["required_bytes"] / e["budget_bytes"] for _, e, _ in found.infeasible) == pytest.approx(
        over
    )


def test_the_fast_configs_estimate_what_a_real_compose_estimates():
    dims, _ = parse_params({"quant": "none,nf4_dq", "adapter": "lora,rslora", "checkpointing": "off,on"})
    fixed = [*FIXED, "adapter.r=32", "quant.compute_dtype=fp16"]  # refixed after the group is swapped
    fast = FastConfigs(fixed, dims)
    points = candidates(dims, 0, 16)
    assert len(points) == 8
    for p in points[3], points[4]:  # every knob differs between these two (and from the base config)
        real = compose(merge_overrides(fixed, params_to_overrides(p, dims)), rules="none")
        cfg = fast.config(p)
        assert cfg.adapter.r == 32 and cfg.quant.compute_dtype == "fp16" and cfg.quant.name == p["quant"]
        assert estimate(cfg)["required_bytes"] == estimate(real)["required_bytes"], p


def test_pick_edge_prefers_the_highest_peak_then_points_that_differ():
    dims, _ = parse_params({"a": "1,2", "b": "x,y"})
    fitting = [({"a": 1, "b": "x"}, 0.99), ({"a": 1, "b": "y"}, 0.99), ({"a": 2, "b": "x"}, 0.5)]
    assert pick_edge(fitting, dims, 2) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}]
    # a near-tie loses to a point that differs in more knobs
    fitting = [({"a": 1, "b": "x"}, 0.99), ({"a": 1, "b": "x2"}, 0.985), ({"a": 2, "b": "y"}, 0.98)]
    dims, _ = parse_params({"a": "1,2", "b": "x,x2,y"})
    assert pick_edge(fitting, dims, 2)[1] == {"a": 2, "b": "y"}


def test_a_409600_point_space_is_screened_in_bounded_time():
    space = {
        "quant": "none,int8,nf4,nf4_dq",
        "checkpointing": "off,on",
        "optimizer": "adamw,adamw_8bit",
        "attention": "sdpa,eager",
        "adapter.r": "range(1,101)",
        "train.micro_batch": "1,2,4,8",
        "train.lr": "1e-5,1e-4,1e-3,1e-2",
        "context.max_tokens": "64,128,256,512,1024,2048,4096,8192",
    }
    dims, _ = parse_params(space)
    assert space_size(dims) == 409_600
    t0 = time.perf_counter()
    points = candidates(dims, 0, MAX_CANDIDATES)
    assert len(points) == MAX_CANDIDATES and time.perf_counter() - t0 < 1.0  # drawn, never enumerated
    t0 = time.perf_counter()
    found = screen(FIXED, dims, seed=0, time_s=0.5)
    took = time.perf_counter() - t0
    assert found.estimated < MAX_CANDIDATES and "stopped after 0.5 CPU s" in found.note
    assert (
        took < 20
    )  # one base compose, <= 0.5 CPU s of estimates, <= 2k checking composes (a loaded machine)
    assert found.edge and found.infeasible


def test_edge_screen_defaults_on_only_for_a_search_with_preflight_and_a_budget():
    on = SweepConfig.from_dict({"preflight": True})
    assert edge_start_setting(on, "search", 0.06, key="edge_screen") is True
    assert edge_start_setting(on, "search", 0.0, key="edge_screen") is False  # no budget: no wall to learn
    assert edge_start_setting(on, "grid", 0.06, key="edge_screen") is False
    assert edge_start_setting(SweepConfig.from_dict({}), "search", 0.06, key="edge_screen") is False
    off = SweepConfig.from_dict({"preflight": True, "edge_screen": False})
    assert edge_start_setting(off, "search", 0.06, key="edge_screen") is False
    with pytest.raises(ConfigError, match="sweep.edge_screen=true needs a search design and a memory budget"):
        edge_start_setting(SweepConfig.from_dict({"edge_screen": True}), "grid", 0.06, key="edge_screen")
    with pytest.raises(ConfigError, match="sweep.edge_screen='yes' must be true, false or null"):
        SweepConfig.from_dict({"edge_screen": "yes"})


def test_edge_start_is_an_option_off_by_default():
    """bench/sweep_efficiency.py (docs/SWEEPS.md): over three landscapes the start paid on one only; the screen
    is the default, the start is asked for."""
    assert EDGE_DEFAULTS == {"edge_screen": True, "edge_start": False}
    assert edge_start_setting(SweepConfig.from_dict({"preflight": True}), "search", 0.06) is False
    assert edge_start_setting(SweepConfig.from_dict({"edge_start": True}), "search", 0.06) is True
    off = SweepConfig.from_dict({"preflight": True, "edge_start": False})
    assert edge_start_setting(off, "search", 0.06) is False
    with pytest.raises(ConfigError, match="sweep.edge_start=true needs a search design and a memory budget"):
        edge_start_setting(SweepConfig.from_dict({"edge_start": True}), "grid", 0.06)
    with pytest.raises(ConfigError, match="sweep.edge_start='yes' must be true, false or null"):
        SweepConfig.from_dict({"edge_start": "yes"})


def test_the_default_search_with_preflight_screens_and_leaves_every_slot_to_the_sampler(tmp_path, capsys):
    """What runs by default (preflight + budget, neither key set): the screen records the points over the
    budget before the first trial; no slot is fixed to an edge point."""
    assert _sweep(tmp_path, "ed", "hydra.sweeper.n_trials=3") == 0
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "vramsweep: edge screen: 16 of 16 points estimated" in out and "no edge start" in out
    study = _study(tmp_path, "ed")
    assert sum(bool(t.system_attrs.get(SCREENED)) for t in study.trials) == 8
    assert study.user_attrs[EDGE_ATTR]["points"] == []
    assert "study total: 3 ok" in out
    for (
        t
    ) in study.trials:  # a slot is fixed only to copy a re-proposed point's outcome, never to an edge point
        if SLOT in t.system_attrs and "fixed_params" in t.system_attrs:
            res = json.loads((tmp_path / "sweeps/ed/trials" / f"{t.number:04d}.json").read_text())
            assert res["meta"].get("duplicate_of") is not None, t.number
    plan = json.loads((tmp_path / "sweeps/ed/sweep.json").read_text())
    assert plan["edge_screen"] is True and plan["edge_start"] is False


def test_the_start_alone_records_nothing_unrun(tmp_path, capsys):
    assert (
        _sweep(
            tmp_path, "es", "hydra.sweeper.n_trials=2", "+sweep.edge_start=true", "+sweep.edge_screen=false"
        )
        == 0
    )
    capsys.readouterr()
    study = _study(tmp_path, "es")
    assert not any(t.system_attrs.get(SCREENED) for t in study.trials)
    edge = study.user_attrs[EDGE_ATTR]["points"]
    run = sorted((t for t in study.trials if SLOT in t.system_attrs), key=lambda t: t.number)
    assert len(edge) == EDGE_K and [t.params for t in run] == edge[:2]


def _sweep(tmp_path: Path, name: str, *args: str) -> int:
    return run_multirun(
        [
            f"results_dir={tmp_path}",
            *FAKE,
            "quant=none,nf4",
            "adapter.r=4,64",
            "train.lr=1e-3,3e-3",
            "checkpointing=off,on",
            *FIXED,
            "hydra.sweeper.sampler={name: tpe, seed: 1}",
            "+sweep.preflight=true",
            f"hydra.sweeper.study_name={name}",
            *args,
        ]
    )


def _study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/sweeps/{name}/study.db")


def _first_run(tmp_path: Path, monkeypatch, capsys, name: str) -> tuple[optuna.Study, str, Path]:
    markers = tmp_path / "m"
    monkeypatch.setenv("VRAMSWEEP_FAKE", json.dumps({"marker_dir": str(markers)}))
    assert _sweep(tmp_path, name, "hydra.sweeper.n_trials=3", *EDGE_ON) == 0
    cap = capsys.readouterr()
    return _study(tmp_path, name), cap.out + cap.err, markers


def test_screened_points_cost_no_trial_and_are_not_counted(tmp_path, monkeypatch, capsys):
    study, out, markers = _first_run(tmp_path, monkeypatch, capsys, "e1")
    assert "vramsweep: edge screen: 16 of 16 points estimated" in out and "4 near its edge run first" in out
    screened = [t for t in study.trials if t.system_attrs.get(SCREENED)]
    assert len(screened) == 8  # every checkpointing=off point: over 0.06 GiB (+10 %) by the estimate
    started = {int(p.name.split("-")[1]) for p in markers.glob("start-*")}
    assert len(started) == 3 and not started & {t.number for t in screened}  # no process for a screened point
    for t in screened:
        res = json.loads((tmp_path / "sweeps/e1/trials" / f"{t.number:04d}.json").read_text())
        assert (
            t.state == TrialState.PRUNED and t.params["checkpointing"] == "off" and SLOT not in t.system_attrs
        )
        assert res["status"] == t.user_attrs["status"] == "infeasible_estimate" and res["meta"]["screened"]
        excess = res["estimate"]["peak_memory_bytes"] / 2**30 - BUDGET
        assert t.constraints[CONSTRAINT_KEY] == pytest.approx(excess) and excess > 0  # what TPE reads
    edge = study.user_attrs[EDGE_ATTR]["points"]
    run = sorted((t for t in study.trials if SLOT in t.system_attrs), key=lambda t: t.number)
    assert [t.params for t in run] == edge[:3]  # the first slots run the edge points, in order
    assert all(t.state == TrialState.COMPLETE for t in run)
    assert "study total: 3 ok" in out  # screened points are not counted toward n_trials
    assert json.loads((tmp_path / "sweeps/e1/sweep.json").read_text())["edge_start"] is True


@pytest.mark.slow
def test_an_edge_start_sweep_resumes_exactly(tmp_path, monkeypatch, capsys):
    study, _, markers = _first_run(tmp_path, monkeypatch, capsys, "e2")
    edge = study.user_attrs[EDGE_ATTR]["points"]
    # a larger n_trials runs exactly the remainder: slot 3 gets edge point 3, nothing is screened again
    assert _sweep(tmp_path, "e2", "hydra.sweeper.n_trials=5", *EDGE_ON) == 0
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "edge screen:" not in out and "resuming study 'e2': 3/5 finished" in out
    study = _study(tmp_path, "e2")
    assert sum(bool(t.system_attrs.get(SCREENED)) for t in study.trials) == 8
    slot3 = next(t for t in study.trials if t.system_attrs.get(SLOT) == 3)
    assert slot3.params == edge[3] and study.user_attrs[EDGE_ATTR]["points"] == edge
    assert len(list(markers.glob("start-*"))) == 5
    assert _sweep(tmp_path, "e2", "hydra.sweeper.n_trials=5", *EDGE_ON) == 0  # complete: nothing runs
    assert len(list(markers.glob("start-*"))) == 5


def test_edge_screen_and_start_false_is_the_plain_preflight_search(tmp_path, capsys):
    assert (
        _sweep(
            tmp_path, "e0", "hydra.sweeper.n_trials=2", "+sweep.edge_start=false", "+sweep.edge_screen=false"
        )
        == 0
    )
    cap = capsys.readouterr()
    assert "edge screen" not in cap.out + cap.err
    study = _study(tmp_path, "e0")
    assert EDGE_ATTR not in study.user_attrs
    assert len(study.trials) == 2 and all(SLOT in t.system_attrs for t in study.trials)
    assert not any("fixed_params" in t.system_attrs or t.system_attrs.get(SCREENED) for t in study.trials)


class _Killed(BaseException):
    """Stands for kill -9: nothing after it runs in this process."""


def test_an_edge_screen_cut_by_a_kill_completes_on_the_next_start_as_if_uncut(tmp_path, monkeypatch, capsys):
    """Before: a kill during the screen left the unrecorded points never screened; they later took trial
    slots an uninterrupted sweep would not give them."""
    import vramsweep.sweeper.edge as edge

    monkeypatch.setenv("VRAMSWEEP_FAKE", "{}")
    assert _sweep(tmp_path / "whole", "ek", "hydra.sweeper.n_trials=3") == 0
    real, calls = edge.record_screened, []

    def dies_on_the_fourth(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise _Killed
        return real(*a, **k)

    monkeypatch.setattr(edge, "record_screened", dies_on_the_fourth)
    with pytest.raises(_Killed):
        _sweep(tmp_path / "cut", "ek", "hydra.sweeper.n_trials=3")
    cut = _study(tmp_path / "cut", "ek")
    assert sum(bool(t.system_attrs.get(SCREENED)) for t in cut.trials) == 3  # 3 of 8 recorded, then killed
    monkeypatch.setattr(edge, "record_screened", real)
    assert _sweep(tmp_path / "cut", "ek", "hydra.sweeper.n_trials=3") == 0
    capsys.readouterr()

    def trials(study):
        return [(t.number, t.params, t.state, bool(t.system_attrs.get(SCREENED))) for t in study.trials]

    whole, cut = _study(tmp_path / "whole", "ek"), _study(tmp_path / "cut", "ek")
    assert trials(cut) == trials(whole)
    assert sum(s for *_, s in trials(cut)) == 8
    assert sorted(p.name for p in (tmp_path / "cut/sweeps/ek/trials").glob("*.json")) == sorted(
        p.name for p in (tmp_path / "whole/sweeps/ek/trials").glob("*.json")
    )
