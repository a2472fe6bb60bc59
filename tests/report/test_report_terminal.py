"""What ``vramsweep report`` prints: the columns that answer the question, within 120
characters, columns without information left out with a note; ``ablation.md``/``.csv`` keep everything."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from _reports import result, write_sweep
from vramsweep.report import build_report, load_sweep, run_report
from vramsweep.report.terminal import WIDTH, terminal_view, uninformative

pytestmark = pytest.mark.torchfree

BASE = ["quant=none", "adapter=lora", "optimizer=adamw", "checkpointing=off", "attention=sdpa"]
#: the demo sweep's factors, and what each does to (peak GiB, tokens/s, eval loss, fact acc)
FACTORS = {
    "quant=nf4": (0.94, 0.8, 0.02, -0.01),
    "adapter=rslora": (1.0, 1.0, -0.014, 0.0),
    "optimizer=adamw_8bit": (0.97, 0.95, 0.001, 0.005),
    "checkpointing=on": (0.46, 0.7, 0.0, 0.0),
    "attention=eager": (1.18, 0.9, 0.0005, -0.002),
}


def demo_like(folder: Path) -> Path:
    """Baseline + 5 one-knob changes, 2 seeds each, with every metric a real demo trial records:
    ``task_score`` 0.0 in every trial and ``mfu`` null (CPU) — the columns with no information."""
    rows, n = [], 0
    points = [("baseline", [], (1.0, 1.0, 0.0, 0.0))] + [(k, [k], v) for k, v in FACTORS.items()]
    for seed in (0, 1):
        for role, change, (pk, tp, dl, da) in points:
            over = list(BASE)
            for c in change:
                key = c.split("=")[0]
                over = [o for o in over if not o.startswith(key + "=")] + [c]
            r = result(
                n,
                over + [f"train.seed={seed}"],
                peak=0.12 * pk,
                tps=(4400 + 37 * seed) * tp,
                loss=3.648 + dl + 0.001 * seed,
                design={
                    "kind": "ablation",
                    "role": "baseline" if role == "baseline" else "factor",
                    "change": change,
                    "repeat": seed,
                },
            )
            m = r["metrics"]
            m.update(
                task_score=0.0,
                mfu=None,
                fact_token_acc=0.21 + da + 0.003 * seed,
                fact_nll=3.88 - da + 0.01 * seed,
                control_token_acc=0.87 + 0.001 * seed - da / 10,
                control_nll=0.49 + dl,
                eval_ppl=38.4,
            )
            rows.append(r)
            n += 1
    return write_sweep(
        folder,
        rows,
        design="ablation",
        baseline=BASE,
        factors=[[k] for k in FACTORS],
        budget_gib=16,
    )


def test_demo_report_fits_120_columns_and_names_what_it_left_out(tmp_path: Path, capsys) -> None:
    folder = demo_like(tmp_path / "demo")
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    too_wide = [ln for ln in lines if len(ln) > WIDTH]
    assert not too_wide, "\n".join(too_wide)
    table = [ln for ln in lines if ln.startswith("|")]
    header = table[0]
    # the columns that answer the question, with their noise marks
    for col in ("change", "Δ mem %", "Δ tok/s %", "Δ eval loss", "Δ fact_token_acc"):
        assert col in header, (col, header)
    assert any(ln.startswith("| checkpointing=on") and ("*" in ln or "~" in ln) for ln in table)
    # no-information columns are left out, with one note line saying so
    assert "task score" not in header and "mfu" not in header
    note = [ln for ln in lines if "Left out (no information)" in ln]
    assert len(note) == 1 and "task_score (0 in every row)" in note[0]
    assert "ablation.md / ablation.csv" in out
    # the files keep every column
    md = (folder / "ablation.md").read_text()
    ab_md = md.split("## One-factor ablation", 1)[1].split("\n## ", 1)[0]
    assert "Δ task score" in ab_md and "Δ control_nll" in ab_md  # headers: the registry's labels
    with open(folder / "ablation.csv") as fh:
        ab = [r for r in csv.DictReader(fh) if r["table"] == "ablation"]
    assert "d_task_score" in ab[1] and "se_fact_nll" in ab[1]


def test_narrow_terminal_drops_standard_errors_then_columns_then_clips_labels(tmp_path: Path) -> None:
    folder = demo_like(tmp_path / "demo")
    report = build_report(load_sweep(str(folder)))
    main = report.main
    assert uninformative(main) == {"task_score": "0 in every row"}
    text, notes = terminal_view(main, width=120)
    assert max(len(ln) for ln in text.splitlines()) <= 120 and " ± " in text
    text, notes = terminal_view(main, width=80)
    assert max(len(ln) for ln in text.splitlines()) <= 80
    assert " ± " not in text and "Standard errors left out to fit the terminal." in notes
    text, notes = terminal_view(main, width=50)
    assert "Δ mem %" in text.splitlines()[0] and "Δ fact_token_acc" not in text.splitlines()[0]
    assert any("Δ fact_token_acc" in n for n in notes)


def test_trials_table_of_a_grid_drops_empty_columns(tmp_path: Path, capsys) -> None:
    rows = [
        result(i, [f"adapter.r={r}", f"quant={q}"], peak=0.1 + i / 100, tps=1000 + i, loss=3 - i / 10)
        for i, (r, q) in enumerate([(8, "none"), (8, "nf4"), (16, "none"), (16, "nf4")])
    ]
    for r in rows:
        r["metrics"]["task_score"] = None
    folder = write_sweep(tmp_path / "grid", rows, design="grid")
    assert run_report(str(folder)) == 0
    out = capsys.readouterr().out
    assert all(len(ln) <= WIDTH for ln in out.splitlines())
    header = next(ln for ln in out.splitlines() if ln.startswith("| trial"))
    assert "task" not in header and "peak GiB" in header
    assert "task_score (null in every row)" in out


def test_pick_prints_candidates_within_120_columns_and_keeps_every_column_in_its_file(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """``vramsweep pick``'s candidates table was ~130 characters wide with a task-score column that was
    empty in every row: on screen the empty column and then the derived ``ppl`` go (one note says so and
    where every column is); production.md keeps them all."""
    from _reports import _conf_copy
    from vramsweep.report import run_pick

    conf = _conf_copy(tmp_path, monkeypatch)
    knobs = ["quant=nf4_dq adapter=rslora", "quant=none adapter=dora", "quant=fp4 adapter=full"]
    res = [
        result(
            i,
            [f"{k.split()[0]}", k.split()[1], "optimizer=paged_adamw_8bit"],
            peak=10.0 + i,
            tps=500 + i,
            loss=1.5 + i / 100,
        )
        for i, k in enumerate(knobs)
    ]
    folder = write_sweep(tmp_path / "sw", res, budget_gib=16)
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= WIDTH, out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert "task score" not in table[0] and "ppl" not in table[0]
    assert "quant=nf4_dq adapter=rslora" in out or "…" in table[2]  # clipped only past 120 columns
    note = next(line for line in out.splitlines() if line.startswith("Left out (no information):"))
    assert "task_score (null in every row)" in note and "Every column:" in note and "production.md" in out
    prod = (folder / "production.md").read_text()
    assert "task score" in prod and "ppl" in prod


def test_pick_names_an_ablation_point_by_its_change(tmp_path: Path, monkeypatch, capsys) -> None:
    """An ablation's candidates are named by what they change (``checkpointing=on``), not by every
    knob of the sweep, which clipped them to ``quant=none …`` on the terminal."""
    from _reports import _conf_copy
    from vramsweep.report import run_pick

    conf = _conf_copy(tmp_path, monkeypatch)
    base = ["quant=none", "adapter=lora", "optimizer=adamw", "attention=sdpa", "checkpointing=off"]
    points = [
        ([], {"kind": "ablation", "role": "baseline", "change": [], "repeat": 0}),
        (
            ["checkpointing=on"],
            {"kind": "ablation", "role": "factor", "change": ["checkpointing=on"], "repeat": 0},
        ),
        (
            ["checkpointing=on"],
            {"kind": "ablation", "role": "factor", "change": ["checkpointing=on"], "repeat": 1},
        ),
        (["quant=nf4"], {"kind": "ablation", "role": "factor", "change": ["quant=nf4"], "repeat": 0}),
    ]
    res = []
    for i, (change, design) in enumerate(points):
        over = [o for o in base if o.split("=")[0] not in {c.split("=")[0] for c in change}] + change
        res.append(
            result(i, [*over, f"train.seed={design['repeat']}"], peak=1 + i, tps=100, loss=1.0, design=design)
        )
    folder = write_sweep(tmp_path / "sw", res, budget_gib=16, design="ablation")
    assert run_pick(str(folder), budget_gib=16, conf_dir=str(conf)) == 0
    rows = {
        line.split("|")[2].strip(): line.split("|")[3].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("|") and line.split("|")[1].strip().isdigit()
    }
    # seed repeats are one candidate (before: "checkpointing=on (seed 1)" was a row, and a choice, of its own)
    assert rows == {"0": "(baseline)", "1, 2": "checkpointing=on", "3": "quant=nf4"}
