"""Docs that are run: every ``vramsweep …`` command in README.md and docs/*.md parses —
its verb and flags exist, its overrides compose (keys, types, options), its ``sweep=<name>`` exists — and
every file it names exists. A README that names a missing option, sweep or file fails here.

Fast: commands are checked in-process (argparse + one compose per command, no trial runs); the worked
example's commands run for real in the slow suite.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").rglob("*.md"))
#: at most this many README lines
README_MAX_LINES = 250
#: prefixes of repository paths that docs may name; each named path must exist
PATH_RE = re.compile(r"(?<![\w./-])((?:src|docs|scripts|bench|tests|conf|sweeps)/[\w./-]*[\w/])")
#: sweep-grammar functions: their arguments are values, not overrides
SWEEP_FUNCS = re.compile(r"^(choice|range|interval|tag|glob)\(")
#: first line of an output that shows a command failing on purpose (``$ vramsweep train quant=nf5``)
ERROR_LINE = re.compile(r"^vramsweep(?: \w+)?: error:")
#: a line the program prints, not a command (``vramsweep report: warning: …``, ``vramsweep <verb>: error``)
OUTPUT_LINE = re.compile(r"^vramsweep(?: \S+)?:(?:\s|$)")


@dataclass(frozen=True)
class Command:
    """A documented ``vramsweep`` command: where it is, its text, and whether the docs show it failing."""

    where: str
    text: str
    fails: bool = False


# ---------------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------------
def _strip_comment(line: str) -> str:
    """``vramsweep train  # one trial`` -> ``vramsweep train`` (a ``#`` inside quotes stays)."""
    out, quote = [], None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).rstrip()


def _from_shell_line(line: str) -> str | None:
    """The ``vramsweep …`` part of a shell line (after ``$ ``, env assignments, ``make``-free), else None."""
    line = _strip_comment(line.strip())
    line = line[2:] if line.startswith("$ ") else line
    m = re.search(r"(?:^|\s|\")vramsweep(?=\s|$)(.*)$", line)
    if not m or re.match(r"^(pip|git|cd|python|wandb|optuna)\b", line):
        return None
    before = line[: m.start()].strip().strip('"')
    # only env assignments (or a for/sbatch wrapper, whose command ends with the quote) may come before it
    if before and not re.fullmatch(r"(\w+=\S+\s*)+|.*(--wrap|do|&&)", before):
        return None
    cmd = ("vramsweep" + m.group(1)).split(" & ")[0].split(";")[0].rstrip('"').strip()
    return None if OUTPUT_LINE.match(cmd) else " ".join(cmd.split())


def extract(text: str, where: str) -> Iterator[Command]:
    """Commands in fenced/indented code blocks (continuation lines joined) and in inline code spans."""
    lines = text.splitlines()
    fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = not fence
            i += 1
            continue
        code = fence or line.startswith("    ")
        if code:
            joined, j = line, i
            while _strip_comment(joined).endswith("\\") and j + 1 < len(lines):
                j += 1
                joined = _strip_comment(joined)[:-1] + " " + lines[j].strip()
            cmd = _from_shell_line(joined)
            if cmd:
                nxt = lines[j + 1] if j + 1 < len(lines) else ""
                yield Command(f"{where}:{i + 1}", cmd, fails=bool(ERROR_LINE.match(nxt)))
            i = j + 1
            continue
        for span in re.findall(r"`(vramsweep [^`]+)`", line):
            if not OUTPUT_LINE.match(span):
                yield Command(f"{where}:{i + 1}", span)
        i += 1


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
@cache
def _parser():
    from vramsweep.cli import build_parser

    return build_parser()


@cache
def _options(group: str) -> tuple[str, ...]:
    from vramsweep.config.compose import list_options, packaged_conf_dir

    return tuple(list_options(group, packaged_conf_dir()))


@cache
def _sweeper_keys() -> frozenset[str]:
    from dataclasses import fields

    from vramsweep.sweeper.settings import SweeperConf

    return frozenset(f.name for f in fields(SweeperConf))


def _values(value: str) -> list[str]:
    """``none,nf4`` / ``choice(none,nf4)`` / ``nf4`` -> the listed values (ranges/intervals: none)."""
    m = SWEEP_FUNCS.match(value)
    if m:
        if m.group(1) != "choice":
            return []
        value = value[len("choice(") : -1]
    return [v.strip().strip("'\"") for v in value.split(",") if v.strip()]


