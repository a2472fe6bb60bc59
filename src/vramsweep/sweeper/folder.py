"""A sweep folder belongs to one study (issue 40 item 1).

:func:`folder_lock` is an ``flock`` on the sweep folder itself (no lock file: a refused sweep writes
nothing), held while a sweeper checks whose folder it is, writes ``sweep.json`` and creates or loads the
study, so two sweeps started together cannot both pass the checks. :func:`check_owner` refuses a folder
whose ``sweep.json`` names another study or storage (two differently named sweeps given the same
``hydra.sweep.dir`` overwrote each other's ``trials/NNNN.json``). :func:`check_evidence` refuses a folder
whose ``trials/`` holds result files the study does not know (a study copied without its ``study.db-wal``
lost commits: re-running would overwrite finished trials' results).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.preflight import sqlite_path
from vramsweep.sweeper.settings import mask_url

RESULT_NAME = re.compile(r"^(\d{4,})\.json$")


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[list[Path]]:
    """Hold an exclusive ``flock`` on ``folder`` (made when missing). Yields the folders this call made,
    deepest first, so a refusal can take them back (:func:`unmake`)."""
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(folder), os.O_RDONLY | os.O_DIRECTORY)
    try:
        # a filesystem without flock on folders (some NFS mounts emulate it with byte-range locks, which a
        # folder cannot take): the checks still run, unlocked, as before
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield made
    finally:
        os.close(fd)  # releases the lock


def unmake(made: list[Path]) -> None:
    """Remove the (still empty) folders :func:`folder_lock` made: a refused sweep leaves nothing."""
    for p in made:
        with contextlib.suppress(OSError):
            p.rmdir()


def check_owner(plan: Any) -> None:
    """``sweep.json`` of another study or storage in this folder: a ConfigError (exit 2)."""
    path = Path(plan.folder) / "sweep.json"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # a new folder (or one without a readable sweep.json: the study's identity decides)
    if not isinstance(recorded, dict):
        return
    theirs = (recorded.get("study_name"), recorded.get("storage"))
    ours = (plan.study_key, mask_url(plan.storage_url))
    if theirs == ours or None in theirs:
        return
    here = (plan.study_key, _in_folder(plan.storage_url, plan.folder))
    if (theirs[0], _in_folder(theirs[1], recorded.get("sweep_dir"))) == here and here[1] is not None:
        return  # the folder's own database, recorded where the folder lay before it was copied or moved
    raise ConfigError(
        f"sweep folder {plan.folder} belongs to sweep '{recorded.get('name')}' (study "
        f"'{theirs[0]}' in {theirs[1]}); this is sweep '{plan.name}' (study '{ours[0]}' in {ours[1]}): a "
        "sweep folder holds one study. Give this sweep its own folder (another hydra.sweep.dir, or leave it "
        "out: <results_dir>/sweeps/<name>)",
        key="hydra.sweep.dir",
    )


def _in_folder(storage: Any, sweep_dir: Any) -> str | None:
    """``<folder>/<file>`` when ``storage`` is a SQLite file inside ``sweep_dir`` (the sweep's own database,
    wherever the folder lies now), else None."""
    if not isinstance(storage, str) or not sweep_dir:
        return None
    path = sqlite_path(storage)
    if path is None or Path(os.path.abspath(path)).parent != Path(os.path.abspath(str(sweep_dir))):
        return None
    return f"<folder>/{path.name}"


def result_numbers(trials_dir: Path) -> list[int]:
    """Trial numbers of the result files (``NNNN.json``) in ``trials_dir``."""
    try:
        names = os.listdir(trials_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := RESULT_NAME.match(n)))


def check_evidence(plan: Any, on_disk: list[int], known: set[int] | None) -> None:
    """Result files of trials the study does not have (``known``: the numbers of its trials that ran or
    run, ``None``: no study): a ConfigError, since a re-run would give those numbers to new trials and
    overwrite the results. ``on_disk`` must be listed before ``known`` is read (a worker elsewhere writes a
    result only for a trial the study already has running)."""
    unknown = [n for n in on_disk if known is None or n not in known]
    if not unknown:
        return
    shown = ", ".join(f"{n:04d}.json" for n in unknown[:5]) + (
        f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    )
    what = (
        f"study '{plan.study_key}' does not exist"
        if known is None
        else f"study '{plan.study_key}' has no such trial(s)"
    )
    raise ConfigError(
        f"sweep folder {plan.folder}: trials/ holds result files of trials the study does not know "
        f"({shown}; {what}): its database lost commits (copied without study.db-wal?) or was replaced. "
        "Running would overwrite them: put the study's study.db-wal back next to study.db, or move the "
        "trials/ files away to keep them",
        key="hydra.sweep.dir",
    )
