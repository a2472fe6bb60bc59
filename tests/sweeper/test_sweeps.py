"""Every shipped sweep file composes, and every value of its search space / design validates.

Like lightning-hydra-template's ``test_sweeps.py``: each ``sweeps/<name>.yaml`` (shipped) is planned exactly as
``vramsweep train -m sweep=<name>`` would (compose + every choice value composed and range-checked +
every ablation/stacking point rule-checked), without running trials. ``-m slow`` runs the demo for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramsweep.config.compose import packaged_sweeps_dir
from vramsweep.sweeper.engine import plan_from_args

ROOT = Path(__file__).resolve().parents[2]
SWEEP_DIR = packaged_sweeps_dir()
SWEEPS = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))
REQUIRED = {
    "demo",
    "quant",
    "adapter_rank",
    "optimizer",
    "attention_kernels",
    "checkpointing_context",
    "accumulation_vs_batch",
    "production_16gb",
    "context_ladder",
    "vocab_slicing",
}


@pytest.mark.torchfree
def test_the_studies_ship():
    assert REQUIRED <= set(SWEEPS)
    assert SWEEP_DIR == ROOT / "sweeps"  # the repository's top level (a wheel ships a copy: test_packaging)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_composes_and_validates(name):
    text = (SWEEP_DIR / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    assert f"vramsweep train -m sweep={name}" in text.split("defaults:")[0]  # the launch command, up top
    if "design: max_context" in text:  # its own driver: every config composed, rule-checked and predicted
        from vramsweep.sweeper.engine import compose_sweep
        from vramsweep.sweeper.maxctx import plan_max_context

        mplan = plan_max_context(*compose_sweep([f"sweep={name}"]))
        assert mplan.name == name and mplan.budget_bytes > 0 and len(mplan.configs) >= 2
        assert all(lo_pred > 0 for _, _, lo_pred in mplan.configs)
        return
    plan = plan_from_args([f"sweep={name}"])
    assert plan.name == name and plan.study_key == name
    assert plan.folder == (Path("results") / "sweeps" / name).resolve()
    assert plan.n_total >= 2 and plan.goals
    if plan.design in ("ablation", "stacking", "grid"):
        assert plan.points is not None and len(plan.points) == plan.n_total
    else:
        assert plan.dims and plan.n_total >= 10


@pytest.mark.slow
def test_real_trial_injected_oom_is_recorded_oom(tmp_path, embedded_model_dir, monkeypatch):
    """The real trial's own OOM hook (``VRAMSWEEP_FAULT=oom@1``) through the sweeper: status oom,
    Optuna PRUNED with a positive budget constraint (infeasible, never best)."""
    import optuna

    from vramsweep.sweeper import run_multirun

    monkeypatch.setenv("VRAMSWEEP_FAULT", "oom@1")
    rc = run_multirun(
        [
            f"results_dir={tmp_path}",
            "quant=choice(none)",
            "hydra.sweeper.sampler=grid",
            "hydra.sweeper.study_name=oom",
            "train.steps=3",
            "train.measure_warmup_steps=1",
            "data.num_docs=4",
            "data.num_eval_docs=1",
            "context.max_tokens=128",
        ]
    )
    assert rc == 0
    study = optuna.load_study(study_name="oom", storage=f"sqlite:///{tmp_path}/sweeps/oom/study.db")
    t = study.trials[0]
    assert t.user_attrs["status"] == "oom" and t.state == optuna.trial.TrialState.PRUNED
    assert t.constraints["vram_over_budget_gib"] > 0
