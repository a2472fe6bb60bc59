"""``vramsweep`` command line: train | estimate | data | report | pick (and generate, export, env).

Overrides are ordinary Hydra overrides (``quant=nf4 adapter.r=64``). Bad input exits 2 with a message
naming the override and the allowed values, and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from vramsweep import __version__
from vramsweep.cli_help import main_epilog, verb_epilog
from vramsweep.config import ConfigError, compose
from vramsweep.config.compose import (
    CONFIG_DIR_ENV,
    list_options,
    packaged_conf_dir,
    use_conf_dir,
    user_conf_dir,
)
from vramsweep.config.errors import error_line
from vramsweep.config.schema import CONFIG_GROUPS
from vramsweep.estimate.cli import run_suggest
from vramsweep.noise import DIGEST, quiet_terminal_warnings
from vramsweep.preflight import check_named_options, preflight
from vramsweep.production.fingerprint import check_data
from vramsweep.production.owner import claim, complete_line
from vramsweep.production.use import add_parsers
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.metrics import format_value, label, metric, title
from vramsweep.record.status import Status
from vramsweep.record.units import MIB
from vramsweep.sweeper.production_run import launcher_choice, submit_run
from vramsweep.sweeper.progress import status_label

EPILOG_TRAIN = """\
config groups (choose with <group>=<option>):
{groups}

examples:
  vramsweep train                                   # one trial, embedded tiny model (CPU)
  vramsweep train quant=nf4_dq adapter=rslora optimizer=adamw_8bit checkpointing=on
  vramsweep train model=local model.path=/models/Qwen3-8B hardware=rtx4080_16gb quant=nf4_dq
  vramsweep train -m sweep=demo                     # a sweep (our Optuna sweeper)
  vramsweep train --cfg quant=nf4                   # print the composed config, run nothing
  vramsweep train -m quant=nf4,nf4_dq adapter.r=8,16  # a grid: every combination once
  vramsweep train -m --cfg hydra quant=nf4,fp4      # print Hydra's config of the sweep, run nothing

