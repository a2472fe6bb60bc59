"""Known-answer tests for ``vramsweep report`` / ``vramsweep pick`` on synthetic result sets.

Every sweep here is written by the test itself (DESIGN.md §5 result JSONs + ``sweep.json``, built with
``tests/_reports.py``), with numbers chosen so the expected table cells can be worked out by hand; the
arithmetic is in the comments.
"""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from _reports import BASE, _conf_copy, ablation_results, cells, result, write_sweep
from vramsweep.record.units import GIB as G
from vramsweep.report import build_report, load_sweep, run_pick, run_report
from vramsweep.report.pick import default_name, rank_key
from vramsweep.report.plots import pareto_figure

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# report: tables
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_meta", [True, False], ids=["meta-design", "derived-from-sweep-json"])
@pytest.mark.torchfree
def test_ablation_table_known_answers(tmp_path: Path, with_meta: bool) -> None:
    folder = write_sweep(
        tmp_path / "sw",
        ablation_results(with_meta),
        design="ablation",
        baseline=BASE,
        factors=[["quant=nf4"], ["optimizer=adamw_8bit"]],
        budget_gib=15,
    )
    report = build_report(load_sweep(str(folder)), importances=False)
    rows = cells(report.tables["ablation"])
    # baseline peaks 10.0, 10.2 -> mean 10.1, sample std sqrt((0.01+0.01)/1) = 0.1414; tokens/s 1050 ± 70.7
    assert rows[0] == {
        "change": "baseline",
        "n ok": "2/2",
        "peak GiB": "10.1000 ± 0.1414",
        "Δ mem GiB": "",
        "Δ mem %": "",
        "tokens/s": "1050.0 ± 70.7",
        "Δ tok/s %": "",
        "eval loss": "2.1000 ± 0.1414",
        "Δ eval loss": "",
        "trials": "0,1",
    }
    # nf4: 6.1 - 10.1 = -4.0 GiB = -39.6 %; (850 - 1050) / 1050 = -19.0 %; 2.3 - 2.1 = +0.2
    # ± Welch standard error sqrt(s1²/n1 + s2²/n2): memory sqrt(0.02/2 + 0.02/2) = 0.1414, t = -28.3, df 2,
    # p = 0.001 -> * ; tokens/s 70.7 = 6.7 % of 1050, t = -2.83, df 2, p = 0.11 -> ~ ;
    # eval loss sqrt(0 + 0.02/2) = 0.1, t = 2, df 1, p = 0.30 -> ~ (within the seed-to-seed noise)
    assert rows[1] == {
        "change": "quant=nf4",
        "n ok": "2/2",
        "peak GiB": "6.1000 ± 0.1414",
        "Δ mem GiB": "-4.0000 ± 0.1414 *",
        "Δ mem %": "-39.6",
        "tokens/s": "850.0 ± 70.7",
        "Δ tok/s %": "-19.0 ± 6.7 ~",
        "eval loss": "2.3000 ± 0.0000",
        "Δ eval loss": "+0.2000 ± 0.1000 ~",
        "trials": "2,3",
    }
    # 8-bit: one repeat ok (no std), one oom: 9.0 - 10.1 = -1.1 GiB = -10.9 %; (1040-1050)/1050 = -1.0 %
    # one value vs two: Student t with the baseline's variance, se = s·sqrt(1/1 + 1/2), df 1:
    # memory 0.1414·1.2247 = 0.1732, t = -6.35, p = 0.10 -> ~ ; tokens/s 70.7·1.2247 = 86.6 = 8.2 %
    assert rows[2] == {
        "change": "optimizer=adamw_8bit",
        "n ok": "1/2 (1 oom)",
        "peak GiB": "9.0000",
        "Δ mem GiB": "-1.1000 ± 0.1732 ~",
        "Δ mem %": "-10.9",
        "tokens/s": "1040.0",
        "Δ tok/s %": "-1.0 ± 8.2 ~",
        "eval loss": "2.1000",
        "Δ eval loss": "+0.0000 ± 0.1732 ~",
        "trials": "4,5",
    }
    raw = report.tables["ablation"].rows[1]
    assert raw["d_peak_gib"] == pytest.approx(-4.0)
    assert raw["peak_gib_std"] == pytest.approx(0.141421356, rel=1e-6)
    assert raw["eval_loss_std"] == pytest.approx(0.0)
    assert (raw["sig_peak_gib"], raw["sig_tokens_per_s"], raw["sig_eval_loss"]) == (
        "significant",
        "noise",
        "noise",
    )
    assert raw["p_eval_loss"] == pytest.approx(0.2952, abs=1e-4) and raw["test_eval_loss"] == "welch"


