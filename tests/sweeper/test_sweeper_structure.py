"""The sweeper reads as parts with one job each: a loop (:class:`Sweep`) over a study book, a worker pool
and a run state — no mixins sharing ``self`` — every function at most 80 lines
(``test_contract_usage.test_no_function_in_src_over_80_lines``), and the ``sweep:`` node parsed by one
typed :class:`SweepConfig` whose fields are the keys a sweep file may set."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

SRC = Path(__file__).resolve().parents[2] / "src" / "vramsweep"
SWEEPER = SRC / "sweeper"


@pytest.mark.torchfree
def test_no_mixins_in_the_sweeper():
    """No class is a mixin or mixes several sweeper classes (a runner may implement the runner interface),
    and the loop (:class:`Sweep`) inherits from nothing."""
    own = set()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(SWEEPER.glob("*.py"))}
    for tree in trees.values():
        own |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    bad = [
        f"{p.name}:{n.lineno} {n.name}"
        for p, tree in trees.items()
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        and (
            "Mixin" in n.name
            or sum(isinstance(b, ast.Name) and b.id in own for b in n.bases) > 1
            or (n.name == "Sweep" and n.bases)
        )
    ]
    assert not bad, bad


def test_sweep_is_composed_of_book_pool_and_state(tmp_path):
    from vramsweep.sweeper.engine import Sweep, plan_from_args
    from vramsweep.sweeper.study import StudyBook
    from vramsweep.sweeper.workers import RunState

    plan = plan_from_args(
        [f"results_dir={tmp_path}", "adapter.r=4,8", "hydra.sweeper.trial_fn=fakes:fake_trial"]
    )
    sweep = Sweep(plan, runner=object())
    assert isinstance(sweep.book, StudyBook) and isinstance(sweep.state, RunState)
    assert sweep.book.plan is plan and sweep.book.study is None  # opened by run()
    assert not (tmp_path / "sweeps").exists()  # constructing writes nothing


@pytest.mark.torchfree
def test_sweep_config_fields_cover_every_packaged_sweep_file():
    from vramsweep.config.paths import packaged_sweeps_dir
    from vramsweep.sweeper.settings import SweepConfig

    files = sorted(packaged_sweeps_dir().glob("*.yaml"))
    assert files
    for f in files:
        node = (yaml.safe_load(f.read_text()) or {}).get("sweep") or {}
        SweepConfig.from_dict(node)  # raises on a key the dataclass lacks
        assert set(node) <= set(SweepConfig.__dataclass_fields__), f.name


@pytest.mark.parametrize(
    ("node", "key"),
    [
        ({"desing": "ablation"}, "sweep.desing"),
        ({"repeats": 0}, "sweep.repeats"),
        ({"repeats": "3"}, "sweep.repeats"),
        ({"factors": 5}, "sweep.factors"),
    ],
)
@pytest.mark.torchfree
def test_sweep_config_names_the_bad_key(node, key):
    from vramsweep.config.compose import ConfigError
    from vramsweep.sweeper.settings import SweepConfig

    with pytest.raises(ConfigError) as err:
        SweepConfig.from_dict(node)
    assert err.value.key == key


@pytest.mark.torchfree
def test_sweep_config_typed_values():
    from vramsweep.sweeper.settings import SweepConfig

    sc = SweepConfig.from_dict(
        {"name": "x", "factors": [["quant=nf4"], "adapter.r=8"], "stack": "kernels=liger"}
    )
    assert sc.factors == [["quant=nf4"], ["adapter.r=8"]] and sc.stack == ["kernels=liger"]
    assert sc.repeats is None and sc.preflight is False and sc.design is None


def test_a_sweeper_setting_is_one_field_read_through_the_plan(tmp_path):
    """A ``hydra.sweeper.*`` key is declared once (its ``SweeperConf`` field, with its rule) and the plan
    reads it through from the checked conf; a value derived from a setting (normalised URL, folder, ...) has
    its own name (``DERIVED``, a fixed short list: no Plan field shadows a setting), and the setting's name
    on a plan is refused, so a new setting needs no second declaration."""
    from dataclasses import fields

    from vramsweep.sweeper.engine import plan_from_args
    from vramsweep.sweeper.plan import DERIVED, Plan
    from vramsweep.sweeper.settings import SweeperConf

    conf_keys = {f.name for f in fields(SweeperConf)}
    plan_keys = {f.name for f in fields(Plan)}
    assert not conf_keys & plan_keys, "a Plan field shadows a setting"
    assert set(DERIVED) == {
        *("n_jobs", "storage", "study_name", "sampler", "pruner", "params", "sweep_dir", "objectives"),
    }
    assert set(DERIVED.values()) <= plan_keys
    derived = set(DERIVED)
    assert all("rule" in f.metadata for f in fields(SweeperConf))
    doc = SweeperConf.__doc__ or ""
    assert all(f"    {k}:" in doc for k in conf_keys), "every setting has its docstring line"
    plan = plan_from_args(
        [
            f"results_dir={tmp_path}",
            "adapter.r=4,8",
            "hydra.sweeper.retry_stale=5",
            "hydra.sweeper.grace_s=70",
        ]
    )
    for k in conf_keys - derived:
        assert getattr(plan, k) == getattr(plan.conf, k), k
    assert (plan.retry_stale, plan.grace_s) == (5, 70.0)
    with pytest.raises(AttributeError, match="no attribute 'not_a_setting'"):
        _ = plan.not_a_setting
    for k, name in DERIVED.items():
        with pytest.raises(AttributeError, match=f"plan.{name} .resolved. or plan.conf.{k}"):
            getattr(plan, k)