{docs}"""


def _groups_text() -> str:
    try:
        list_options("sweep")
        where = None
    except ConfigError:  # a bad $VRAMSWEEP_CONFIG_DIR: the verb says so; the help lists the packaged options
        where = packaged_conf_dir()
    lines = []
    for g in (*CONFIG_GROUPS, "sweep", "experiment"):
        opts = list_options(g, where)
        lines += textwrap.wrap(
            ", ".join(opts) if opts else "(none yet)",
            width=110,
            initial_indent=f"  {g:<14} ",
            subsequent_indent=" " * 17,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def _err(msg: str, verb: str = "train") -> int:
    """One error style for every verb: ``vramsweep <verb>: error: <one line>``; exit code 2."""

    print(error_line(verb, msg), file=sys.stderr)
    return 2


VERBS = ("train", "estimate", "data", "check", "report", "pick", "generate", "export", "env")
#: the verbs that compose a config from overrides (and read ``--config-dir``)
COMPOSING = ("train", "estimate", "data", "check")


def _close(word: str, options: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else ""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs as written; every flag's help ends with its default when it has one (``--prefer`` →
    ``(default: quality)``). A help that names its default already, or a flag whose default is off/unset
    (``store_true``, ``None``, which the help explains), is left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with the one error shape: ``vramsweep <verb>: error: <what>`` on one line, exit 2; the usage
    is behind ``--help`` (never printed before the error). Unknown options are charged to the verb.

    A verb with ``overrides`` takes them anywhere after the verb, between its flags too
    (``estimate model=qwen3_8b --json quant=nf4``); every parser (verbs added later too) uses
    :class:`HelpFormatter`, so each flag's help shows its default."""

    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def _flags(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings if o.startswith("--")]

    argv: list[str] = []

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        Parser.argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(args, namespace)
        if extras and isinstance(getattr(ns, "overrides", None), list):
            # overrides after a flag: argparse's `overrides` positional took only the first run of them
            late = [a for a in extras if not a.startswith("-")]
            ns.overrides = [*ns.overrides, *late]
            extras = [a for a in extras if a.startswith("-")]
        if extras:
            sub = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(ns, "command", None):
                    sub = action.choices.get(ns.command, self)
            first = extras[0]
            flag = first.split("=", 1)[0]
            sub.error(
                f"unknown option {flag}" + _close(flag, sub._flags())
                if flag.startswith("-")
                else f"unexpected argument {first!r}"
            )
        return ns

    def error(self, message: str):  # type: ignore[override]
        import re

        verb = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        msg = message
        if m := re.match(r"argument \{[\w,]+\}: invalid choice: '([^']*)'", message):
            msg = f"unknown verb {m.group(1)!r} (allowed: {', '.join(VERBS)})" + _close(
                m.group(1), list(VERBS)
            )
        elif m := re.match(
            r"argument ([-\w/]+)(?:/[-\w]+)?: invalid (?:float|int) value: '([^']*)'", message
        ):
            msg = f"{m.group(1)}={m.group(2)!r} is not a number"
        elif m := re.match(
            r"argument ([-\w/]+)(?:/[-\w]+)?: invalid choice: '([^']*)' \(choose from (.*)\)", message
        ):
            allowed = ", ".join(x.strip(" '") for x in m.group(3).split(","))
            msg = f"{m.group(1)}={m.group(2)!r} is not known (allowed: {allowed})"
        elif m := re.match(r"argument ([-\w/]+)(?:/[-\w]+)?: expected one argument", message):
            msg = f"{m.group(1)} needs a value"
        elif m := re.match(r"the following arguments are required: (.*)", message):
            msg = f"missing {m.group(1)}"
            flags = self._flags()
            typo = [
                a.split("=", 1)[0]
                for a in Parser.argv
                if a.startswith("--") and a.split("=", 1)[0] not in flags
            ]
            if typo:  # a misspelt flag is the cause: say so first
                msg = f"unknown option {typo[0]}" + _close(typo[0], flags)
        print(error_line(verb, f"{msg} (usage: {self.prog} --help)"), file=sys.stderr)
        raise SystemExit(2)


CFG_KINDS = ("job", "hydra", "all")
INFO_KINDS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def check_internal_options(overrides: list[str]) -> None:
    """``quant=base_quant``: a schema name, not an option (it would run the schema's bare defaults)."""

    for ov in overrides:
        key, eq, value = ov.lstrip("+").partition("=")
        if not eq or key not in CONFIG_GROUPS:
            continue
        for v in value.replace("choice(", "").rstrip(")").split(","):
            if v.strip() == f"base_{key}":  # the schema only: a user's base_mine.yaml is an option
                allowed = list_options(key)
                raise ConfigError(f"unknown option {key}={v.strip()}", key=key, allowed=allowed)