def test_report_writes_md_csv_plots_and_prints_main_table(tmp_path: Path, capsys) -> None:
    folder = write_sweep(
        tmp_path / "sw",
        ablation_results(True),
        design="ablation",
        baseline=BASE,
        factors=[["quant=nf4"], ["optimizer=adamw_8bit"]],
        budget_gib=15,
    )
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    assert "## One-factor ablation" in out
    assert "| quant=nf4 " in out and "-39.6" in out
    assert "best eval_loss (minimize): trial 0000 = 2.0000" in out
    for name in (
        "ablation.md",
        "ablation.csv",
        "pareto.png",
        "pareto.svg",
        "memory_breakdown.png",
        "memory_breakdown.svg",
        "importances.png",
        "importances.svg",
    ):
        assert (folder / name).stat().st_size > 0, name
    md = (folder / "ablation.md").read_text()
    for section in (
        "## Best feasible",
        "## One-factor ablation",
        "## Trials",
        "## Failures and infeasible trials",
        "## Estimate error",
        "## Parameter importances",
        "![pareto](pareto.png)",
    ):
        assert section in md, section
    failures = md.split("## Failures and infeasible trials", 1)[1].split("##", 1)[0]
    assert "Trials that cannot be best: 1 oom." in failures and "CUDA out of memory" in failures
    with open(folder / "ablation.csv") as fh:
        rows = list(csv.DictReader(fh))
    ab = [r for r in rows if r["table"] == "ablation"]
    assert [r["change"] for r in ab] == ["baseline", "quant=nf4", "optimizer=adamw_8bit"]
    assert float(ab[1]["d_peak_pct"]) == pytest.approx((6.1 - 10.1) / 10.1 * 100)
    trials = [r for r in rows if r["table"] == "trials"]
    assert [r["status"] for r in trials] == ["ok"] * 5 + ["oom"]
    assert trials[5]["reason"].startswith("CUDA out of memory")


@pytest.mark.torchfree
def test_trials_table_fits_budget_and_failures(tmp_path: Path) -> None:
    # Budget from hardware.budget_gib (no sweep.json budget): 16 GiB.
    res = [
        result(0, ["quant=none"], peak=17.0, tps=500, loss=1.0, budget=16, est=18.7),  # over budget
        result(1, ["quant=nf4"], peak=15.0, tps=400, loss=1.5, budget=16, est=14.25),
        result(
            2, ["quant=nf4_dq"], status="unsupported", reason="quant=nf4_dq needs bitsandbytes", budget=16
        ),
        result(3, ["quant=fp4"], status="pruned", peak=14.0, tps=300, loss=3.0, budget=16),
    ]
    folder = write_sweep(tmp_path / "sw", res)
    sweep = load_sweep(str(folder))
    assert sweep.budget_gib == 16
    report = build_report(sweep, importances=False)
    t = cells(report.tables["trials"])
    assert [r["fits"] for r in t] == ["no", "yes", "no", "no"]
    assert [r["quant"] for r in t] == ["none", "nf4", "nf4_dq", "fp4"]
    # estimate error: (18.7 - 17) / 17 = +10.0 %; (14.25 - 15) / 15 = -5.0 %
    assert [r["est err %"] for r in t] == ["+10.0", "-5.0", "", ""]
    f = cells(report.tables["failures"])
    assert [(r["trial"], r["class"]) for r in f] == [
        ("0", "over_budget"),
        ("2", "unsupported"),
        ("3", "pruned"),
    ]
    assert f[0]["reason"] == "peak 17.0000 GiB > budget 16 GiB"
    assert f[1]["reason"] == "quant=nf4_dq needs bitsandbytes"
    best = {r["objective"]: r for r in cells(report.tables["best"])}
    # Trial 0 has the best loss and throughput but is over budget: never best.
    assert best["eval_loss"]["trial"] == "1" and best["tokens_per_s"]["trial"] == "1"
    est_knob = cells(report.tables["estimate_error_by_knob"])
    assert [(r["value"], r["mean error %"]) for r in est_knob] == [("none", "+10.0"), ("nf4", "-5.0")]


