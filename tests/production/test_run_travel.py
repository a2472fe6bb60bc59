"""Outputs that travel (docs/RUNS.md "The run folder"): a run trained with a relative ``model.path`` from one
folder is used from another, in fresh processes that have not imported vramsweep: ``run.json`` holds the
absolute resolved base folder (the typed one beside it), the adapter's ``base_model_name_or_path`` is that
folder, ``vramsweep generate``/``export`` and the reload snippet of docs/RUNS.md work, and
``AutoPeftModelForCausalLM`` loads the exported adapter (before: ``the base weights folder
'models/tiny_llama' is missing`` and a base named as typed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST

SRC = str(Path(__file__).parents[2] / "src")
PROBE = "The grant report of the committee"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "VRAMSWEEP_PROGRESS": "0", "HF_HUB_OFFLINE": "1"}


def _vramsweep(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vramsweep.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_model_dir) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("travel")
    project, elsewhere = root / "project", root / "elsewhere"
    (project / "models").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copytree(embedded_model_dir, project / "models" / "tiny")
    res = _vramsweep(
        project,
        "train",
        *FAST,
        "model=local",
        "model.path=models/tiny",
        "results_dir=results",
        "train.output_dir=results/runs/prod",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return project / "results" / "runs" / "prod", project / "models" / "tiny", elsewhere


def test_run_json_and_the_adapter_name_the_base_folder_absolute(trained):
    run, base, _ = trained
    man = json.loads((run / "run.json").read_text())
    assert man["base"]["path"] == str(base.resolve()) and man["base"]["path_typed"] == "models/tiny"
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(base.resolve())


def test_generate_export_and_the_reload_snippet_work_from_another_folder(trained):
    run, _, elsewhere = trained
    gen = _vramsweep(elsewhere, "generate", str(run), "--prompt", PROBE, "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-2000:]
    exp = _vramsweep(elsewhere, "export", str(run), "exported")
    assert exp.returncode == 0, exp.stderr[-2000:]
    merged = _vramsweep(elsewhere, "export", str(run), "--merge", "merged")
    assert merged.returncode == 0, merged.stderr[-2000:]
    # a fresh process without vramsweep: the snippet of docs/RUNS.md, and AutoPeftModelForCausalLM
    snippet = f"""
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
run = {str(run)!r}
base = AutoModelForCausalLM.from_pretrained(json.load(open(f"{{run}}/run.json"))["base"]["path"], dtype=torch.bfloat16)
model = PeftModel.from_pretrained(base, f"{{run}}/adapter")
tok = AutoTokenizer.from_pretrained(f"{{run}}/tokenizer")
auto = AutoPeftModelForCausalLM.from_pretrained("exported", dtype=torch.bfloat16)
plain = AutoModelForCausalLM.from_pretrained("merged", dtype=torch.bfloat16)
x = torch.tensor([tok({PROBE!r})["input_ids"]])
with torch.no_grad():
    a, b = model(input_ids=x).logits, auto(input_ids=x).logits
assert torch.equal(a, b), (a - b).abs().max()
assert "vramsweep" not in sys.modules
print("ok")
"""
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", snippet], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
