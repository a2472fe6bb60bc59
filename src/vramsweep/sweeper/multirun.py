"""``vramsweep train -m sweep=<name> [overrides]``: Hydra multirun with the vramsweep sweeper."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from vramsweep.config.compose import (
    ConfigError,
    hydra_state,
    list_options,
    packaged_conf_dir,
    translate_hydra_error,
)
from vramsweep.config.errors import error_line
from vramsweep.config.paths import misplaced_hint
from vramsweep.config.schema import register_configs
from vramsweep.sweeper.trialproc import execute, load_spec

SWEEP_DIR = "${results_dir}/sweeps/${oc.select:sweep.name,multirun}"
#: Set by the sweeper when Hydra hands over to it (tells Hydra's own input errors from ours).
SWEEPER_STARTED = False


def _has(args: list[str], prefix: str) -> bool:
    return any(a.lstrip("+").startswith(prefix) for a in args)


def _value(args: list[str], prefix: str) -> str | None:
    vals = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith(prefix)]
    return vals[-1] if vals else None


def translate_args(args: list[str]) -> list[str]:
    """What a Hydra user types -> what our sweeper reads.

    ``sweep.name=x`` names the sweep (its folder and study) even without a sweep file (``sweep`` is null
    then, so Hydra itself would reject the key); ``hydra.sweep.dir=/x`` is the sweep folder.

    Raises:
        ConfigError: ``hydra.sweep.dir`` and ``hydra.sweeper.sweep_dir`` both given and different.
    """

    out = []
    for a in args:
        if a.lstrip("+").startswith("sweep.name="):
            out.append(f"hydra.sweeper.study_name={a.split('=', 1)[1]}")
        else:
            out.append(a)
    hydra_dir = _value(out, "hydra.sweep.dir=")
    sweeper_dir = _value(out, "hydra.sweeper.sweep_dir=")
    if hydra_dir is not None:
        if sweeper_dir is not None and sweeper_dir != hydra_dir:
            raise ConfigError(
                f"hydra.sweep.dir={hydra_dir} and hydra.sweeper.sweep_dir={sweeper_dir} disagree: give one",
                key="hydra.sweep.dir",
            )
        if sweeper_dir is None:
            out.append(f"hydra.sweeper.sweep_dir={hydra_dir}")
    return out


def check_option_names(args: list[str]) -> None:
    """``sweep=<name>`` / ``experiment=<name>`` must name a file (Hydra skips an unknown optional sweep
    and takes ``+experiment=x`` as a plain value when no experiment exists yet).

    Raises:
        ConfigError: an unknown name, with the known ones.
    """

    for a in args:
        key, eq, text = a.partition("=")
        group = key.lstrip("+~").strip()
        if not eq or group not in ("sweep", "experiment") or a.lstrip().startswith("~"):
            continue
        names = (
            [n.strip() for n in text.split(",")] if not text.strip().startswith(("choice(", "glob(")) else []
        )
        known = list_options(group)
        for n in names:
            if n and n != "null" and n not in known:
                hint = (
                    ""
                    if known
                    else " (none yet: `vramsweep pick` writes experiment/<name>.yaml into your conf "
                    "dir, ./conf)"
                )
                hint += misplaced_hint(group, n)
                raise ConfigError(f"unknown {group} '{n}'{hint}", key=group, allowed=known or None)


def sweep_overrides(args: list[str]) -> list[str]:
    """The arguments that are sweeps (``a,b``, ``choice``, ``range``, ``interval``, ``glob``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for a in args:
        try:
            if parser.parse_overrides([a])[0].is_sweep_override():
                out.append(a)
        except Exception:
            continue  # Hydra reports it
    return out


def hydra_args(args: list[str]) -> list[str]:
    """The Hydra command line for a sweep: our sweeper, the sweep folder as ``hydra.sweep.dir``, no chdir."""
    extra = []
    if not _has(args, "hydra/sweeper="):
        extra.append("hydra/sweeper=vramsweep")
    if not _has(args, "hydra.sweep.dir="):
        extra.append(f"hydra.sweep.dir={SWEEP_DIR}")
    if not _has(args, "hydra.sweep.subdir="):
        extra.append("hydra.sweep.subdir=jobs/${hydra.job.num}")  # only the launcher isolation makes job dirs
    if not _has(args, "hydra.job.chdir="):
        extra.append("hydra.job.chdir=False")
    return ["-m", *extra, *args]


def _task(cfg: Any) -> Any:
    """Hydra's task function.

    With ``hydra.sweeper.isolation=launcher`` the sweeper hands each trial to the Hydra launcher
    (``hydra/launcher=submitit_slurm``...) with ``VRAMSWEEP_TRIAL_SPEC`` pointing at its spec: run it
    exactly as a fork-server child would (result JSON, pruning reports through the storage). Otherwise
    (another sweeper, e.g. ``hydra/sweeper=basic``) run one trial from the composed config.
    """
    import os

    spec_path = os.environ.get("VRAMSWEEP_TRIAL_SPEC")
    if spec_path:
        return execute(load_spec(spec_path)).get("status")
    from omegaconf import OmegaConf

    from vramsweep.trial import run_trial

    return run_trial(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))