def test_budget_follows_each_trials_hardware(tmp_path: Path) -> None:
    # Like the sweeper's constraint: a trial's recorded hardware.budget_gib wins over sweep.json's
    # (a sweep may vary hardware); 0 means no budget; no recorded budget falls back to sweep.json.
    res = [
        result(0, ["hardware=rtx4080_16gb"], peak=15.5, tps=1, loss=1.0, budget=15),
        result(1, ["hardware=rtx4090_24gb"], peak=15.5, tps=1, loss=1.0, budget=23),
        result(2, ["hardware=cpu"], peak=99.0, tps=1, loss=1.0, budget=0),
        result(3, ["adapter.r=8"], peak=23.5, tps=1, loss=1.0),
    ]
    sweep = load_sweep(str(write_sweep(tmp_path / "sw", res, budget_gib=23)))
    assert [sweep.trial_budget_gib(t) for t in sweep.trials] == [15, 23, None, 23]
    assert [sweep.feasible(t) for t in sweep.trials] == [False, True, True, False]
    assert sweep.budget_gib is None  # no single budget line when trials differ
    assert pareto_figure(sweep).axes[0].get_legend_handles_labels()[1].count("budget 23 GiB") == 0


@pytest.mark.torchfree
def test_stacking_order_and_cumulative_deltas(tmp_path: Path) -> None:
    stack = ["quant=nf4_dq", "optimizer=paged_adamw_8bit", "checkpointing=on"]
    base = ["quant=none", "optimizer=adamw", "checkpointing=off"]

    def d(step: int, added: str | None) -> dict:
        return {"kind": "stacking", "step": step, "added": added, "applied": stack[:step], "repeat": 0}

    # Trial numbers deliberately out of step order (workers finish in any order).
    res = [
        result(
            0,
            ["quant=nf4_dq", "optimizer=paged_adamw_8bit", "checkpointing=off"],
            peak=6.8,
            tps=380,
            loss=2.2,
            design=d(2, stack[1]),
        ),
        result(1, base, peak=20.0, tps=500, loss=2.0, design=d(0, None)),
        result(
            2,
            ["quant=nf4_dq", "optimizer=paged_adamw_8bit", "checkpointing=on"],
            status="oom",
            design=d(3, stack[2]),
        ),
        result(
            3,
            ["quant=nf4_dq", "optimizer=adamw", "checkpointing=off"],
            peak=8.0,
            tps=400,
            loss=2.1,
            design=d(1, stack[0]),
        ),
    ]
    folder = write_sweep(tmp_path / "sw", res, design="stacking", baseline=base, stack=stack)
    rows = cells(build_report(load_sweep(str(folder)), importances=False).tables["stacking"])
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["added"] for r in rows] == [
        "(baseline)",
        "quant=nf4_dq",
        "optimizer=paged_adamw_8bit",
        "checkpointing=on",
    ]
    # step 1: 8 - 20 = -12 GiB = -60.0 %, (400 - 500) / 500 = -20.0 %; single runs: noise unknown (?)
    assert (rows[1]["Δ prev GiB"], rows[1]["Δ prev %"], rows[1]["Δ prev tok/s %"]) == (
        "-12.0000 ?",
        "-60.0",
        "-20.0 ?",
    )
    # step 2: 6.8 - 8 = -1.2 GiB = -15.0 %, (380 - 400) / 400 = -5.0 %; vs start: -66.0 %, -24.0 %
    assert (rows[2]["Δ prev GiB"], rows[2]["Δ prev %"], rows[2]["Δ prev tok/s %"]) == (
        "-1.2000 ?",
        "-15.0",
        "-5.0 ?",
    )
    assert rows[2]["Δ prev eval loss"] == "+0.1000 ?"
    assert (rows[2]["mem vs start %"], rows[2]["tok/s vs start %"]) == ("-66.0", "-24.0")
    # step 3 failed: no numbers, the failure is shown
    assert rows[3]["n ok"] == "0/1 (1 oom)" and rows[3]["peak GiB"] == "" and rows[3]["Δ prev GiB"] == ""
    # The same table derived from sweep.json when the results carry no design meta.
    for r in res:
        r["meta"].pop("design")
    folder2 = write_sweep(tmp_path / "sw2", res, design="stacking", baseline=base, stack=stack)
    rows2 = cells(build_report(load_sweep(str(folder2)), importances=False).tables["stacking"])
    assert [(r["step"], r["peak GiB"], r["trials"]) for r in rows2] == [
        ("0", "20.0000", "1"),
        ("1", "8.0000", "3"),
        ("2", "6.8000", "0"),
        ("3", "", "2"),
    ]


