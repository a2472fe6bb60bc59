"""The sweep's eval reference (issue 50, wanted 5): the sweeper records the baseline's chat template,
thinking switch and context length in ``sweep.json``, where every trial of the sweep reads them
(``vramsweep.data.reference``)."""

from __future__ import annotations

from types import SimpleNamespace

from vramsweep.data.reference import REFERENCE_KEYS
from vramsweep.sweeper.plan import compose_sweep, eval_reference, plan_sweep


def _plan(tmp_path, *args: str):
    return plan_sweep(*compose_sweep([*args, f"results_dir={tmp_path}"]))


def test_the_plan_records_the_baselines_reference(tmp_path):
    """grant_chat's base (its sweep file sets context.max_tokens=384) is the reference of its ablation; a
    command-line override of the base moves it."""
    plan = _plan(tmp_path, "sweep=grant_chat")
    assert plan.eval_reference == {
        "data.chat_template": None,
        "data.enable_thinking": False,
        "context.max_tokens": 384,
    }
    assert plan.public_dict()["eval_reference"] == plan.eval_reference  # what sweep.json holds
    assert set(plan.eval_reference) == set(REFERENCE_KEYS)
    pinned = _plan(tmp_path, "sweep=grant_chat", "context.max_tokens=300", "data.enable_thinking=true")
    assert (
        pinned.eval_reference["context.max_tokens"] == 300 and pinned.eval_reference["data.enable_thinking"]
    )
    # a grid or search has no baseline: its base, at the shortest context of its space (every trial fits it)
    grid = _plan(tmp_path, "data=grant_chat", "context.max_tokens=384,256", "data.train_on=assistant,all")
    assert grid.eval_reference["context.max_tokens"] == 256
    assert _plan(tmp_path, "data=grant_chat", "data.train_on=assistant,all").eval_reference == {
        "data.chat_template": None,
        "data.enable_thinking": False,
        "context.max_tokens": 512,
    }


def test_an_ablations_baseline_sets_the_reference():
    """The baseline's own override of a reference key wins over the base config's value."""
    base = {"data": {"chat_template": None, "enable_thinking": False}, "context": {"max_tokens": 512}}
    plan = SimpleNamespace(
        design="ablation", baseline=["context.max_tokens=256", "data.chat_template=chatml"]
    )
    assert eval_reference(base, plan, []) == {
        "data.chat_template": "chatml",
        "data.enable_thinking": False,
        "context.max_tokens": 256,
    }