def _check_overrides(overrides: list[str]) -> list[str]:
    """Problems with ``overrides``: unknown options or sweeps, unknown sweeper keys, and (for the first
    value of every swept key) what composing them says."""
    from vramsweep.config import ConfigError, compose
    from vramsweep.config.schema import CONFIG_GROUPS

    problems: list[str] = []
    plain: list[str] = []
    for ov in overrides:
        if "PLACEHOLDER" in ov or ov.startswith(("~", "--")):
            continue
        key, eq, value = ov.partition("=")
        if not eq:
            problems.append(f"{ov!r} is not an override")
            continue
        bare = key.lstrip("+")
        if bare.startswith("hydra/") or bare.startswith("hydra.launcher.") or bare.startswith("hydra.sweep."):
            continue  # the launcher's own keys (hydra-submitit-launcher is an optional install)
        if bare.startswith("hydra.sweeper."):
            name = bare.split(".")[2]
            if name not in _sweeper_keys() and name not in ("sampler", "pruner", "params"):
                problems.append(f"unknown sweeper setting {bare}")
            continue
        values = _values(value)
        if bare in ("sweep", "experiment"):
            known = _options(bare)
            missing = [v for v in values if v not in known]
            if missing and bare == "sweep":
                problems.append(f"unknown sweep {missing[0]!r} (known: {', '.join(known)})")
            continue  # an experiment is a file the user makes with `vramsweep pick`
        if bare in CONFIG_GROUPS:
            missing = [v for v in values if v not in _options(bare)]
            if missing:
                problems.append(f"unknown option {bare}={missing[0]} (allowed: {', '.join(_options(bare))})")
                continue
        if not values:
            continue  # a range/interval: its key is checked through the group or compose anyway
        plain.append(f"{key}={values[0]}")
    if not problems:
        try:
            compose(plain, rules="config")
        except (ConfigError, ValueError) as exc:
            problems.append(f"does not compose: {exc}")
    return problems


def check(cmd: Command) -> list[str]:
    """What is wrong with a documented command (empty when it parses and composes)."""
    return list(_check_text(cmd.text))


@cache
def _check_text(command: str) -> tuple[str, ...]:
    return tuple(_problems(command))


def _problems(command: str) -> list[str]:
    text = re.sub(r"\[[^\]]*\]", " ", command)  # optional parts: [overrides], [--json]
    text = re.sub(r"<[^>]*>", "PLACEHOLDER", text)
    text = text.replace("…", "").replace("...", "")
    try:
        argv = shlex.split(text)[1:]
    except ValueError as exc:
        return [f"cannot split: {exc}"]
    if not argv or argv[0] in ("-h", "--help", "PLACEHOLDER"):
        return []
    parser = _parser()
    if len(argv) == 1 and not argv[0].startswith("-"):  # `vramsweep report` named in prose: the verb exists
        verbs = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them there
        return [] if argv[0] in verbs else [f"unknown verb {argv[0]!r}"]
    try:
        from contextlib import redirect_stderr, redirect_stdout
        from io import StringIO

        err = StringIO()
        with redirect_stderr(err), redirect_stdout(StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return []
        return [err.getvalue().strip() or f"argparse exit {exc.code}"]
    if args.command in ("train", "estimate"):
        return _check_overrides(list(args.overrides))
    return []


def paths(text: str) -> set[str]:
    """Repository paths named in ``text`` (placeholders and globs left out)."""
    out = set()
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".")
        if any(c in text[m.end() : m.end() + 1] for c in "<*{") or "NNNN" in p:
            continue
        if p.startswith("conf/experiment/"):  # what `vramsweep pick` writes into a user's conf dir
            continue
        out.add(p)
    return out


def all_commands() -> list[Command]:
    cmds = list(extract(README.read_text(), "README.md"))
    for d in DOCS:
        cmds += extract(d.read_text(), str(d.relative_to(REPO)))
    return cmds


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make demo" in text and "make test" in text  # CI and a hook check these strings
    pics = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert pics and all((REPO / p).is_file() for p in pics), pics


def test_every_documented_command_parses_and_composes() -> None:
    cmds = all_commands()
    assert len([c for c in cmds if c.where.startswith("README")]) >= 10
    bad = []
    for cmd in cmds:
        problems = check(cmd)
        if cmd.fails and not problems:
            bad.append(f"{cmd.where}: `{cmd.text}` is shown failing but parses and composes")
        elif problems and not cmd.fails:
            bad.append(f"{cmd.where}: `{cmd.text}`: {problems[0]}")
    assert not bad, "\n".join(bad)


def test_every_named_file_exists() -> None:
    missing = []
    for doc in [README, *DOCS]:
        for p in sorted(paths(doc.read_text())):
            if not (REPO / p).exists():
                missing.append(f"{doc.relative_to(REPO)}: {p}")
    assert not missing, "\n".join(missing)


def test_readme_knob_table_names_only_existing_options() -> None:
    """The knobs table (`| `group` | `opt` `opt` … | what it saves |`): every option exists."""
    from vramsweep.config.schema import CONFIG_GROUPS

    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README.read_text(), flags=re.M)
    rows = [(g, cell) for g, cell in rows if g in CONFIG_GROUPS]
    assert len(rows) >= 10, rows
    for group, cell in rows:
        for opt in re.findall(r"`([\w.]+)`", cell):
            if "." not in opt:  # `adapter.r` style keys are keys, not options
                assert opt in _options(group), f"README knobs table: {group}={opt} does not exist"