@pytest.mark.torchfree
def test_all_failed_sweep(tmp_path: Path, capsys) -> None:
    res = [
        result(i, [f"adapter.r={r}"], status=s)
        for i, (r, s) in enumerate([(8, "oom"), (16, "error"), (32, "diverged")])
    ]
    folder = write_sweep(tmp_path / "sw", res, budget_gib=16)
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    assert "3 trials (3 diverged" not in out and "3 trials (1 diverged, 1 error, 1 oom)" in out
    md = (folder / "ablation.md").read_text()
    assert "Pareto plot skipped" in md and "peak_memory_bytes: skipped" in md
    assert not (folder / "pareto.png").exists()
    report = build_report(load_sweep(str(folder)), importances=False)
    assert [r["class"] for r in report.tables["failures"].rows] == ["oom", "error", "diverged"]
    assert all(r["trial"] is None for r in report.tables["best"].rows)
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 2
    err = capsys.readouterr().err
    assert "nothing fits 16 GiB" in err and "1 diverged, 1 error, 1 oom" in err
    assert list((conf / "experiment").iterdir()) == [] and not (folder / "production.md").exists()


@pytest.mark.torchfree
def test_single_trial(tmp_path: Path, capsys) -> None:
    folder = write_sweep(
        tmp_path / "sw", [result(0, ["quant=nf4", "adapter.r=16"], peak=1.5, tps=99.5, loss=2.5)]
    )
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    assert "## Trials" in out  # no ablation/stacking: the trials table is the main one
    report = build_report(load_sweep(str(folder)))
    row = cells(report.tables["trials"])[0]
    # Nothing varies: the trial's own overrides are the knob columns.
    assert (row["quant"], row["adapter.r"], row["peak GiB"], row["tokens/s"], row["fits"]) == (
        "nf4",
        "16",
        "1.5000",
        "99.5",
        "n/a",
    )
    assert "importances" not in report.tables
    assert any("tokens_per_s: skipped, 1 complete trial" in n for n in report.notes)


