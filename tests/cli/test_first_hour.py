"""The walls a newcomer hits in the first hour: a sweep file in the wrong folder, a short run refused for
warm-ups the user never set, ``model=local`` without a path, and README's quick start on your own JSONL."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from vramsweep.cli import main
from vramsweep.config import ConfigError, compose
from vramsweep.config.fit import SAID_ENV, fitted_warmups

ROOT = Path(__file__).resolve().parents[2]
SWEEP = "sweep:\n  name: mine\n  design: grid\n"


def _one_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("multirun", [True, False], ids=["train-m", "train"])
@pytest.mark.parametrize(
    "where, wanted",
    [("conf/sweeps/mine.yaml", "conf/sweep/mine.yaml"), ("conf/sweep/mine.yml", "conf/sweep/mine.yaml")],
    ids=["plural-folder", "yml"],
)
def test_a_sweep_file_in_the_wrong_place_is_named_in_the_error(
    tmp_path, monkeypatch, capsys, multirun, where, wanted
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR", raising=False)
    (tmp_path / where).parent.mkdir(parents=True)
    (tmp_path / where).write_text(SWEEP)
    before = sorted(tmp_path.rglob("*"))
    argv = ["train", "-m", "sweep=mine"] if multirun else ["train", "sweep=mine"]
    line = _one_error(capsys, [*argv, f"results_dir={tmp_path / 'res'}"])
    assert f"{where} is not read: did you mean {wanted}?" in line, line
    assert "(allowed: " in line and "demo" in line  # the shipped sweeps are still listed
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_a_sweep_nowhere_near_gets_no_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR", raising=False)
    line = _one_error(capsys, ["train", "-m", "sweep=mine", f"results_dir={tmp_path / 'res'}"])
    assert "unknown sweep 'mine'" in line and "did you mean" not in line


@pytest.mark.torchfree
@pytest.mark.parametrize("steps", range(1, 12))
def test_fitted_warmups_leave_a_measured_step_and_warm_up_at_most_half(steps):
    warm, measure = fitted_warmups(steps)
    assert 0 <= warm <= steps // 2 and 0 <= measure <= steps - 1
    assert (warm, measure) == (min(2, steps // 2), min(2, steps - 1))


def test_a_short_run_fits_the_warmups_nobody_set_and_says_so_once(monkeypatch, capfd):
    monkeypatch.delenv(SAID_ENV, raising=False)
    cfg = compose(["train.steps=1"])
    assert (cfg.train.warmup_steps, cfg.train.measure_warmup_steps) == (0, 0)
    compose(["train.steps=1"])
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "warm-ups" in ln]
    assert len(notes) == 1 and "train.warmup_steps=0, train.measure_warmup_steps=0" in notes[0], notes
    assert SAID_ENV in __import__("os").environ  # the trial processes of this command inherit the mark
    cfg = compose([])  # the defaults of a normal run are untouched
    assert (cfg.train.warmup_steps, cfg.train.measure_warmup_steps) == (2, 2)
    cfg = compose(["train.steps=3", "train.warmup_steps=1"])  # a value the user set stays
    assert (cfg.train.warmup_steps, cfg.train.measure_warmup_steps) == (1, 2)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.warmup_steps=2", "train.warmup_steps"),
        ("train.measure_warmup_steps=2", "train.measure_warmup_steps"),
    ],
)
def test_an_explicit_warmup_that_does_not_fit_still_errors(override, key):
    with pytest.raises(ConfigError) as info:
        compose(["train.steps=1", override])
    assert info.value.key == key


def test_a_short_run_on_the_command_line_passes_every_check(tmp_path, monkeypatch, capsys):
    """``vramsweep train train.steps=1 --cfg job``: no refusal for keys the user never set."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--cfg", "job", "train.steps=1"]) == 0
    out = capsys.readouterr().out
    assert "warmup_steps: 0" in out and "measure_warmup_steps: 0" in out


