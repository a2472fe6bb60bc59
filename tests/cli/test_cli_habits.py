"""CLI habits: ``--version``, overrides anywhere after the verb, every flag with help and its
default, no traceback on a closed pipe, the dashboard hint only where optuna-dashboard is installed, and
allowed lists that offer only what runs here and say how to get the rest."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vramsweep import __version__
from vramsweep.cli import build_parser, main
from vramsweep.config import compose, rules
from vramsweep.config.rules import UnsupportedError

pytestmark = pytest.mark.torchfree

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_version(capsys) -> None:
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"vramsweep {__version__}"


def test_overrides_after_a_flag_are_overrides(capsys) -> None:
    before = _run(["estimate", "model=qwen3_8b", "quant=nf4", "--json"], capsys)
    after = _run(["estimate", "model=qwen3_8b", "--json", "quant=nf4"], capsys)
    plain = _run(["estimate", "model=qwen3_8b", "--json"], capsys)
    assert before[0] == after[0] == 0, (before[2], after[2])
    assert json.loads(after[1]) == json.loads(before[1])
    # quant=nf4 after the flag really applied: 4-bit weights are smaller than bf16 ones
    assert (
        json.loads(after[1])["breakdown_bytes"]["params"] < json.loads(plain[1])["breakdown_bytes"]["params"]
    )


def test_overrides_between_flags_keep_their_order() -> None:
    ns = build_parser().parse_args(
        ["train", "quant=nf4", "-m", "adapter=rslora", "--cfg", "job", "adapter.r=8"]
    )
    assert ns.multirun and ns.cfg == "job"
    assert ns.overrides == ["quant=nf4", "adapter=rslora", "adapter.r=8"]


def test_unknown_flag_after_overrides_is_still_refused(capsys) -> None:
    code, _, err = _run(["estimate", "quant=nf4", "--jsn"], capsys)
    assert code == 2 and "unknown option --jsn; did you mean --json?" in err


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    verbs = _verbs(parser)
    assert {"train", "estimate", "report", "pick"} <= set(verbs)
    for verb, sub in verbs.items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = (action.option_strings or [action.dest])[0]
            assert action.help, f"vramsweep {verb} {name} has no help"
            if action.option_strings and action.default not in (None, False):
                helped = sub._get_formatter()._expand_help(action)
                assert "default" in helped, f"vramsweep {verb} {name}: default {action.default!r} not shown"
        assert "--help" in text


def test_pick_help_names_each_flag_and_its_default(capsys) -> None:
    code, out, _ = _run(["pick", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0
    for want in ("(default: quality)", "(default: 0.0)", "(required)", "(default: no floor)"):
        assert want in flat, want


def test_a_closed_pipe_ends_quietly() -> None:
    """``vramsweep estimate model=qwen3_8b | head -1``: the reader is gone before the table is written
    (argparse's own ``--help`` already swallowed the error; a verb's ``print`` raised BrokenPipeError)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from vramsweep.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "estimate", "model=qwen3_8b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # the reader closes before vramsweep writes a byte
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 141


@pytest.mark.parametrize("installed", [True, False])
def test_dashboard_hint_only_where_optuna_dashboard_is_installed(monkeypatch, installed) -> None:
    from vramsweep.sweeper.progress import dashboard_hint

    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name == "optuna_dashboard":
            return SimpleNamespace(name=name) if installed else None
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    hint = dashboard_hint("sqlite:///results/sweeps/demo/study.db")
    if installed:
        assert hint == "vramsweep: dashboard: optuna-dashboard sqlite:///results/sweeps/demo/study.db"
    else:
        assert hint is None
    assert "secret" not in (dashboard_hint("postgresql://u:secret@h/db") or "")


def _machine(monkeypatch, *, cuda: bool, present: set[str]) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name in {"flash_attn", "liger_kernel", "unsloth"}:
            return SimpleNamespace(name=name) if name in present else None
        return real(name, *a, **kw)

    monkeypatch.setattr(rules, "cuda_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    ("cuda", "present", "overrides", "allowed", "says"),
    [
        # a CPU machine with neither: each option used to offer the other, which does not run either
        (False, set(), ["kernels=liger"], ["none"], "needs CUDA"),
        (False, set(), ["kernels=unsloth"], ["none"], "make unsloth"),
        (False, {"unsloth"}, ["kernels=liger"], ["none", "unsloth"], "needs CUDA"),
        (True, set(), ["kernels=liger", "hardware=h100_80gb"], ["none"], "pip install 'vramsweep[gpu]'"),
        (
            True,
            {"liger_kernel"},
            ["kernels=unsloth", "hardware=h100_80gb"],
            ["none", "liger"],
            "make unsloth",
        ),
    ],
)
def test_kernels_allowed_lists_offer_what_runs_here(
    monkeypatch, cuda, present, overrides, allowed, says
) -> None:
    _machine(monkeypatch, cuda=cuda, present=present)
    with pytest.raises(UnsupportedError) as exc:
        rules.validate(compose(overrides, rules="none"))
    assert exc.value.allowed == allowed
    assert says in str(exc.value) and "`vramsweep env` lists what runs here" in str(exc.value)
