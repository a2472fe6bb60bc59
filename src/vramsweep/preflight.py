"""Pre-flight: checks that run before any model is built, any trial is spent or any file is written.

``vramsweep train`` (one trial), ``vramsweep train -m`` and every sweep worker call :func:`preflight`
(or the single checks) right after the config is composed and validated. Each check raises
:class:`~vramsweep.config.compose.ConfigError` with one line naming the key, the file (``file:line``
for data) and what would be accepted; the CLI prints it as ``vramsweep train: error: ...`` and exits 2.
Nothing here leaves a file behind: the writability probe is created and removed in the nearest folder
that already exists, and no folder is created.

Checks:

* ``results_dir`` (or the sweep folder) is writable: a probe file, then removed;
* enough free disk there for the results (:data:`MIN_FREE_BYTES` plus :data:`PER_TRIAL_BYTES` a trial);
* ``data=jsonl`` files parse (every line: UTF-8, JSON, the document fields; see
  :func:`vramsweep.data.documents.load_jsonl`);
* ``model.path``'s ``config.json`` is readable JSON with the dimensions the estimator needs;
* named config options exist: ``sweep=<name>`` (the group is optional, so Hydra would silently ignore a
  typo) and ``+experiment=<name>`` (:func:`check_option`, shared with the sweeper);
* ``VRAMSWEEP_FAULT`` (the fault-injection test hook) has one of the forms the trial understands;
* host memory: the pinned pool of ``checkpointing=offload`` (the estimator's ``host_bytes``) fits in the
  RAM this machine has available (:func:`check_host_memory`; the trial itself checks again and records
  ``host_oom`` without building anything).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, list_options
from vramsweep.config.rules import FAULT_KINDS, FAULT_RE, check_fault_env  # noqa: F401 - re-exported
from vramsweep.estimate.dims import check_model_config

#: Free disk required in the results folder before anything runs (result JSONs, logs, plots, study.db).
MIN_FREE_BYTES = 64 * 2**20
#: Added per trial of a sweep (a result JSON is ~10 KiB, a trial log up to ~100 KiB; generous).
PER_TRIAL_BYTES = 1 * 2**20
#: ``VRAMSWEEP_FAULT`` forms (see ``vramsweep.trial._fault``): ``<kind>@<step>``.


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def check_writable(path: str | os.PathLike, *, key: str = "results_dir", label: str | None = None) -> Path:
    """Raise unless files can be created at ``path`` (or, when it does not exist yet, where it would be
    created). A probe file is written and removed; no folder is created. Returns the probed folder."""
    target = Path(str(path))
    what = label or f"{key}={str(path)!r}"
    where = _existing_ancestor(target)
    if not where.is_dir():
        raise ConfigError(
            f"{what}: {where} is a file, not a folder", key=key, allowed=["<a writable folder>"]
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".vramsweep-probe-", dir=where)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{what} is not writable (cannot create a file in {where}: {why})",
            key=key,
            allowed=["<a writable folder>"],
        ) from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return where


def check_disk(
    path: str | os.PathLike, n_trials: int = 1, *, key: str = "results_dir", label: str | None = None
) -> None:
    """Raise when the disk holding ``path`` has less free space than the results need."""
    where = _existing_ancestor(Path(str(path)))
    need = MIN_FREE_BYTES + max(0, int(n_trials)) * PER_TRIAL_BYTES
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # cannot tell: the writability probe already ran
    if free < need:
        raise ConfigError(
            f"{label or f'{key}={str(path)!r}'}: only {free / 2**20:.0f} MiB free on {where}, need at least "
            f"{need / 2**20:.0f} MiB for {n_trials} trial(s)",
            key=key,
            allowed=["<a folder on a disk with free space>"],
        )


def check_jsonl(path: str | os.PathLike, *, key: str = "data.path") -> None:
    """Raise ``<key>: <file>:<line>: <problem>`` unless ``path`` is a valid documents JSONL file."""
    from vramsweep.data.documents import load_jsonl

    try:
        load_jsonl(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}={str(path)!r} does not exist", key=key, allowed=["<path to .jsonl>"]
        ) from None
    except (OSError, ValueError) as exc:  # load_jsonl's messages are "<file>:<line>: <problem>"
        raise ConfigError(f"{key}: {exc}", key=key) from None


def check_option(group: str, name: str, *, hint: str = "") -> None:
    """Raise unless ``<group>/<name>.yaml`` is on the config search path (names the options; shared with
    the sweeper)."""
    opts = [o for o in list_options(group) if not o.startswith("base_")]
    if name not in opts:
        raise ConfigError(
            f"unknown {group} '{name}'" + (f" ({hint})" if hint else ""),
            key=group,
            allowed=opts or ["(none yet)"],
        )


def named_options(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """``(group, name)`` of the ``sweep=`` / ``+experiment=`` overrides on a command line."""
    out = []
    for ov in overrides:
        key, sep, value = ov.lstrip("+").partition("=")
        # a list/function (sweep=a,b, glob(...)) is the sweeper's to refuse, with its own message
        if (
            sep
            and key in ("sweep", "experiment")
            and value
            and value != "null"
            and not set(value) & set(",()*")
        ):
            out.append((key, value))
    return out


def check_named_options(overrides: Iterable[str]) -> None:
    hints = {
        "experiment": "write one with vramsweep pick",
        "sweep": "a file sweep/<name>.yaml in your conf dir or the packaged conf",
    }
    for group, name in named_options(overrides):
        check_option(group, name, hint=hints[group])


def check_inputs(cfg: Any) -> None:
    """The input files a config names: ``data=jsonl`` files and ``model.path``'s config.json."""
    if str(cfg.data.source) == "jsonl":
        for key in ("path", "eval_path"):
            p = cfg.data.get(key)
            if p:
                check_jsonl(str(p), key=f"data.{key}")
    if str(cfg.model.source) == "path" and cfg.model.get("path"):
        check_model_config(str(cfg.model.path))