@pytest.mark.parametrize(
    "line, why",
    [
        ("Run `vramsweep train quant=nf4 adapter.no_such_key=3`.", "no_such_key"),
        ("Run `vramsweep train quant=nf5`.", "unknown option quant=nf5"),
        ("Run `vramsweep train -m sweep=no_such_sweep`.", "unknown sweep 'no_such_sweep'"),
        ("Run `vramsweep pick results/sweeps/demo --budget-gib 16 --no-such-flag`.", "--no-such-flag"),
        ("Run `vramsweep train -m quant=none hydra.sweeper.no_such=1`.", "hydra.sweeper.no_such"),
        ("Run `vramsweep frobnicate`.", "frobnicate"),
    ],
)
def test_a_readme_naming_a_missing_option_fails(line: str, why: str) -> None:
    """The check this file makes of README.md, on a fake README line that is wrong on purpose."""
    (cmd,) = extract(line, "fake README")
    problems = check(cmd)
    assert problems and why in problems[0], problems


def test_a_readme_naming_a_missing_file_fails() -> None:
    assert paths("see `src/vramsweep/no_such.py` and docs/NO_SUCH.md.") == {
        "src/vramsweep/no_such.py",
        "docs/NO_SUCH.md",
    }
    assert not (REPO / "docs/NO_SUCH.md").exists()


def test_extraction_joins_continuations_and_skips_other_tools() -> None:
    text = """```
vramsweep estimate model=qwen3_8b quant=nf4_dq \\
    hardware=rtx4080_16gb --json      # predicted peak
pip install vramsweep
PYTHONPATH=tests vramsweep train -m quant=none,nf4 hydra.sweeper.n_jobs=2
$ vramsweep train quant=nf5
vramsweep train: error: unknown option quant=nf5 (allowed: …)
```"""
    cmds = list(extract(text, "t"))
    assert [c.text for c in cmds] == [
        "vramsweep estimate model=qwen3_8b quant=nf4_dq hardware=rtx4080_16gb --json",
        "vramsweep train -m quant=none,nf4 hydra.sweeper.n_jobs=2",
        "vramsweep train quant=nf5",
    ]
    assert [c.fails for c in cmds] == [False, False, True]
    assert [bool(check(c)) for c in cmds] == [False, False, True]


def test_the_trial_overhead_probe_runs_as_documented_without_warnings() -> None:
    """``python bench/trial_overhead.py`` (docs/SWEEPS.md, docs/GPU.md): its no-op trials, imported by name
    from ``bench/`` in each forked trial process, come back as timings and no process warns (runpy would,
    "found in sys.modules", were the probe a module run with ``-m`` that the fork server preloads)."""
    cmd = [sys.executable, "bench/trial_overhead.py", "--n", "2", "--isolation", "fork"]
    done = subprocess.run([*cmd, "--preload", ""], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr[-2000:]
    rep = json.loads(done.stdout.strip().splitlines()[-1])
    assert rep["isolation"] == "fork" and len(rep["per_trial_s"]) == 2


# ---------------------------------------------------------------------------------------------
# the worked example, run (slow)
# ---------------------------------------------------------------------------------------------
def worked_example() -> list[str]:
    """The commands of README's worked example (the code block after ``<!-- worked-example -->``)."""
    text = README.read_text()
    block = text.split("<!-- worked-example -->", 1)[1].split("```", 2)[1]
    return [c.text for c in extract("```" + block + "```", "README worked example")]


def test_worked_example_is_marked_and_parses() -> None:
    cmds = worked_example()
    assert [c.split()[1] for c in cmds] == ["train", "report", "pick", "train", "generate", "export"], cmds


@pytest.mark.slow
def test_worked_example_runs(tmp_path: Path) -> None:
    """README's worked example, as a user types it, in a fresh project folder: each command exits 0."""
    env = dict(os.environ)
    env.setdefault("VRAMSWEEP_CACHE", str(REPO / ".cache" / "vramsweep"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline")
    exe = str(Path(sys.executable).with_name("vramsweep"))
    for cmd in worked_example():
        argv = [exe] + shlex.split(cmd)[1:]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
        assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-2000:])
    assert list((tmp_path / "conf" / "experiment").glob("*.yaml"))
    # the demo sweep (`make demo`) for real, through the fork server (was a second run of it in test_sweeps)
    d = tmp_path / "results" / "sweeps" / "demo"
    assert (d / "study.db").exists() and json.loads((d / "sweep.json").read_text())["design"] == "ablation"
    res = [json.loads(p.read_text()) for p in sorted((d / "trials").glob("*.json"))]
    assert len(res) == 6 * 2 and {r["status"] for r in res} == {"ok"}  # 6 points x 2 seeds
    assert res[0]["metrics"]["peak_memory_bytes"] > 0 and res[0]["meta"]["design"]["role"] == "baseline"
    # the production run: its run folder, with an adapter plain peft loads, and the merged export
    run = tmp_path / "results" / "runs" / "demo_prod"
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and (run / "losses.jsonl").is_file()
    prod = json.loads((run / "result.json").read_text())
    assert prod["status"] == "ok" and prod["metrics"]["eval_loss"] < prod["metrics"]["initial_eval_loss"]
    assert (tmp_path / "results" / "demo_merged" / "model.safetensors").is_file()