@pytest.mark.parametrize("verb", ["train", "estimate"])
def test_model_local_without_a_path_says_so_in_one_line(tmp_path, monkeypatch, capsys, verb):
    monkeypatch.chdir(tmp_path)
    line = _one_error(capsys, [verb, "model=local"])
    assert "model=local needs model.path=<folder>" in line and "None" not in line, line


def test_a_file_data_source_without_a_path_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _one_error(capsys, ["train", "data=file"])
    assert "data=file needs data.path=<file>" in line and "None" not in line, line


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.split("#", 1)[0].strip()]


def test_readme_quick_start_shows_one_trial_on_your_own_jsonl_right_after_make_demo(tmp_path, monkeypatch):
    """The line after ``make demo`` is one trial on the user's own JSONL; it passes every check on a real
    chat file (the shipped chat set's shape), with nothing written."""
    lines = _quick_start()
    i = lines.index("make demo")
    cmd = shlex.split(lines[i + 1])
    assert re.search(r"(^|/)vramsweep$", cmd[0]) and cmd[1] == "train" and "-m" not in cmd, cmd
    overrides = cmd[2:]
    path = next(o.split("=", 1)[1] for o in overrides if o.startswith("data.path="))
    assert path.endswith(".jsonl") and "train.steps=1" in overrides
    monkeypatch.chdir(tmp_path)
    chats = [
        {
            "messages": [
                {"role": "user", "content": "Summarise the grant in one line."},
                {"role": "assistant", "content": f"It funds {i} sensors for the river survey."},
            ]
        }
        for i in range(12)
    ]
    Path(path).write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = compose(overrides)
    from vramsweep.preflight import preflight

    before = sorted(tmp_path.rglob("*"))
    preflight(cfg, overrides=overrides)
    assert int(cfg.train.steps) == 1 and cfg.data.path == path
    assert sorted(tmp_path.rglob("*")) == before


# ------------------------------------------------------------------------------------------------------
# train.dtype=auto: bf16 only where the CPU computes it natively
# ------------------------------------------------------------------------------------------------------
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"


@pytest.mark.torchfree
def test_auto_dtype_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch):
    from vramsweep.config.fit import CPU_BF16_ENV, auto_dtype, cpu_bf16

    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    assert auto_dtype("cpu", SAPPHIRE)[0] == "bf16"
    assert cpu_bf16(SAPPHIRE) == {
        "native": True,
        "flags": ["amx_bf16", "avx512_bf16"],
        "source": "/proc/cpuinfo",
    }
    dtype, why = auto_dtype("cpu", EPYC)
    assert dtype == "fp32" and "no avx512_bf16/amx_bf16" in why
    assert auto_dtype("cpu", "")[0] == "fp32"  # nothing known: the dtype that is never emulated
    assert auto_dtype("cuda", EPYC)[0] == "bf16"
    monkeypatch.setenv(CPU_BF16_ENV, "emulated")
    assert auto_dtype("cpu", SAPPHIRE)[0] == "fp32"


@pytest.mark.parametrize("native, want", [("native", "bf16"), ("emulated", "fp32")])
def test_compose_resolves_auto_dtype_and_keeps_a_given_one(monkeypatch, native, want):
    from vramsweep.config.fit import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, native)
    assert compose([]).train.dtype == want
    assert compose(["train.dtype=bf16"]).train.dtype == "bf16"  # a value the user set is kept
    assert compose(["hardware=rtx4080_16gb"], rules="config").train.dtype == "bf16"
    with pytest.raises(ConfigError, match="auto"):
        compose(["train.dtype=fp8"])


def test_a_bad_step_count_gets_its_error_alone(tmp_path, monkeypatch, capsys):
    """The warm-up note comes only after the rules passed: train.steps=0 prints one error line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SAID_ENV, raising=False)
    line = _one_error(capsys, ["train", "train.steps=0", f"results_dir={tmp_path / 'res'}"])
    assert "train.steps=0 is out of range" in line
