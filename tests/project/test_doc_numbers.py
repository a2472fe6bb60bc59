"""Figures and lists cited in README, docs/ and the shipped configs match what their named source says:
the bad-input table's size, each group's options, the demo's worked example, the estimator's output."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from vramsweep.config import compose, list_options

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem + "_for_docs", ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_doc_counts_the_bad_input_cases_the_test_table_holds():
    text = (ROOT / "docs" / "CLI.md").read_text()
    m = re.search(r"`tests/cli/test_bad_inputs\.py`\s+holds (\d+) such cases", text)
    assert m, "docs/CLI.md no longer cites the bad-input table's size"
    cases = _module("tests/cli/test_bad_inputs.py").CASES
    assert int(m.group(1)) == len(cases), f"docs/CLI.md says {m.group(1)}, the table holds {len(cases)}"


def _knobs_rows() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "docs" / "KNOBS.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| (.*?) \|", line)
        if m and m.group(1) not in rows:
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.mark.parametrize(
    "group",
    [
        "model",
        "quant",
        "optimizer",
        "attention",
        "kernels",
        "checkpointing",
        "tiling",
        "rope",
        "vocab",
        "data",
        "hardware",
        "logger",
        "adapter",
    ],
)
def test_knobs_doc_row_names_every_option_of_its_group(group):
    row = _knobs_rows()[group]
    named = set(re.findall(r"`(\w+)`", row))
    missing = set(list_options(group)) - named
    assert not missing, f"docs/KNOBS.md's {group} row lacks {sorted(missing)}"


def _train_yaml_lists() -> dict[str, set[str]]:
    out = {}
    for line in (ROOT / "conf" / "train.yaml").read_text().splitlines():
        m = re.match(r"\s+- (\w+): \S+\s+# (.*)", line)
        if not m:
            continue
        text = re.sub(r"\([^)]*\)", "", m.group(2))  # examples in brackets are not options
        if "|" in text:
            out[m.group(1)] = {re.match(r"\s*([\w]+)", part).group(1) for part in text.split("|")}
    return out


def test_train_yaml_option_lists_are_the_option_files():
    lists = _train_yaml_lists()
    assert {"quant", "optimizer", "data", "hardware"} <= set(lists)
    for group, names in lists.items():
        assert names == set(list_options(group)), f"conf/train.yaml's {group} comment lists {sorted(names)}"


def test_readme_demo_headline_matches_its_worked_example_table():
    table = {
        m.group(1).strip(): m.group(2)
        for m in re.finditer(r"^\| (\w+=\w+)\s+\| \d/\d\s+\|\s+([+-]\d+\.\d) ±", README, re.M)
    }
    row = next(ln for ln in README.splitlines() if ln.startswith("| Demo sweep: what each knob does"))
    cited = re.findall(r"`(\w+=\w+)` ([−+-]\d+\.\d) %", row)
    assert len(cited) >= 4
    for knob, value in cited:
        assert float(value.replace("−", "-")) == float(table[knob]), (
            f"{knob}: headline {value}, table {table[knob]}"
        )


def test_demo_sweep_file_cites_readmes_idle_time():
    demo = (ROOT / "sweeps" / "demo.yaml").read_text()
    idle = re.search(r"took ([\d.]+) s on 2 idle cores", demo)
    busy = re.search(r"and ([\d.]+) s beside a 2-thread matmul job", demo)
    assert idle and f"**{idle.group(1)} s** on the idle machine" in README
    assert busy and f"**{busy.group(1)} s** beside one job doing 2-thread matmuls" in README


def test_readme_qwen3_8b_20k_estimates_are_what_the_estimator_says():
    from vramsweep.estimate import estimate

    row = next(ln for ln in README.splitlines() if ln.startswith("| Qwen3-8B at 20,000 tokens"))
    command = re.search(r"`vramsweep estimate ([^`]*)`", row).group(1).split()
    first = re.search(r"\*\*([\d.]+) GiB required", row).group(1)
    liger = re.search(r"kernels=liger`: ([\d.]+) GiB required", row).group(1)
    for overrides, cited in ((command, first), ([*command, "train.micro_batch=1", "kernels=liger"], liger)):
        got = estimate(compose(overrides, rules="config"))["required_bytes"] / 2**30
        decimals = len(cited.split(".")[1])
        assert round(got, decimals) == float(cited), f"{overrides}: README {cited} GiB, estimator {got:.3f}"


def test_trial_docs_cite_the_measured_sfttrainer_ratio():
    """docs/TRIAL.md and trial.py's docstring justify the own loop with README's measured overhead row."""
    row = next(
        ln for ln in README.splitlines() if ln.startswith("| Our training loop vs a minimal PEFT loop")
    )
    ratio = re.search(r"SFTTrainer / minimal: ([\d.]+)", row).group(1)
    for rel in ("docs/TRIAL.md", "src/vramsweep/trial.py"):
        text = (ROOT / rel).read_text()
        assert "reached only ~0.5" not in text, rel
        assert ratio in text, f"{rel} does not cite SFTTrainer / minimal = {ratio}"
