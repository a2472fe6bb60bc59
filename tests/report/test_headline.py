"""The registry's ``headline`` flag is the one list of default metric columns: a new metric flagged
``headline=True`` shows in every table, the terminal summary, the W&B trials table and pick's views."""

from __future__ import annotations

from pathlib import Path

from _reports import ablation_results, write_sweep
from vramsweep.record import metrics as registry
from vramsweep.record.metrics import view_metrics
from vramsweep.report.load import load_sweep
from vramsweep.report.pick import _winner_metrics, candidates, candidates_table
from vramsweep.report.tables import ablation_table, aggregate, base_specs, compared_metrics, trials_table
from vramsweep.report.terminal import headline
from vramsweep.report.wandb_summary import trial_rows


def test_the_headline_is_what_the_views_showed_before_the_flag():
    """The default columns did not move when the six hand lists became the flag (W&B: registry order)."""
    assert view_metrics() == ("peak_memory_bytes", "tokens_per_s", "eval_loss")
    assert view_metrics("trials") == (*view_metrics(), "eval_ppl", "task_score")
    assert view_metrics("pick") == view_metrics("trials")
    assert headline() == ("peak_gib", "tokens_per_s", "eval_loss", "fact_token_acc")
    assert view_metrics("wandb") == (
        "peak_memory_bytes",
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "eval_loss",
        "eval_ppl",
        "task_score",
    )


def test_a_new_headline_metric_is_one_flag(tmp_path: Path, monkeypatch) -> None:
    new = registry.Metric(
        "grad_norm", "", "minimize", core=False, doc="test", label="grad norm", headline=True
    )
    monkeypatch.setattr(registry, "METRICS", (*registry.METRICS, new))
    monkeypatch.setattr(registry, "BY_NAME", {**registry.BY_NAME, "grad_norm": new})
    res = ablation_results(with_meta=True)
    for r in res:
        if r["status"] == "ok":
            r["metrics"]["grad_norm"] = 0.5 + r["trial"]
    sweep = load_sweep(str(write_sweep(tmp_path / "sw", res)))

    assert "grad_norm" in {s.metric for s in base_specs()} and "grad_norm" in {
        s.metric for s in compared_metrics(sweep)
    }
    abl = ablation_table(sweep)
    assert abl is not None and "grad_norm" in {c.metric for c in abl.columns}
    assert "grad norm" in [c.header for c in trials_table(sweep).columns]
    assert "grad_norm_mean" in aggregate([t for t in sweep.trials if t.ok])
    assert "grad_norm" in headline()
    assert "grad_norm" in trial_rows(sweep)[0]
    ranked = candidates(sweep, [t for t in sweep.trials if t.ok])
    table = candidates_table(sweep, ranked, 16.0)
    assert "grad norm" in [c.header for c in table.columns] and "grad_norm" in _winner_metrics()
    assert any(row.get("grad_norm") is not None for row in table.rows)