@pytest.mark.torchfree
def test_empty_missing_and_bad_targets(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_report(str(empty)) == 2
    assert "vramsweep report: error: no trial results" in capsys.readouterr().err
    started = write_sweep(tmp_path / "started", [])
    assert run_report(str(started)) == 2
    assert not (started / "ablation.md").exists()
    assert run_report(str(tmp_path / "nope")) == 2
    assert "no such sweep folder" in capsys.readouterr().err
    assert run_report(f"sqlite:///{tmp_path / 'missing.db'}") == 2
    assert not (tmp_path / "missing.db").exists()  # never creates a storage
    conf = tmp_path / "conf"
    conf.mkdir()
    assert run_pick(str(empty), budget_gib=16, conf_dir=str(conf)) == 2
    assert run_pick(str(tmp_path / "nope"), budget_gib=16, conf_dir=str(conf)) == 2
    assert run_pick(str(started), budget_gib=-1, conf_dir=str(conf)) == 2
    assert run_pick(str(started), budget_gib=16, prefer="cheap", conf_dir=str(conf)) == 2
    assert run_pick(str(started), budget_gib=16, headroom_gib=16, conf_dir=str(conf)) == 2
    assert run_pick(str(started), budget_gib=16, name="../evil", conf_dir=str(conf)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--prefer 'cheap' is not known" in err


@pytest.mark.torchfree
def test_tolerates_garbage_files_and_nan(tmp_path: Path) -> None:
    r0 = result(0, ["quant=none"], peak=2.0, tps=10, loss=2.0)
    r0["metrics"]["eval_loss"] = float("nan")  # a foreign writer; JSON allows NaN literals in Python
    folder = write_sweep(tmp_path / "sw", [r0, result(1, ["quant=nf4"], peak=1.0, tps=9, loss=2.1)])
    (folder / "trials" / "0002.json").write_text('{"status": "ok", "trial": 2, ')  # torn write
    (folder / "trials" / ".0003.json.tmp").write_text("x")
    with open(folder / "trials" / "0000.json", "w") as fh:
        json.dump(r0, fh)
    sweep = load_sweep(str(folder))
    assert [t.number for t in sweep.trials] == [0, 1]
    assert sweep.trials[0].eval_loss is None
    assert any("0002.json" in n for n in sweep.notes)
    best = {r["objective"]: r["trial"] for r in build_report(sweep, importances=False).tables["best"].rows}
    assert best == {"peak_memory_bytes": 1, "tokens_per_s": 0, "eval_loss": 1}


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def test_pareto_budget_line_and_front(tmp_path: Path) -> None:
    res = [
        result(0, ["adapter.r=8"], peak=4.0, tps=100, loss=2.0),
        result(1, ["adapter.r=16"], peak=6.0, tps=150, loss=1.9),
        result(
            2, ["adapter.r=32"], peak=7.0, tps=120, loss=1.8
        ),  # dominated on memory/tokens: not on the front
        result(3, ["adapter.r=64"], peak=9.0, tps=300, loss=1.7),  # over the 8 GiB budget: never on the front
    ]
    sweep = load_sweep(str(write_sweep(tmp_path / "sw", res, budget_gib=8)))
    fig = pareto_figure(sweep)
    ax = fig.axes[0]
    vlines = [ln for ln in ax.lines if list(ln.get_xdata()) == [8, 8]]
    assert len(vlines) == 1 and "budget 8 GiB" in vlines[0].get_label()
    front = [ln for ln in ax.lines if ln.get_color() == "tab:red"]
    assert len(front) == 1 and list(front[0].get_xdata()) == [4.0, 6.0]
    assert sorted(t.get_text() for t in ax.texts) == ["#0", "#1"]


# ---------------------------------------------------------------------------------------------
# pick
# ---------------------------------------------------------------------------------------------
def _rec(n: int, loss: float | None, peak: float, tps: float | None):
    from vramsweep.report.load import TrialRecord

    return TrialRecord.from_result(result(n, [], peak=peak, tps=tps, loss=loss))


@pytest.mark.torchfree
def test_rank_ties() -> None:
    a, b, c, d = _rec(3, 1.5, 10, 100), _rec(1, 1.5, 10, 100), _rec(2, 1.5, 9, 50), _rec(0, 1.5, 10, 200)
    # quality: loss tie -> lower memory (2) -> higher tokens/s (0) -> lower trial number (1 before 3)
    assert [t.number for t in sorted([a, b, c, d], key=lambda t: rank_key(t, "quality"))] == [2, 0, 1, 3]
    e, f = _rec(4, 1.4, 10, 200), _rec(5, None, 1, 500)
    # speed: tokens/s first (5), tie at 200 -> lower loss (4 before 0); missing loss ranks last on loss
    assert [t.number for t in sorted([a, d, e, f], key=lambda t: rank_key(t, "speed"))] == [5, 4, 0, 3]
    assert default_name("demo sweep", 15.5) == "demo_sweep_15p5gib" and default_name("q", 16.0) == "q_16gib"


@pytest.mark.torchfree
def test_pick_never_picks_infeasible_and_breaks_ties(tmp_path: Path, monkeypatch, capsys) -> None:
    conf = _conf_copy(tmp_path, monkeypatch)
    res = [
        result(0, ["adapter.r=64"], peak=17.0, tps=900, loss=1.0),  # best loss, over 16 GiB
        result(1, ["adapter.r=32"], peak=15.0, tps=500, loss=1.5),
        result(2, ["adapter.r=16"], peak=14.0, tps=100, loss=1.5),  # same loss, less memory -> quality winner
        result(3, ["adapter.r=8"], status="error", peak=1.0, tps=2000, loss=0.5),  # failed: never eligible
        result(4, ["adapter.r=4"], status="oom"),
    ]
    folder = write_sweep(tmp_path / "sw", res, budget_gib=16)
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 0
    out = capsys.readouterr().out
    assert out.startswith("Picked trial 0002 of syn for 16 GiB (prefer quality)")
    exp = (conf / "experiment" / "syn_16gib.yaml").read_text()
    assert exp.splitlines()[0] == "# @package _global_" and "trial 2 of sweep 'syn'" in exp
    assert "vramsweep train +experiment=syn_16gib" in out
    prod = (folder / "production.md").read_text()
    assert "**Trial 2** won" in prod and "| measured peak | 14.0000 GiB" in prod
    assert "| headroom vs budget | 2.0000 GiB (12.5 %) |" in prod and "| torch | 2.13.0 |" in prod
    # speed: trial 1 (500 tokens/s); with 2 GiB headroom only trial 2 fits (14 <= 14)
    assert run_pick(str(folder), budget_gib=16, prefer="speed", name="fast", conf_dir=str(conf)) == 0
    assert "trial 1 of sweep" in (conf / "experiment" / "fast.yaml").read_text()
    assert (
        run_pick(str(folder), budget_gib=16, prefer="speed", headroom_gib=2, name="h", conf_dir=str(conf))
        == 0
    )
    assert "trial 2 of sweep" in (conf / "experiment" / "h.yaml").read_text()
    # throughput floor: nothing fits -> closest 3: within budget first, ordered by throughput shortfall
    # (1: 500 < 600, 2: 100 < 600), then the smallest excess over the budget (0: 1 GiB over); nothing written
    capsys.readouterr()
    assert run_pick(str(folder), budget_gib=16, min_tokens_per_s=600, name="none", conf_dir=str(conf)) == 2
    err = capsys.readouterr().err
    assert "nothing fits 16 GiB with tokens/s ≥ 600" in err
    lines = [ln for ln in err.splitlines() if ln.startswith("|") and ln.split("|")[1].strip().isdigit()]
    assert [ln.split("|")[1].strip() for ln in lines] == ["1", "2", "0"]
    assert "tokens/s 500.0 < 600" in lines[0] and "tokens/s 100.0 < 600" in lines[1]
    assert "1.0000 GiB over" in lines[2]
    assert not (conf / "experiment" / "none.yaml").exists()


@pytest.mark.torchfree
def test_pick_experiment_composes_to_the_winning_config(tmp_path: Path, monkeypatch, capsys) -> None:
    from omegaconf import OmegaConf

    from vramsweep.config import compose

    conf = _conf_copy(tmp_path, monkeypatch)

    def real(overrides: list[str]) -> dict:
        return OmegaConf.to_container(compose(overrides, rules="none"), resolve=True)

    win = [
        "quant=nf4",
        "adapter=rslora",
        "adapter.r=64",
        "optimizer=adamw_8bit",
        "checkpointing=on",
        "context.max_tokens=1024",
        "train.seed=3",
        "train.lr=0.0005",
        "hardware=rtx4080_16gb",
    ]
    lose = ["quant=none", "checkpointing=off"]
    res = [
        result(0, win, peak=11.0, tps=700, loss=1.9, config=real(win)),
        result(1, lose, peak=14.5, tps=900, loss=2.4, config=real(lose)),
    ]
    folder = write_sweep(tmp_path / "sw", res)
    assert run_pick(str(folder), budget_gib=15, name="prod15", conf_dir=None) == 0  # default: ./conf
    out = capsys.readouterr()
    assert "train it: vramsweep train +experiment=prod15" in out.out and "warning" not in out.err
    text = (conf / "experiment" / "prod15.yaml").read_text()
    assert '  - override /checkpointing: "on"' in text and '  - override /adapter: "rslora"' in text
    got = real(["+experiment=prod15"])
    want = res[0]["config"]
    from vramsweep.config.schema import MEASUREMENT_KEYS
    from vramsweep.report.pick import flatten

    flat_got, flat_want = flatten(got), flatten(want)
    for key in flat_want:
        if key.split(".")[0] not in ("sweep", "results_dir", "name") and key not in MEASUREMENT_KEYS:
            assert flat_got[key] == flat_want[key], key
    # the recipe: knobs and data, not the trial's seed repeat or measurement budget (defaults instead)
    default = real([])
    assert (got["adapter"]["r"], got["context"]["max_tokens"], got["train"]["lr"]) == (64, 1024, 0.0005)
    assert (
        got["train"]["seed"] == default["train"]["seed"]
        and got["train"]["steps"] == default["train"]["steps"]
    )
    assert not re.search(r"^\s+(steps|seed|num_docs):", text, re.M), text


# ---------------------------------------------------------------------------------------------
# storage targets and W&B
# ---------------------------------------------------------------------------------------------
@pytest.mark.torchfree
def test_storage_url_and_study_db_merge(tmp_path: Path, capsys) -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = tmp_path / "sw"
    folder.mkdir()
    url = f"sqlite:///{folder / 'study.db'}"
    st = optuna.create_study(study_name="syn", storage=url, directions=["minimize", "maximize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # set_metric_names is "experimental"
        st.set_metric_names(["peak_memory_bytes", "tokens_per_s"])
    dist = {"quant": CategoricalDistribution(["none", "nf4"])}
    r0 = result(0, ["quant=none"], peak=4.0, tps=100, loss=2.0)
    st.add_trial(
        create_trial(
            params={"quant": "none"}, distributions=dist, values=[4.0 * G, 100.0], user_attrs={"result": r0}
        )
    )
    # no result attr: rebuilt from params + values
    st.add_trial(create_trial(params={"quant": "nf4"}, distributions=dist, values=[2.0 * G, 80.0]))
    st.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params={"quant": "nf4"},
            distributions=dist,
            user_attrs={"status": "oom", "reason": "CUDA out of memory"},
        )
    )
    optuna.create_study(study_name="other", storage=url)

    assert run_report(url) == 2
    assert "several studies" in capsys.readouterr().err
    assert run_report(url, study="nope") == 2
    assert "unknown study 'nope'" in capsys.readouterr().err
    assert run_report(url, study="syn", out_dir=str(tmp_path / "out")) == 0
    sweep = load_sweep(url, study="syn")
    assert [(t.number, t.status, t.knob_value("quant")) for t in sweep.trials] == [
        (0, "ok", "none"),
        (1, "ok", "nf4"),
        (2, "oom", "nf4"),
    ]
    assert sweep.trials[1].peak_gib == 2.0 and sweep.trials[2].reason == "CUDA out of memory"
    assert (tmp_path / "out" / "ablation.md").is_file()
    # Folder with study.db + one result JSON: the other trials come from the study.
    write_sweep(folder, [result(0, ["quant=none"], peak=4.0, tps=100, loss=2.0)], study_name="syn")
    sweep = load_sweep(str(folder))
    assert [t.source for t in sweep.trials] == ["json", "storage", "storage"]
    assert any("2 trial(s) without a result JSON" in n for n in sweep.notes)


def test_wandb_summary_offline_and_failure_is_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # keep $HOME clean
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    folder = write_sweep(
        tmp_path / "sw",
        ablation_results(True),
        design="ablation",
        baseline=BASE,
        factors=[["quant=nf4"], ["optimizer=adamw_8bit"]],
        budget_gib=15,
    )
    assert run_report(str(folder), wandb=True) == 0
    assert "W&B summary run:" in capsys.readouterr().out
    runs = list((folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = {
        p.name.split("_")[0] for p in (runs[0] / "files" / "media" / "table" / "table").glob("*.table.json")
    }
    assert {"ablation", "trials", "failures", "best"} <= tables
    assert list((runs[0] / "files" / "media" / "images" / "plot").glob("pareto_*.png"))

    import wandb

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", boom)
    assert run_report(str(folder), wandb=True) == 0
    assert "warning: W&B summary run not logged: RuntimeError: no W&B today" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# a real sweep (needs the sweeper; the lead wires it into the demo)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_tiny_sweep_report_and_pick(tmp_path: Path, monkeypatch) -> None:
    """The demo sweep for real (CPU, tiny model), then report + pick on its folder."""
    pytest.importorskip("vramsweep.sweeper")
    pytest.importorskip("hydra_plugins.vramsweep_sweeper")
    import subprocess
    import sys

    from vramsweep.config import compose

    monkeypatch.setenv("WANDB_MODE", "disabled")
    results = tmp_path / "results"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from vramsweep.cli import main; sys.exit(main())",
        "train",
        "-m",
        "sweep=demo",
        "hydra.sweeper.n_trials=3",
        f"results_dir={results}",
    ]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=1200)
    folder = results / "sweeps" / "demo"
    assert run_report(str(folder)) == 0
    for name in ("ablation.md", "ablation.csv", "pareto.png", "memory_breakdown.png"):
        assert (folder / name).is_file(), name
    sweep = load_sweep(str(folder))
    assert len(sweep.trials) == 3 and all(t.source == "json" for t in sweep.trials)
    conf = _conf_copy(tmp_path, monkeypatch)
    assert run_pick(str(folder), budget_gib=64, name="real_tiny", conf_dir=str(conf)) == 0
    cfg = compose(["+experiment=real_tiny"], rules="none")
    winner = next(t for t in sweep.trials if f"Trial {t.number}**" in (folder / "production.md").read_text())
    from omegaconf import OmegaConf

    from vramsweep.config.schema import MEASUREMENT_KEYS
    from vramsweep.report.pick import flatten

    got, want = flatten(OmegaConf.to_container(cfg, resolve=True)), flatten(winner.config)
    checked = [k for k in want if k.split(".")[0] in ("quant", "adapter", "optimizer", "context", "train")]
    assert "train.lr" in checked and "adapter.r" in checked
    for key in checked:
        if key not in MEASUREMENT_KEYS:  # the recipe is pinned; the trial's measurement budget is not
            assert got[key] == want[key], key
    default = compose([], rules="none")
    assert want["train.steps"] == 8 and got["train.steps"] == default.train.steps