def _command_line_error(exc: Exception) -> int:
    """Hydra rejected the command line before our sweeper ran: one line, exit 2 (like ``vramsweep train``)."""

    print(error_line("train", str(translate_hydra_error(exc))), file=sys.stderr)
    return 2


@contextlib.contextmanager
def logging_state() -> Iterator[None]:
    """Give the caller's logging configuration back after a Hydra run in this process.

    Hydra configures logging for its run (``logging.config.dictConfig``: handlers bound to the streams of
    that moment on the root logger, levels, disabled loggers). Left in place, a later in-process run writes
    through handlers whose stream has gone (a closed capture: "--- Logging error ---" on stderr) or at levels
    nobody asked for. The root logger and every logger that existed before are restored (handlers, level,
    propagation, disabled flag); loggers first made during the run (libraries imported then, which set
    their own levels) keep what they set, less any handler on a closed stream."""
    import logging

    manager = logging.Logger.manager
    saved = {
        name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
        for name, lg in list(manager.loggerDict.items())
        if isinstance(lg, logging.Logger)
    }
    root = (list(logging.root.handlers), logging.root.level)
    try:
        yield
    finally:
        logging.root.handlers[:] = root[0]
        logging.root.setLevel(root[1])
        for name, lg in list(manager.loggerDict.items()):
            if not isinstance(lg, logging.Logger):
                continue
            if name not in saved:
                lg.handlers[:] = [
                    h for h in lg.handlers if not getattr(getattr(h, "stream", None), "closed", False)
                ]
                continue
            handlers, level, propagate, disabled = saved[name]
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


def run_multirun(args: list[str], *, flags: list[str] | None = None, multirun: bool = True) -> int:
    """Run Hydra's multirun with our sweeper, as if ``vramsweep -m <args>`` was typed.

    Args:
        flags: Hydra flags such as ``["--cfg", "job"]`` or ``["--info"]``: Hydra prints and runs nothing.
        multirun: ``False`` only with ``flags`` (``vramsweep train --cfg hydra``).

    Returns:
        the exit code: 0 done, 1 aborted (failure-rate cap, Ctrl-C) or Hydra error, 2 bad config/space.
    """
    import hydra

    try:
        check_option_names(list(args))
        args = translate_args(list(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    register_configs()
    # the user's conf dir goes in front of the packaged one through the search-path plugin
    main = hydra.main(config_path=str(packaged_conf_dir()), config_name="train", version_base=None)(_task)
    saved = sys.argv
    if flags:
        # Hydra prints (--cfg/--info) in run mode only: the sweep's base config, without its sweep overrides
        swept = sweep_overrides(args)
        base = [a for a in args if a not in swept]
        argv = hydra_args(base)[1:] if multirun else base
        argv += [] if _has(argv, "hydra.job.chdir=") else ["hydra.job.chdir=False"]
        if swept and "--cfg" in flags:
            print(f"# the sweep's base config; each trial adds one point of: {' '.join(swept)}", flush=True)
    else:
        argv = hydra_args(list(args))
    sys.argv = ["vramsweep", *(flags or []), *argv]
    global SWEEPER_STARTED
    SWEEPER_STARTED = False
    code: Any = 0
    saved_full = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its search path and hints
    try:
        with hydra_state(), logging_state():
            main()
    except SystemExit as exc:
        code = exc.code
    # broad on purpose: before the sweeper starts, any Hydra error is the command line's
    except Exception as exc:
        if SWEEPER_STARTED:
            raise  # a bug past the command line: the traceback is the useful output
        code = _command_line_error(exc)
    finally:
        sys.argv = saved
        if saved_full is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full
    if code is None:
        return 0
    if code == 1 and not SWEEPER_STARTED:
        # Hydra rejected the command line (override syntax, unknown option or key) before our sweeper
        # ran; it printed why. Bad input exits 2, like `vramsweep train`.
        return 2
    return code if isinstance(code, int) else 1


def main() -> None:
    """``python -m vramsweep.sweeper sweep=<name> [overrides]``."""
    sys.exit(run_multirun(sys.argv[1:]))
