"""What ships: the docs the source cites exist, and a non-editable install runs from another folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cited_docs_exist():
    """A docstring that says "see DESIGN.md §5" sends the reader to a file this repository does not have."""
    missing = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for doc in re.findall(r"\b((?:[\w.-]+/)*[A-Z][\w-]*\.md)\b", line):
                if not (ROOT / doc).is_file() and not (ROOT / "docs" / doc).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {doc}")
    assert not missing, "\n".join(missing)


@pytest.mark.slow
def test_non_editable_install_trains_and_picks_from_another_folder(
    tmp_path: Path, embedded_model_dir
) -> None:
    """``pip install .`` (a wheel, not editable) ships conf/ and sweeps/: from a user's project folder
    with its own ``./conf``, a config and a shipped sweep compose, a real trial runs, ``report`` reads it,
    ``pick`` writes ``./conf/experiment/`` (not into the installed package) and the experiment composes
    back."""
    from _user_conf import user_conf
    from conftest import FAST

    src = tmp_path / "src_copy"  # build outside the checkout (no build/ or egg-info left in it)
    src.mkdir()
    for name in ("src", "conf", "sweeps"):  # the code and the config's source of truth (top-level folders)
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name)
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(src)],
        check=True,
        timeout=600,
    )
    assert not (site / "vramsweep" / "conf" / "experiment").exists()
    assert (site / "vramsweep" / "conf" / "train.yaml").is_file()
    assert (site / "vramsweep" / "sweeps" / "demo.yaml").is_file()  # top-level sweeps/, shipped in the wheel
    assert (site / "vramsweep" / "assets" / "embedded" / "model.safetensors").is_file()  # the committed base
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VRAMSWEEP_CONFIG_DIR")}
    env |= {"PYTHONPATH": str(site), "WANDB_MODE": "disabled"}
    project = tmp_path / "project"
    user_conf(project / "conf")  # hardware=mine, sweep=mine

    def run(*args: str) -> str:
        proc = subprocess.run(
            [str(site / "bin" / "vramsweep"), *args],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (
            f"vramsweep {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
        return proc.stdout

    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vramsweep, hydra_plugins.vramsweep_sweeper as h; print(vramsweep.__file__, h.__file__)",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(w).is_relative_to(site) for w in where), where  # not the checkout's editable copy
    check = subprocess.run(
        [sys.executable, "-m", "vramsweep.embedded", "--check-asset"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0 and str(site) in check.stdout, (check.stdout, check.stderr)

    out = run("train", "--cfg", "job", "hardware=mine")  # a single trial's config, from ./conf
    assert "name: mine" in out and "budget_gib: 7" in out
    out = run("train", "--cfg", "job", "sweep=quant")  # a shipped sweep file, from the wheel's sweeps/
    assert "name: quant" in out and "design: ablation" in out
    # one real trial on the embedded model (a sweep's, so that pick has a sweep folder to read)
    run("train", "-m", "sweep=mine", *FAST, "hydra.sweeper.n_trials=1", "hydra.sweeper.isolation=inprocess")
    sweep = project / "results" / "sweeps" / "mine"
    trials = [json.loads(p.read_text()) for p in sorted((sweep / "trials").glob("*.json"))]
    assert [t["status"] for t in trials] == ["ok"], trials
    assert trials[0]["config"]["hardware"]["name"] == "mine" and trials[0]["metrics"]["peak_memory_bytes"] > 0
    out = run("report", str(sweep))
    assert "wrote (in" in out and (sweep / "ablation.md").is_file() and (sweep / "ablation.csv").is_file()
    out = run("pick", str(sweep), "--budget-gib", "4", "--name", "prod")
    assert "train it: vramsweep train +experiment=prod" in out
    assert (project / "conf" / "experiment" / "prod.yaml").is_file()
    assert not (site / "vramsweep" / "conf" / "experiment").exists()
    out = run("train", "--cfg", "job", "+experiment=prod")
    assert "name: mine" in out  # the pinned experiment composes back from the user's conf dir
