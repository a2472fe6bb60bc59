"""Markdown table of the task-quality metrics of a sweep, mean ± std over seed repeats per design point.

    python bench/quality_table.py results/sweeps/truncation_quality

One row per design point (the ablation's baseline and each factor, or each distinct override set), with
the number of seeds, ``fact_token_acc``, ``fact_nll``, ``control_token_acc``, ``control_nll`` and
``task_score`` as ``mean ± std`` (sample std over the seeds; ``-`` when not measured).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("fact_token_acc", "fact_nll", "control_token_acc", "control_nll", "task_score")


def _point(res: dict) -> str:
    design = res.get("meta", {}).get("design") or {}
    if design.get("kind") == "ablation":
        return "baseline" if design.get("role") == "baseline" else " ".join(design.get("change") or [])
    return " ".join(o for o in res.get("overrides", []) if not o.startswith(("train.seed=", "results_dir=")))


def _fmt(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}"


def table(sweep_dir: str | Path) -> str:
    rows: dict[str, dict[str, list]] = {}
    for p in sorted(Path(sweep_dir, "trials").glob("*.json")):
        res = json.loads(p.read_text())
        if res.get("status") != "ok":
            continue
        r = rows.setdefault(_point(res), {k: [] for k in KEYS})
        for k in KEYS:
            r[k].append(res["metrics"].get(k))
    head = "| point | seeds | " + " | ".join(KEYS) + " |\n|" + " --- |" * (len(KEYS) + 2) + "\n"
    return head + "".join(
        f"| {name} | {len(r['fact_token_acc'])} | " + " | ".join(_fmt(r[k]) for k in KEYS) + " |\n"
        for name, r in rows.items()
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/quality_table.py <sweep folder with trials/*.json>")
    print(table(sys.argv[1]), end="")