def _hydra_flags(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """``--cfg [job|hydra|all]`` / ``--info [what]`` as Hydra flags; a value that is not one of the kinds
    is the first override (``--cfg quant=nf4``) and goes back to ``overrides``."""
    flags: list[str] = []
    if args.cfg is not None:
        kind = args.cfg
        if kind not in CFG_KINDS:
            overrides.insert(0, kind)
            kind = "job"
        flags += ["--cfg", kind]
    if args.info is not None:
        kind = args.info
        if kind not in INFO_KINDS:
            overrides.insert(0, kind)
            kind = "all"
        flags += ["--info", kind]
    return flags


def _human(metrics: dict, name: str, unit: str = "") -> str:
    """Metric ``name`` as the registry formats it (``unit`` appended), ``n/a`` when not measured."""

    v = metrics.get(name)
    return "n/a" if v is None else format_value(name, v) + unit


def print_result(res: dict, path: object) -> None:
    """The end-of-trial summary of ``vramsweep train`` (no ``n/a MiB (None)``: absent values say so).

    Metric words, formats and units come from the metric registry; memory is shown in MiB (a trial on
    a laptop peaks at a fraction of a GiB)."""

    m = res["metrics"]
    print(f"status: {status_label(res)}" + (f" ({res['reason']})" if res.get("reason") else ""))
    peak = m.get(M.PEAK_MEMORY_BYTES)
    if peak:
        kind = f" ({m[M.MEMORY_KIND]})" if m.get(M.MEMORY_KIND) else ""
        print(f"{title(M.PEAK_MEMORY_BYTES)}: {peak / MIB:.1f} MiB{kind}")
    else:
        print(f"{title(M.PEAK_MEMORY_BYTES)}: not measured")
    bd = m.get(M.MEMORY_BREAKDOWN_BYTES) or {}
    if bd:
        print("  breakdown: " + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in bd.items()))
    if m.get(M.TOKENS_PER_S) is not None or m.get(M.STEP_TIME_S) is not None:
        step = f" {metric(M.STEP_TIME_S).unit}"
        print(
            f"{title(M.TOKENS_PER_S)}: {_human(m, M.TOKENS_PER_S)}   {title(M.STEP_TIME_S)}: "
            f"{_human(m, M.STEP_TIME_S, step)}   {title(M.MFU)}: {_human(m, M.MFU)}"
        )
    if m.get(M.EVAL_LOSS) is not None or m.get(M.INITIAL_EVAL_LOSS) is not None:
        print(
            f"{title(M.EVAL_LOSS)}: {_human(m, M.INITIAL_EVAL_LOSS)} -> {_human(m, M.EVAL_LOSS)}"
            f"   {label(M.EVAL_PPL)}: {_human(m, M.EVAL_PPL)}   {title(M.TASK_SCORE)}: "
            f"{_human(m, M.TASK_SCORE)}"
        )
    est = res.get("estimate") or {}
    if est.get(M.PEAK_MEMORY_BYTES):
        print(f"estimate: {est[M.PEAK_MEMORY_BYTES] / MIB:.1f} MiB")
    written = (res.get("meta") or {}).get("result_path")
    print(f"result: {path}" if written else f"result: not written ({res.get('reason') or 'unknown reason'})")


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    flags = _hydra_flags(args, overrides)

    try:
        from vramsweep.sweeper.multirun import check_option_names, run_multirun, sweep_overrides
    except ImportError as exc:
        return _err(f"the sweeper is not available: {exc}")
    try:
        check_option_names(overrides)
    except ConfigError as exc:
        return _err(str(exc))
    if args.multirun or (flags and flags[:2] != ["--cfg", "job"]):
        # a sweep, or Hydra's own printouts (--cfg hydra|all, --info): Hydra prints them and runs nothing
        return run_multirun(overrides, flags=flags, multirun=bool(args.multirun))
    if flags and sweep_overrides(overrides):
        # --cfg job over sweep values (a,b / choice / range) without -m: the base config, like --cfg hydra|all
        return run_multirun(overrides, flags=flags, multirun=False)
    if not flags and launcher_choice(overrides) not in (None, "basic"):
        return submit_run(overrides)  # a production run as a SLURM job (docs/RUNS.md)

    try:
        check_named_options(overrides)
        cfg = compose(overrides, rules="all")
        if not args.cfg:
            preflight(cfg, overrides=overrides)  # before any model is built or any file written
    except ConfigError as exc:
        return _err(str(exc))
    if flags:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    from vramsweep.trial import run_trial

    own = _own_run_folder(cfg, overrides)
    if isinstance(own, int):
        return own
    path = own.run_dir / "result.json"
    try:
        DIGEST.use_log(Path(path).parent / "warnings.log")  # full texts of the harmless warnings shown once
        res = run_trial(cfg, result_path=path, overrides=overrides)
    finally:
        own.release()
    print_result(res, path)

    return 0 if res["status"] == Status.OK else 1