def available_host_bytes() -> int:
    """RAM available for new allocations without swapping (``MemAvailable``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_memory(cfg: Any, available: int | None = None) -> None:
    """Raise when the host memory the config needs beside the device (the page-locked pool of
    ``checkpointing=offload``: layers x tokens x hidden x dtype) exceeds the RAM available here; the error
    names both figures and the longest context that would fit."""
    from vramsweep.estimate import estimate
    from vramsweep.record.units import GIB

    if str(cfg.hardware.device) != "cuda":
        return
    need = int(estimate(cfg, calibration=False).get("host_bytes") or 0)
    if need <= 0:
        return
    have = available_host_bytes() if available is None else int(available)
    if need <= have:
        return
    tokens = int(cfg.context.max_tokens)
    fits = max(0, tokens * have // need)
    raise ConfigError(
        f"checkpointing=offload needs {need / GIB:.2f} GiB of pinned host memory for the layer inputs at "
        f"context.max_tokens={tokens} x train.micro_batch={int(cfg.train.micro_batch)}, but this machine has "
        f"{have / GIB:.2f} GiB of RAM available",
        key="checkpointing",
        allowed=[f"context.max_tokens<={fits}", "checkpointing=on", "a machine with more RAM"],
    )


def preflight(
    cfg: Any,
    *,
    overrides: Iterable[str] = (),
    results_dir: str | os.PathLike | None = None,
    n_trials: int = 1,
    key: str = "results_dir",
) -> None:
    """Every pre-flight check for a composed, validated ``cfg``; raise :class:`ConfigError` on the first
    problem. ``results_dir`` defaults to ``cfg.results_dir`` (a sweep passes its sweep folder)."""
    check_fault_env()
    check_named_options(overrides)
    where = results_dir if results_dir is not None else str(cfg.results_dir)
    check_writable(where, key=key)
    check_disk(where, n_trials, key=key)
    check_inputs(cfg)
    check_host_memory(cfg)


#: Overrides whose value is an input file or folder (checked for every value a sweep can take).
_INPUT_KEYS = {"data.path": "jsonl", "data.eval_path": "jsonl", "model.path": "model"}


def _input_values(plan: Any) -> list[tuple[str, str]]:
    """``(key, value)`` of every input-path override a sweep plan can run with (fixed, space, design)."""
    out: list[tuple[str, str]] = []

    def add(ov: str) -> None:
        key, sep, value = ov.lstrip("+").partition("=")
        if sep and key in _INPUT_KEYS and value not in ("", "null"):
            out.append((key, value.strip("'\"")))

    for ov in getattr(plan, "fixed", None) or []:
        add(ov)
    for d in getattr(plan, "dims", None) or []:
        if d.key in _INPUT_KEYS and getattr(d, "discrete", False):
            for v in d.values:
                add(f"{d.key}={v}")
    for point in getattr(plan, "design", None) or []:
        for ov in point.overrides:
            add(ov)
    return out


SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL (``None`` for other backends)."""
    if not url.startswith("sqlite:"):
        return None
    path = url.split(":///", 1)[1] if ":///" in url else ""
    return Path(path) if path and path != ":memory:" else None


def check_study_file(storage_url: str) -> None:
    """An existing SQLite study file must be a database (a torn copy or another file is named)."""
    path = sqlite_path(storage_url)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ConfigError(
            f"hydra.sweeper.storage: cannot read {path}: {exc.strerror or exc}", key="hydra.sweeper.storage"
        ) from None
    if head != SQLITE_MAGIC:
        raise ConfigError(
            f"hydra.sweeper.storage: {path} is not a SQLite database: move it aside (the result JSONs next to "
            "it are kept) or use another hydra.sweeper.study_name/sweep_dir",
            key="hydra.sweeper.storage",
        )


def preflight_sweep(plan: Any, task_cfg: dict[str, Any], arguments: Iterable[str] = ()) -> None:
    """The pre-flight of ``vramsweep train -m`` and of every worker, before the study or any folder is
    made: sweep/experiment names, the sweep folder writable with disk to spare, every input file the
    sweep can use parses. Raises :class:`ConfigError`."""
    from omegaconf import OmegaConf

    args = list(arguments)
    check_fault_env()
    check_named_options(args)
    sweep_dir = plan.settings.sweep_dir
    key = "hydra.sweeper.sweep_dir" if any("hydra.sweeper.sweep_dir=" in a for a in args) else "results_dir"
    label = f"{key}: the sweep folder {sweep_dir}"
    check_writable(sweep_dir, key=key, label=label)
    check_disk(sweep_dir, int(plan.n_total), key=key, label=label)
    check_study_file(plan.settings.storage)
    cfg = OmegaConf.create(task_cfg)
    seen: set[tuple[str, str]] = set()
    if str(OmegaConf.select(cfg, "data.source")) == "jsonl":
        for key in ("path", "eval_path"):
            p = OmegaConf.select(cfg, f"data.{key}")
            if p:
                seen.add((f"data.{key}", str(p)))
    if str(OmegaConf.select(cfg, "model.source")) == "path" and OmegaConf.select(cfg, "model.path"):
        seen.add(("model.path", str(cfg.model.path)))
    for item in _input_values(plan):
        seen.add(item)
    for key, value in sorted(seen):
        if _INPUT_KEYS[key] == "jsonl":
            check_jsonl(value, key=key)
        else:
            check_model_config(value, key=key)
