"""Held-out metrics rank only over one eval set (issue 50, bug 4): ``report`` and ``pick`` compare eval losses
of trials with one ``meta.eval_set`` fingerprint, and refuse (naming the knob) when the fingerprints differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _reports import _conf_copy, cells, result, write_sweep
from vramsweep.report import build_report, load_sweep, run_pick, run_report

pytestmark = pytest.mark.torchfree

CHAT = ["data=grant_chat", "context.max_tokens=512"]


def _res(
    n: int, overrides: list[str], fp: str, *, loss: float, peak: float, tps: float, design: dict
) -> dict:
    r = result(n, overrides, peak=peak, tps=tps, loss=loss, design=design)
    r["meta"]["eval_set"] = {"fingerprint": fp, "examples": 4, "scored_tokens": 321, "train_on": "assistant"}
    return r


def _ablation(tmp_path: Path, points: list[tuple[list[str], str, float]]) -> Path:
    """Baseline (two seeds) + one factor per point: (change, fingerprint, eval loss), two seeds each."""
    results, n = [], 0
    for change, fp, loss in [([], "a" * 16, 2.0), *points]:
        for seed in (0, 1):
            role = "factor" if change else "baseline"
            design = {"kind": "ablation", "role": role, "change": change, "repeat": seed}
            over = [*CHAT, *change, f"train.seed={seed}"]
            results.append(
                _res(n, over, fp, loss=loss + 0.01 * seed, peak=10.0 - n, tps=100.0 + n, design=design)
            )
            n += 1
    factors = [p[0] for p in points]
    return write_sweep(
        tmp_path / "sw", results, design="ablation", baseline=CHAT, factors=factors, budget_gib=16
    )


def test_a_sweep_over_train_on_with_one_eval_set_ranks(tmp_path, monkeypatch, capsys):
    """data.train_on=assistant|last_assistant|all, every trial scoring one eval set (one fingerprint): the
    ablation compares eval losses, the best table names the best, pick ranks on them."""
    conf = _conf_copy(tmp_path, monkeypatch)
    folder = _ablation(
        tmp_path,
        [(["data.train_on=last_assistant"], "a" * 16, 1.5), (["data.train_on=all"], "a" * 16, 2.5)],
    )
    report = build_report(load_sweep(str(folder)), importances=False)
    rows = cells(report.tables["ablation"])
    assert rows[1]["Δ eval loss"].startswith("-0.5000 ± ") and rows[2]["Δ eval loss"].startswith("+0.5000 ± ")
    assert not any("n/c" in note for note in report.tables["ablation"].notes)
    best = {r["objective"]: r for r in report.tables["best"].rows}["eval_loss"]
    assert best["trial"] == 2 and "data.train_on=last_assistant" in best["knobs"]
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 0
    assert capsys.readouterr().out.startswith("Picked trial 0002 of syn")


def test_differing_eval_sets_are_refused_with_the_knob_named(tmp_path, monkeypatch, capsys):
    """A factor that changed the scored held-out tokens (context.max_tokens cut the eval records: another
    fingerprint) gets no eval-loss Δ (n/c, the note names context.max_tokens), no best eval loss, no
    importances, and pick --prefer quality refuses with the knob named; --prefer speed still picks, without
    breaking ties on eval loss. Before, its lower loss was ranked best."""
    conf = _conf_copy(tmp_path, monkeypatch)
    folder = _ablation(
        tmp_path,
        [(["data.train_on=all"], "a" * 16, 2.5), (["context.max_tokens=256"], "b" * 16, 1.0)],
    )
    report = build_report(load_sweep(str(folder)))
    table = report.tables["ablation"]
    rows = cells(table)
    assert rows[1]["Δ eval loss"].startswith("+0.5000 ± ")  # train_on: the same eval set, compared
    assert rows[2]["Δ eval loss"] == "n/c" and rows[2]["Δ mem GiB"].startswith("-4.0000")  # memory still is
    note = next(n for n in table.notes if n.startswith("n/c"))
    assert (
        "made different by context.max_tokens (512 | 256)" in note and "aaaaaaaa: trials 0, 1, 2, 3" in note
    )
    best = {r["objective"]: r for r in report.tables["best"].rows}
    assert best["eval_loss"]["trial"] is None
    assert best["eval_loss"]["noise"].startswith("not ranked: the trials scored different held-out tokens")
    assert "context.max_tokens" in best["eval_loss"]["noise"]
    assert best["peak_memory_bytes"]["trial"] == 5
    assert "eval_loss left out" in report.tables["best"].intro
    imp_notes = report.importances.notes
    assert any(n.startswith("eval_loss: skipped, the trials scored different") for n in imp_notes)

    capsys.readouterr()
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    assert "best eval_loss: not ranked: the trials scored different held-out tokens" in " ".join(out.split())
    assert "Pareto front (feasible; peak_memory_bytes min, tokens_per_s max): trial 0005" in out

    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "vramsweep pick: error: --prefer quality: the trials scored different held-out tokens"
    )
    assert "made different by context.max_tokens (512 | 256)" in err and "nothing written" in err
    assert not (conf / "experiment").exists()
    assert run_pick(str(folder), budget_gib=16, prefer="speed", conf_dir=str(conf)) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Picked trial 0004 of syn") and "eval loss breaks no tie" in out.err


def test_results_without_a_fingerprint_are_not_checked(tmp_path):
    """Older results (no meta.eval_set) rank as before."""
    folder = _ablation(tmp_path, [(["context.max_tokens=256"], "b" * 16, 1.0)])
    for p in (folder / "trials").glob("*.json"):
        p.write_text(p.read_text().replace('"eval_set"', '"eval_set_old"'))
    best = {
        r["objective"]: r
        for r in build_report(load_sweep(str(folder)), importances=False).tables["best"].rows
    }
    assert best["eval_loss"]["trial"] == 2


def test_a_trial_that_could_not_score_the_reference_is_left_out_of_the_rankings(
    tmp_path, monkeypatch, capsys
):
    """A sweep over data.train_on scores one reference held-out set (one fingerprint: compared and ranked);
    a factor with a context too short for the reference (meta.eval_set.comparable: false) scored its own
    held-out tokens: its eval-loss Δ is n/c with the trials and why named, it ranks nowhere on eval loss (its
    lower loss is not best), and pick leaves it out with a note, ranking the others. Before, its other
    fingerprint stopped every eval-loss ranking of the sweep."""
    conf = _conf_copy(tmp_path, monkeypatch)
    folder = _ablation(
        tmp_path,
        [(["data.train_on=last_assistant"], "a" * 16, 1.5), (["context.max_tokens=128"], "b" * 16, 1.0)],
    )
    why = (
        "context.max_tokens=128 is shorter than the reference's held-out examples (up to 497 tokens at the "
        "sweep baseline's context.max_tokens=512)"
    )
    for n in (4, 5):
        p = folder / "trials" / f"{n:04d}.json"
        r = json.loads(p.read_text())
        r["meta"]["eval_set"] |= {"comparable": False, "not_comparable": why}
        p.write_text(json.dumps(r))
    report = build_report(load_sweep(str(folder)))
    table = report.tables["ablation"]
    rows = cells(table)
    assert rows[1]["Δ eval loss"].startswith("-0.5000 ± ")  # train_on: one reference, compared
    assert rows[2]["Δ eval loss"] == "n/c" and rows[2]["Δ mem GiB"].startswith("-4.0000")
    note = next(n for n in table.notes if n.startswith("n/c"))
    assert f"not comparable with the sweep's reference held-out examples: trial 4 ({why}); trial 5" in note
    best = {r["objective"]: r for r in report.tables["best"].rows}
    assert best["eval_loss"]["trial"] == 2 and "data.train_on=last_assistant" in best["eval_loss"]["knobs"]
    assert "not comparable with the sweep's reference: trial 4" in report.tables["best"].intro
    assert any(n.startswith("eval_loss: left out, not comparable") for n in report.importances.notes)
    capsys.readouterr()
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Picked trial 0002 of syn")
    assert (
        f"note: left out of the ranking, not comparable with the sweep's reference held-out examples: trial 4 ({why})"
        in " ".join(out.err.split())
    )