def _own_run_folder(cfg, overrides: list[str]):
    """The run folder, owned (:func:`vramsweep.production.owner.claim`: locked, a finished or stopped run
    not overwritten), or the exit code: 2 for a refusal, 0 when ``train.resume=auto`` finds it complete."""
    from vramsweep.trial import default_result_path

    try:
        folder = default_result_path(cfg, overrides).parent  # resume=auto refuses a changed config here
        check_data(cfg, folder)  # pinned hashes; resume=auto: the data the checkpoint recorded
    except ConfigError as exc:
        return _err(str(exc))
    try:  # the run folder made now: a name or folder that cannot be written fails before the training
        own = claim(folder, str(cfg.train.resume))
    except ConfigError as exc:
        return _err(str(exc))
    except OSError as exc:
        return _err(f"results_dir: cannot create the run folder {folder}: {exc.strerror or exc}")
    if own.complete:
        print(complete_line(own))
        return 0
    if own.note:
        print(f"vramsweep train: note: {own.note}", file=sys.stderr)
    return own


def cmd_estimate(args: argparse.Namespace) -> int:
    try:
        from vramsweep.estimate import run_calibrate, run_estimate
    except ImportError as exc:
        return _err(f"the estimator is not available: {exc}", "estimate")
    if getattr(args, "suggest", False):
        return run_suggest(
            list(args.overrides),
            as_json=args.json,
            max_context=args.max_context,
            calibrate_dir=args.calibrate,
            any_install=args.any_install,
        )
    if args.calibrate:
        return run_calibrate(args.calibrate)
    return run_estimate(list(args.overrides), as_json=args.json, max_context=args.max_context)


def cmd_data(args: argparse.Namespace) -> int:
    """``vramsweep data``: the records as the trial sees them (:mod:`vramsweep.dataview`)."""
    try:  # torch (the examples' tensors) and the tokenizer stay off the CLI's import
        from vramsweep.dataview import run_data
    except ImportError as exc:
        return _err(f"data is not available: {exc}", "data")

    return run_data(list(args.overrides), records=args.records, as_json=args.json)


def cmd_check(args: argparse.Namespace) -> int:
    """``vramsweep check``: the training maths proven on the config's proxy (:mod:`vramsweep.check`)."""
    try:  # torch and transformers stay off the CLI's import
        from vramsweep.check import run_check
    except ImportError as exc:
        return _err(f"check is not available: {exc}", "check")
    return run_check(list(args.overrides))


def cmd_report(args: argparse.Namespace) -> int:
    try:
        from vramsweep.report import run_report
    except ImportError as exc:
        return _err(f"reports are not available: {exc}", "report")
    return run_report(args.target, study=args.study, out_dir=args.out, wandb=args.wandb)


def cmd_pick(args: argparse.Namespace) -> int:
    try:
        from vramsweep.report import run_pick
    except ImportError as exc:
        return _err(f"pick is not available: {exc}", "pick")
    return run_pick(
        args.target,
        budget_gib=args.budget_gib,
        min_tokens_per_s=args.min_tokens_per_s,
        prefer=args.prefer,
        headroom_gib=args.headroom_gib,
        name=args.name,
        conf_dir=args.config_dir,
        study=args.study,
    )


