"""A trial's production-run wiring (docs/RUNS.md): the run folder's name and place, the data fingerprints,
resuming from the newest checkpoint, what a checkpoint keeps besides tensors, and a run's callbacks (the
loss log, the checkpointer, plain progress lines). The trial (:mod:`vramsweep.trial`) calls these; a sweep
trial without a run folder gets None or nothing from each.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.loop import Callback
from vramsweep.production.checkpoint import (
    Checkpointer,
    Resume,
    check_same_config,
    load_newest,
    saved_wandb_id,
)
from vramsweep.production.fingerprint import (
    check_pinned,
    check_resume_data,
    data_fingerprints,
    unverified_line,
)
from vramsweep.production.outputs import LossLog, RunFolder
from vramsweep.production.progress import ProgressLines

#: the longest run name in UTF-8 bytes (the run folder adds a 23-byte time stamp; a name holds 255 bytes)
RUN_NAME_BYTES = 120


def run_name(overrides: list[str] | tuple[str, ...]) -> str:
    """A run's folder-safe name from its overrides: separators replaced, at most :data:`RUN_NAME_BYTES`
    bytes of UTF-8 (an 80-character CJK file name is 240 bytes: cut at characters, it was ``File name too
    long`` at the result write); a cut name ends in ``-`` and 8 hex digits of the full name's SHA-1, so two
    long names that share a prefix stay two folders."""
    if not overrides:
        return "default"
    keep = [o.replace("/", "_").replace("\\", "_").replace("=", "-").replace(",", "_") for o in overrides]
    name = "".join(c if c.isprintable() and c != "\x00" else "_" for c in "_".join(keep))
    raw = name.encode("utf-8")  # surrogates are not printable: already replaced
    if len(raw) <= RUN_NAME_BYTES:
        return name
    digest = hashlib.sha1(raw).hexdigest()[:8]
    head = raw[: RUN_NAME_BYTES - 9].decode("utf-8", "ignore")  # "ignore": never half a character
    return f"{head}-{digest}"


def default_result_path(cfg: DictConfig, overrides) -> Path:
    """``<run folder>/result.json``: ``train.output_dir`` when set; with ``train.resume=auto``, the newest
    ``<results_dir>/runs/*_<name>`` of the same overrides (``train.resume`` aside); else a new stamped folder.
    Resuming checks the run's pinned config first (``ConfigError`` naming the keys that differ)."""

    same = [o for o in overrides if not o.lstrip("+").startswith("train.resume=")]
    runs = Path(str(cfg.results_dir)) / "runs"
    folder = None
    if cfg.train.get("output_dir"):
        folder = Path(str(cfg.train.output_dir))
    elif str(cfg.train.get("resume", "never")) == "auto" and runs.is_dir():
        mine = sorted(p for p in runs.iterdir() if p.is_dir() and p.name.endswith(f"_{run_name(same)}"))
        folder = mine[-1] if mine else None
    if folder is not None and str(cfg.train.get("resume", "never")) == "auto":
        check_same_config(folder, OmegaConf.to_container(cfg, resolve=True))
    if folder is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        folder = runs / f"{stamp}_{run_name(same)}"
    return folder / "result.json"


def data_sources(cfg: DictConfig) -> dict:
    """The hashes ``pick`` pinned beside the data paths checked; the sha256 of every data file (recorded in
    the result and every checkpoint, docs/RUNS.md)."""
    check_pinned(cfg)
    return data_fingerprints(cfg)


def progress_lines(cfg: DictConfig, run, progress, timing, peak, start: int) -> list:
    """A production run without a progress bar (its output is a log): :class:`ProgressLines` (``progress``:
    the trial's progress bar, ``timing``: its step timing, ``peak``: its tracked peak so far)."""
    if run is None or not run.production or progress.bar is not None:
        return []
    if os.environ.get("VRAMSWEEP_PROGRESS", "1") == "0":
        return []

    def peak_bytes() -> int | None:
        if progress.cuda:
            import torch

            return int(torch.cuda.max_memory_reserved())
        return peak.bytes

    t = cfg.train
    every_steps, every_s = int(t.get("progress_every_steps", 0)), float(t.get("progress_every_s", 60))
    return [
        ProgressLines(
            int(t.steps),
            start,
            every_steps=every_steps,
            every_s=every_s,
            tokens_per_s=timing.tokens_per_s,
            peak_bytes=peak_bytes,
        )
    ]


def run_outputs(
    cfg: DictConfig,
    run: RunFolder | None,
    resume: Resume | None,
    callbacks: tuple[Any, Any],
    trained: tuple,
    logger,
    result: dict,
    metrics: Callable[[], dict],
) -> tuple[list[Callback], Checkpointer | None]:
    """A run folder's callbacks: the loss log, and in a production run the checkpointer (docs/RUNS.md).
    ``callbacks``: the trial's train-loss and periodic-eval callbacks (a resumed run's losses so far go to
    the first, the second prints its evaluations); ``metrics``: the trial's metrics so far."""
    train_loss, evals = callbacks
    if run is None:
        return [], None
    rows = resume.state["losses"] if resume is not None else []
    train_loss.losses = [r["loss"] for r in rows]
    log = LossLog(run, trained[2], rows)
    if not run.production:
        return [log], None
    evals.say = True
    t = cfg.train
    ckpt = Checkpointer(
        run.path,
        int(t.save_every),
        int(t.keep_checkpoints),
        *trained,
        state_so_far(log, metrics, logger, result),
        int(t.steps),
        stats=result["meta"].setdefault("checkpoints", {}),
    )
    return [log, ckpt], ckpt


def resumed_wandb_id(cfg: DictConfig, run: RunFolder | None) -> str | None:
    """The W&B run id to reopen: ``train.resume=auto`` in a production run folder with a checkpoint."""
    if run is None or not run.production or str(cfg.train.resume) != "auto":
        return None
    return saved_wandb_id(run.path)


def resume_point(cfg: DictConfig, run: RunFolder | None, result: dict) -> Resume | None:
    """``train.resume=auto`` in a run folder with a complete checkpoint: that checkpoint, loaded."""
    if run is None or not run.production or str(cfg.train.resume) != "auto":
        return None
    resume, broken = load_newest(run.path)  # a checkpoint that fails to load: named, the older one used
    for path, why in broken:
        older = f"resuming from {resume.path}" if resume is not None else "no older complete one"
        say(f"checkpoint {path} cannot be loaded ({why}); moved aside; {older}")
    if resume is None:
        if broken:
            raise RuntimeError(
                f"train.resume=auto: no checkpoint of {run.path} loads (newest: {broken[0][0]})"
            )
        result["meta"]["resumed_from"] = None
        return None
    path = resume.path
    keep_run_threads(cfg, resume.state, result["meta"])
    changes = check_resume_data(path, cfg)  # changed data: refused unless train.resume_on_changed_data
    result["meta"]["resumed_from"] = {"checkpoint": str(path), "next_step": resume.next_step}
    say(f"resumed from step {resume.next_step} of {int(cfg.train.steps)} (checkpoint {path})")
    if (note := unverified_line(path, changes)) is not None:  # a checkpoint from before data hashes
        say(note)
    if broken:
        result["meta"]["resumed_from"]["skipped"] = [{"checkpoint": str(p), "why": w} for p, w in broken]
    earlier = list(resume.state.get("data_changes") or [])
    if changes or earlier:  # the opt-in's record: what changed, at which step (kept by later checkpoints)
        now = [{**c, "at_step": resume.next_step} for c in changes]
        result["meta"]["data_changed_on_resume"] = earlier + now
    return resume


def keep_run_threads(cfg: DictConfig, state: dict, meta: dict) -> int | None:
    """A resumed run with ``train.threads=auto`` runs on the torch thread count its checkpoint recorded, not
    on what the load at this start suggests: another count can change the order of float reductions, and a
    resume on CPU is bitwise only on the same count (docs/RUNS.md). Returns the count set, None if nothing
    changed (a fixed ``train.threads``, a checkpoint without the count, or the same count already)."""
    import torch

    n = state.get("threads")
    if str(cfg.train.get("threads", "auto")) != "auto" or not n or torch.get_num_threads() == int(n):
        return None
    why = f"resumed: the run's own count ({int(n)}), not this start's choice ({torch.get_num_threads()})"
    torch.set_num_threads(int(n))
    meta["threads"] = {**(meta.get("threads") or {}), "threads": int(n), "why": why}
    if isinstance(meta.get("timing_conditions"), dict):
        meta["timing_conditions"]["torch_threads"] = int(n)
    return int(n)


def say(line: str) -> None:
    """One line on stderr for the person watching a production run."""
    print(f"vramsweep train: {line}", file=sys.stderr, flush=True)


def state_so_far(log: LossLog, metrics: Callable[[], dict], logger, result: dict) -> Callable[[], dict]:
    """What a checkpoint keeps besides tensors: the loss rows, the metrics so far, the W&B run id, the run's
    config and its data fingerprints (a resume checks both against them, docs/RUNS.md)."""

    def state() -> dict:
        run_id = getattr(getattr(logger, "run", None), "id", None)
        meta = result["meta"]
        return {
            "losses": list(log.rows),
            "metrics": json.loads(json.dumps(metrics(), default=str)),
            "wandb_run_id": run_id,
            "config": result["config"],
            "data": meta.get("data_sources"),
            "data_changes": meta.get("data_changed_on_resume") or [],
            "threads": (meta.get("threads") or {}).get("threads"),  # a resume with threads=auto keeps it
        }

    return state
