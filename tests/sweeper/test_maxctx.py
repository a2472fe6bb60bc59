"""sweep.design=max_context: estimator prediction, then real (here: fake or tiny) trials confirm the boundary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vramsweep.sweeper import run_multirun

TESTS = Path(__file__).resolve().parents[1]
BUDGET = 0.03 * 2**30


@pytest.fixture()
def fake_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _run(tmp_path, *extra):
    return run_multirun(
        [
            "sweep=max_context_tiny",
            f"results_dir={tmp_path}",
            "hydra.sweeper.trial_fn=_maxctx_fake:trial",
            "hydra.sweeper.isolation=inprocess",
            *extra,
        ]
    )


def test_max_context_search_is_right_by_construction(tmp_path, fake_on_path, capsys):
    from _maxctx_fake import peak_for

    assert _run(tmp_path) == 0
    folder = tmp_path / "sweeps" / "max_context_tiny"
    data = json.loads((folder / "max_context.json").read_text())
    rows = data["rows"]
    assert [r["config"] for r in rows] == [
        "checkpointing=off",
        "checkpointing=on tiling=on tiling.loss_chunk_tokens=64 tiling.mlp_tile_tokens=64",
    ]
    for r in rows:
        over = r["overrides"]
        best, nxt = r["max_tokens"], r["next_tokens"]
        assert peak_for(best, over) <= BUDGET < peak_for(best + 64, over)  # the true boundary on the grid
        assert nxt == best + 64 and r["confirmed"] is True
        assert r["probes"] <= 12  # exponential steps + bisection, not a scan of 64 lengths
        assert r["predicted_tokens"] > 0 and r["tokens_per_s"] > 0
    # the checkpointed config reaches further (its fake peak grows 4x slower)
    assert rows[1]["max_tokens"] > rows[0]["max_tokens"]
    md = (folder / "max_context.md").read_text()
    assert "Max context per config" in md and f"{rows[0]['max_tokens']:,}" in md
    assert (folder / "max_context.csv").read_text().startswith("config,predicted_tokens,max_tokens")
    trials = sorted((folder / "trials").glob("*.json"))
    assert len(trials) == sum(r["probes"] for r in rows)
    assert "results: " in capsys.readouterr().out
    # a re-run reuses every measured probe: no new trial
    assert _run(tmp_path) == 0
    assert sorted((folder / "trials").glob("*.json")) == trials


def test_max_context_bad_bounds_exit_2_and_write_nothing(tmp_path, fake_on_path, capsys):
    assert _run(tmp_path, "sweep.max_context.step=0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("vramsweep train: error:") and "step" in err[-1]
    assert not (tmp_path / "sweeps").exists()


@pytest.mark.slow
def test_max_context_tiny_real_trials(tmp_path, embedded_model_dir):
    """Real tiny-model trials on random tokens (CPU tracker peak vs a 30 MiB budget)."""
    rc = run_multirun(
        ["sweep=max_context_tiny", f"results_dir={tmp_path}", "hydra.sweeper.isolation=inprocess"]
    )
    assert rc == 0
    folder = tmp_path / "sweeps" / "max_context_tiny"
    rows = json.loads((folder / "max_context.json").read_text())["rows"]
    results = [json.loads(p.read_text()) for p in (folder / "trials").glob("*.json")]
    by_len = {}
    for res in results:
        tokens = res["meta"]["max_context_probe"]["tokens"]
        by_len[(tuple(o for o in res["overrides"] if not o.startswith("context.max_tokens=")), tokens)] = res
    for r in rows:
        assert r["confirmed"], r
        key = tuple(r["overrides"])
        fit = by_len[(key, r["max_tokens"])]
        over = by_len[(key, r["next_tokens"])]
        assert fit["status"] == "ok" and fit["metrics"]["peak_memory_bytes"] <= BUDGET
        assert over["status"] == "oom" or over["metrics"]["peak_memory_bytes"] > BUDGET
        # random tokens: every training sequence is exactly the probed length
        assert fit["metrics"]["tokens_trained"] == fit["metrics"]["measured_steps"] * r["max_tokens"]
    assert rows[1]["max_tokens"] > rows[0]["max_tokens"]  # tiling + checkpointing reach further


def test_max_context_reads_the_typed_settings(tmp_path, fake_on_path):
    """max-context reads ``hydra.sweeper`` through the main driver's typed :class:`SweeperConf`: a node that
    leaves keys out gets the declared defaults, a value is normalised and an unknown key is refused."""
    from vramsweep.config.compose import ConfigError
    from vramsweep.sweeper.maxctx import plan_max_context
    from vramsweep.sweeper.plan import compose_sweep
    from vramsweep.sweeper.settings import SweeperConf

    sweeper, task, args = compose_sweep(["sweep=max_context_tiny", f"results_dir={tmp_path}"])
    plan = plan_max_context({"timeout_s": 5, "study_name": "mc"}, task, args)
    assert isinstance(plan.conf, SweeperConf) and plan.name == "mc"
    assert plan.conf.timeout_s == 5.0 and isinstance(plan.conf.timeout_s, float)
    assert plan.conf.isolation == SweeperConf.isolation and plan.conf.trial_fn == SweeperConf.trial_fn
    with pytest.raises(ConfigError, match="hydra.sweeper.bogus"):
        plan_max_context({"bogus": 1}, task, args)