def cmd_env(args: argparse.Namespace) -> int:
    try:
        from vramsweep.envreport import run_env
    except ImportError as exc:
        return _err(f"env is not available: {exc}", "env")
    return run_env(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    """The ``vramsweep`` parser: one sub-parser per verb (``train``, ``estimate``, ``report``, ``pick``, the
    verbs of :func:`add_parsers`, ``env``), each with its ``func``."""
    groups = _groups_text()
    p = Parser(
        prog="vramsweep",
        description="Ablation sweeps for memory-bounded LLM fine-tuning.",
        epilog=main_epilog(groups),
    )
    p.add_argument("--version", action="version", version=f"vramsweep {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(VERBS) + "}")
    _add_train_parser(sub, groups)
    _add_estimate_parser(sub)
    _add_data_parser(sub)
    _add_check_parser(sub)
    _add_report_parser(sub)
    _add_pick_parser(sub)
    add_parsers(sub)
    _add_env_parser(sub)
    return p


def _add_config_dir(sp: argparse.ArgumentParser, what: str) -> None:
    """``--config-dir``/``-cd``: the user's conf dir; ``what`` says what the verb reads (or writes) there."""
    sp.add_argument(
        "--config-dir",
        "-cd",
        metavar="DIR",
        default=None,
        help=f"your conf dir, layered over the packaged defaults: {what} "
        f"(default: ${CONFIG_DIR_ENV}, else ./conf if present)",
    )


def _add_train_parser(sub, groups: str) -> None:
    """``vramsweep train``: one trial, or a sweep with ``-m``; ``--cfg``/``--info`` print and run nothing."""
    t = sub.add_parser(
        "train",
        help="run one trial (or a sweep with -m)",
        epilog=EPILOG_TRAIN.format(groups=groups, docs=verb_epilog("train")),
    )
    t.add_argument("-m", "--multirun", action="store_true", help="run a sweep (use with sweep=<name>)")
    t.add_argument(
        "--cfg",
        "-c",
        nargs="?",
        const="job",
        default=None,
        metavar="{job,hydra,all}",
        help="print the composed config (job: the trial's, hydra: Hydra's, all: both) and run nothing",
    )
    t.add_argument(
        "--info",
        nargs="?",
        const="all",
        default=None,
        metavar="{all,config,defaults,defaults-tree,plugins,searchpath}",
        help="print Hydra's information (config search path, defaults, plugins) and run nothing",
    )
    t.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. quant=nf4 adapter.r=64")
    t.set_defaults(func=cmd_train)
    _add_config_dir(t, "your experiments, sweeps and extra options")


def _add_estimate_parser(sub) -> None:
    """``vramsweep estimate``: the peak-memory estimate, its calibration, longest context and suggestions."""
    e = sub.add_parser(
        "estimate",
        help="predict peak memory and its breakdown (no weights needed)",
        epilog=verb_epilog("estimate"),
    )
    e.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    e.add_argument(
        "--calibrate", metavar="SWEEP_DIR", help="fit activation constants from a sweep's measured trials"
    )
    e.add_argument(
        "--max-context",
        action="store_true",
        help="print the longest context.max_tokens whose estimate fits hardware.budget_gib",
    )
    e.add_argument(
        "--suggest",
        action="store_true",
        help="the cheapest knob changes that fit hardware.budget_gib (with --calibrate SWEEP_DIR: "
        "calibrated)",
    )
    e.add_argument(
        "--any-install",
        action="store_true",
        help="with --suggest: also search options whose package is not installed here (for a card elsewhere)",
    )
    e.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=qwen3_8b quant=nf4_dq")
    e.set_defaults(func=cmd_estimate)
    _add_config_dir(e, "your experiments and extra options")


def _records(text: str) -> int | None:
    if text == "all":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--records={text} (allowed: a number >= 0, or all)")
    return int(text)


def _add_data_parser(sub) -> None:
    """``vramsweep data``: records as the trial sees them, trained tokens marked, counts."""
    d = sub.add_parser(
        "data",
        help="show the records as the trial sees them: trained tokens marked, counts, lengths",
        epilog=verb_epilog("data"),
    )
    d.add_argument(
        "--records",
        type=_records,
        default=3,
        metavar="N",
        help="training examples shown: a number, or all (default: 3)",
    )
    d.add_argument(
        "--json",
        action="store_true",
        help="JSON Lines: one object per example, then a summary (default: marked text)",
    )
    d.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=file data.path=chats.jsonl")
    d.set_defaults(func=cmd_data)
    _add_config_dir(d, "your experiments and extra options")


def _add_check_parser(sub) -> None:
    """``vramsweep check``: accumulation, eval-then-train, packing, resume, stop-token checks on a proxy."""
    c = sub.add_parser(
        "check",
        help="prove the training maths on the config: a small random proxy on the CPU, PASS/FAIL lines",
        epilog=verb_epilog("check"),
    )
    c.add_argument("overrides", nargs="*", help="Hydra overrides, as for train, e.g. quant=nf4 adapter=dora")
    c.set_defaults(func=cmd_check)
    _add_config_dir(c, "your experiments and extra options")


def _add_report_parser(sub) -> None:
    """``vramsweep report``: a sweep's tables, Pareto front and importances."""
    r = sub.add_parser(
        "report", help="ablation tables, Pareto front, importances for a sweep", epilog=verb_epilog("report")
    )
    r.add_argument("target", help="sweep folder, or a storage URL (with --study)")
    r.add_argument("--study", help="study name when target is a storage URL (default: the only study there)")
    r.add_argument("--out", metavar="DIR", help="output folder (default: the sweep folder)")
    r.add_argument("--wandb", action="store_true", help="also log a sweep-summary W&B run")
    r.set_defaults(func=cmd_report)


def _add_pick_parser(sub) -> None:
    """``vramsweep pick``: a pinned production config from a sweep, within a memory budget."""
    k = sub.add_parser(
        "pick", help="write a pinned production config that fits a memory budget", epilog=verb_epilog("pick")
    )
    k.add_argument(
        "target", help="sweep folder (or its sweep.json / study.db), or a storage URL (with --study)"
    )
    k.add_argument("--study", help="study name when target is a storage URL (default: the only study there)")
    k.add_argument(
        "--budget-gib",
        type=float,
        required=True,
        metavar="GIB",
        help="memory budget the config's measured peak must fit, in GiB (required)",
    )
    k.add_argument(
        "--min-tokens-per-s",
        type=float,
        default=None,
        metavar="N",
        help="only configs at least this fast (default: no floor)",
    )
    k.add_argument(
        "--prefer",
        choices=("quality", "speed"),
        default="quality",
        help="among the configs that fit: lowest eval loss (quality) or most tokens/s (speed)",
    )
    k.add_argument(
        "--headroom-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="keep this much of the budget free",
    )
    k.add_argument(
        "--name",
        default=None,
        help="experiment name, written to <conf dir>/experiment/<name>.yaml (default: <sweep>_<budget>gib)",
    )
    k.set_defaults(func=cmd_pick)
    _add_config_dir(k, "where experiment/<name>.yaml is written (created if missing)")


def _add_env_parser(sub) -> None:
    """``vramsweep env``: the environment report for bug reports."""
    v = sub.add_parser(
        "env",
        help="Python, torch, CUDA, GPU, optional packages, and which knob options run here (for bug reports)",
        epilog=verb_epilog("env"),
    )
    v.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    v.set_defaults(func=cmd_env)


def main(argv: list[str] | None = None) -> int:
    """``vramsweep`` (the console script): run a verb, return its exit code.

    A reader that closes the pipe early (``vramsweep --help | head -1``) ends the command quietly with
    exit code 141 (128 + SIGPIPE, what a shell reports for a tool killed by it), not a traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python's recipe (docs: signal, "Note on SIGPIPE"): point stdout at devnull so that the flush at
        # exit does not raise a second time
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


def _main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    quiet_terminal_warnings()  # e.g. Liger's Ascend-backend import warning; trial logs keep it
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a refusal, already printed as one error line (--help exits 0 as before)
        if exc.code == 2:
            return 2
        raise
    if not getattr(args, "command", None):
        return _err(f"no verb given (allowed: {', '.join(VERBS)}; usage: vramsweep --help)", "")
    if args.command in COMPOSING:
        try:
            check_internal_options(list(args.overrides))
        except ValueError as exc:
            return _err(str(exc), args.command)
    if args.command in COMPOSING:  # (pick creates its --config-dir when it writes)
        # exported, so trial processes and workers compose from the same search path whatever their folder
        try:
            if args.config_dir is not None:
                use_conf_dir(args.config_dir)
            elif CONFIG_DIR_ENV not in os.environ and (found := user_conf_dir()) is not None:
                use_conf_dir(found)  # ./conf
        except ConfigError as exc:
            return _err(str(exc), args.command)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
