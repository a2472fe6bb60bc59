"""Checkpoints of a production run and exact resume (docs/RUNS.md).

1. :class:`Checkpointer` (a loop :class:`~vramsweep.loop.Callback`) stages a checkpoint after every
   ``train.save_every``-th optimizer step, and after the step during which SIGTERM, SIGUSR1 (SLURM's
   pre-timeout signal by convention) or SIGUSR2 (submitit's) arrived: the trainable tensors (safetensors), the
   optimizer state (8-bit and paged states are ordinary tensors of its ``state_dict``), the scheduler, the RNG
   states (python, numpy, torch, CUDA), the data position (the next step; the batches are a pure function of
   the config), the metrics so far and the W&B run id.
2. The loop reads a step's loss one step late, so the checkpoint is completed when its step's loss arrives:
   ``state.json`` (losses and metrics so far), then the ``COMPLETE`` marker, fsynced, then the staging folder
   is renamed to ``checkpoints/step-NNNNNNNN``. A folder without the marker (a kill mid-write) is never
   used; the newest ``train.keep_checkpoints`` complete ones are kept.
3. :func:`latest_checkpoint` + :func:`load_checkpoint` give ``train.resume=auto`` the newest complete one;
   :func:`check_same_config` refuses a changed config, naming the keys that differ.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vramsweep.config.compose import ConfigError
from vramsweep.loop import Callback
from vramsweep.production.outputs import travelling_config
from vramsweep.record.atomic import fsync_dir

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
#: Keys that may differ between a run and its resumption (how it is launched, not what it trains).
RESUME_FREE_KEYS = (
    "train.resume",
    "train.resume_on_changed_data",
    "train.progress_every_steps",
    "train.progress_every_s",
    "train.threads",
    "logger.mode",
    "logger.dir",
)
#: Test hook: seconds to sleep after every optimizer step of a production run (a run long enough to be
#: signalled, requeued or timed out on a real cluster: tests/production/test_run_slurm.py).
PAUSE_ENV = "VRAMSWEEP_STEP_PAUSE_S"
#: Signals after which the run checkpoints and stops: SIGTERM (``scancel``, ``scontrol requeue``,
#: preemption), SIGUSR1 (``sbatch --signal=USR1@120``, the usual pre-timeout signal), SIGUSR2 (submitit's).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(RuntimeError):
    """SIGTERM/SIGUSR1/SIGUSR2 arrived: the run checkpointed and stopped (``train.resume=auto`` continues
    it)."""


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def rng_states() -> dict[str, Any]:
    """Python, numpy, torch CPU (and every CUDA device's) RNG states."""
    import numpy as np
    import torch

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def trainable_state(model: Any) -> dict[str, Any]:
    """The parameters that train, by name (LoRA A/B/magnitude, or every weight with ``adapter=full``)."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Resume:
    """A complete checkpoint, loaded: ``next_step`` is the first optimizer step still to run."""

    path: Path
    next_step: int
    state: dict[str, Any]  # state.json: losses, metrics, wandb id
    tensors: dict[str, Any]  # trainable parameters
    torch_state: dict[str, Any]  # optimizer, scheduler, rng

    def apply(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Put the checkpoint's weights, optimizer and scheduler state into the freshly built ones."""
        import torch

        params = dict(model.named_parameters())
        missing = sorted(set(self.tensors) - set(params))
        if missing:
            raise RuntimeError(f"{self.path}: checkpoint has parameters the model lacks: {missing[:3]}")
        with torch.no_grad():
            for n, t in self.tensors.items():
                params[n].copy_(t)
        optimizer.load_state_dict(self.torch_state["optimizer"])
        self.repaged = repage_optimizer_state(optimizer)
        master = getattr(optimizer, "fp32_master", None)  # adapter.dtype=compute: fp32 masters
        if master is not None:
            master.restore(optimizer)
        scheduler.load_state_dict(self.torch_state["scheduler"])

    repaged: int = 0  # paged optimizer state tensors put back into paged memory by apply()

    def restore_rng(self) -> None:
        set_rng_states(self.torch_state["rng"])


#: bitsandbytes' paged state: the per-parameter moment buffers ``init_state`` takes from ``get_state_buffer``
PAGED_STATE_KEYS = ("state1", "state2")
#: ``Optimizer8bit.get_state_buffer`` pages the buffers of parameters this large (bitsandbytes 0.50)
BNB_PAGED_MIN_NUMEL = 100_000


def _on_cuda(t: Any) -> bool:
    return t.device.type == "cuda"


def repage_optimizer_state(optimizer: Any) -> int:
    """Put a paged bitsandbytes optimizer's loaded state back into paged (unified) memory.

    bitsandbytes' ``Optimizer8bit.load_state_dict`` moves every state tensor to its parameter's device with
    ``.to()``: after a resume, the moments of a paged optimizer are ordinary device memory, inside PyTorch's
    allocator and its cap, and the resumed run's peak is not the original's. For each state buffer that
    ``get_state_buffer`` would have paged (a CUDA parameter of >= 100,000 elements), this allocates a paged
    buffer the same way (``get_state_buffer``: registered with bitsandbytes' page manager), copies the loaded
    values in and replaces the tensor. Returns how many were re-paged (0 for other optimizers and on CPU,
    where bitsandbytes pages nothing)."""
    if not getattr(optimizer, "is_paged", False) or not hasattr(optimizer, "get_state_buffer"):
        return 0
    n = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in PAGED_STATE_KEYS:
                t = state.get(key)
                if t is None or getattr(t, "is_paged", False) or not _on_cuda(p):
                    continue
                if p.numel() < BNB_PAGED_MIN_NUMEL or t.shape != p.shape:
                    continue
                buf = optimizer.get_state_buffer(p, dtype=t.dtype)
                buf.copy_(t)
                state[key] = buf
                n += 1
    return n


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of the run, oldest first (a folder without ``COMPLETE`` is skipped)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def saved_wandb_id(run_dir: Path) -> str | None:
    """The W&B run id the newest complete checkpoint of ``run_dir`` recorded (None: none, or unreadable),
    read without loading tensors, so a resumed run can reopen that W&B run before anything is built."""
    path = latest_checkpoint(Path(run_dir))
    if path is None:
        return None
    try:
        run_id = json.loads((path / "state.json").read_text()).get("wandb_run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run_id) if run_id else None


def load_checkpoint(path: Path) -> Resume:
    import torch
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "trainable.safetensors"))
    torch_state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
    return Resume(path, int(state["next_step"]), state, tensors, torch_state)


#: where a checkpoint that fails to load is moved (kept for inspection, never used or counted again)
BROKEN_PREFIX = ".broken-"


def load_newest(run_dir: Path) -> tuple[Resume | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``run_dir`` that loads, and the newer ones that did not (each with
    why). A broken one is moved to ``checkpoints/.broken-step-N`` so the run's new checkpoints are never
    pruned as older than it."""
    broken: list[tuple[Path, str]] = []
    for path in reversed(checkpoint_dirs(Path(run_dir))):
        try:
            return load_checkpoint(path), broken
        except Exception as exc:  # a torn or truncated file: safetensors, torch.load, json all differ
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            aside = path.with_name(f"{BROKEN_PREFIX}{path.name}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            broken.append((path, why))
    return None, broken


def remove_dead_staging(run_dir: Path) -> list[Path]:
    """Remove the staging folders (``checkpoints/.staging-step-N-<pid>``) and temporary files of writers that
    died; call only while holding the run folder's lock (no other writer is alive). Returns what went."""
    gone = []
    root = Path(run_dir) / CHECKPOINTS
    stale = list(root.glob(".staging-step-*")) if root.is_dir() else []
    stale += [p for p in Path(run_dir).glob(".*.tmp-*") if p.is_file()]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _saved_config(run_dir: Path) -> tuple[Path, dict | None]:
    """The run's own config: the one its newest complete checkpoint recorded (so deleting or editing
    ``config.yaml`` changes nothing), else ``config.yaml``; None when neither is there."""
    for ckpt in reversed(checkpoint_dirs(run_dir)):
        try:
            cfg = json.loads((ckpt / "state.json").read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(cfg, dict):
            return ckpt / "state.json", cfg
    path = run_dir / "config.yaml"
    if not path.is_file():
        return path, None
    return path, OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def check_same_config(run_dir: Path, config: Any) -> None:
    """Refuse to resume ``run_dir`` with a config other than the one it started with (``ConfigError``
    naming the keys that differ; the launch-only keys :data:`RESUME_FREE_KEYS` may differ)."""
    saved_path, saved_cfg = _saved_config(Path(run_dir))
    if saved_cfg is None:
        ckpt = latest_checkpoint(Path(run_dir))
        if ckpt is not None:  # a checkpoint from before they kept the config, config.yaml gone
            raise ConfigError(
                f"train.resume=auto: cannot check the config of {run_dir}: checkpoint {ckpt} was written "
                f"before checkpoints kept their config and {saved_path} is gone; restore config.yaml (the "
                "run's composed config) to resume, or give a new train.output_dir",
                key="train.resume",
                allowed=["never (with a new train.output_dir)", "auto (with the run's config.yaml)"],
            )
        return
    now_cfg = OmegaConf.to_container(OmegaConf.create(config), resolve=True)
    saved = _flat(travelling_config(saved_cfg)[0])  # data files compared resolved (config.yaml's are)
    now = _flat(travelling_config(now_cfg)[0])
    diff = sorted(
        k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUME_FREE_KEYS
    )
    if diff:
        shown = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in diff[:6])
        raise ConfigError(
            f"train.resume=auto: the config differs from the run's in {saved_path}: {shown}"
            f"{' ...' if len(diff) > 6 else ''}; resume with the same overrides or use another "
            "train.output_dir",
            key="train.resume",
            allowed=["never", "auto (with the run's own config)"],
        )


class Checkpointer(Callback):
    """Checkpoints every ``every`` optimizer steps and on :data:`STOP_SIGNALS` (then :class:`Preempted`)."""

    def __init__(
        self,
        run_dir: Path,
        every: int,
        keep: int,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        state_so_far: Any,
        last_step: int,
        stats: dict | None = None,
    ):
        self.root = Path(run_dir) / CHECKPOINTS
        #: what checkpointing cost, updated in place (the trial's ``meta.checkpoints``): count, seconds
        #: spent writing (staging + completing), bytes of the newest checkpoint
        self.stats = stats if stats is not None else {}
        self.stats.update({"count": 0, "seconds": 0.0, "bytes": 0})
        self.every, self.keep, self.last_step = int(every), int(keep), int(last_step)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.state_so_far = state_so_far  # () -> {"losses": [...], "metrics": {...}, "wandb_run_id": ...}
        self.staged: tuple[int, Path] | None = None
        self.signalled: str | None = None
        self.saved: list[Path] = []
        self._old: dict[int, Any] = {}
        self.pause_s = float(os.environ.get(PAUSE_ENV) or 0)
        self.install_signals()

    # signals ---------------------------------------------------------------------------------------
    def install_signals(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signal.Signals(signum).name

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    # hooks -------------------------------------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        if self.pause_s > 0:
            time.sleep(self.pause_s)
        due = self.every > 0 and (step + 1) % self.every == 0
        if due or self.signalled:
            self._stage(step)

    def on_loss(self, step: int, loss: float) -> None:
        if self.staged is not None and self.staged[0] == step:
            self._complete()
            if self.signalled and step + 1 < self.last_step:
                self.stats["signal"] = (
                    self.signalled
                )  # a pre-timeout signal: the job requeues (sweeper/production_run.py)
                raise Preempted(
                    f"{self.signalled}: checkpointed after optimizer step {step + 1} in {self.saved[-1]}; "
                    "run the same command with train.resume=auto to continue"
                )

    # writing -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self):
        """Add the block's seconds to ``stats["seconds"]`` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats["seconds"] = round(self.stats["seconds"] + time.perf_counter() - t0, 6)

    def _stage(self, step: int) -> None:
        with self._timed():
            self._write_staged(step)

    def _write_staged(self, step: int) -> None:
        import torch
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".staging-step-{step + 1:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            save_file(trainable_state(self.model), str(tmp / "trainable.safetensors"))
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rng_states(),
                },
                tmp / "train_state.pt",
            )
        except BaseException:  # disk full, an error: the half-written folder does not keep the space
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.staged = (step, tmp)

    def _complete(self) -> None:
        with self._timed():
            self._write_complete()
        self.stats["count"] += 1
        self.stats["bytes"] = sum(f.stat().st_size for f in self.saved[-1].iterdir() if f.is_file())

    def _write_complete(self) -> None:
        step, tmp = self.staged  # type: ignore[misc]
        self.staged = None
        state = {"next_step": step + 1, **self.state_so_far()}
        try:
            (tmp / "state.json").write_text(json.dumps(state))
            for name in ("trainable.safetensors", "train_state.pt", "state.json"):
                _fsync_file(tmp / name)
            (tmp / COMPLETE).write_text(f"step {step + 1}\n")
            _fsync_file(tmp / COMPLETE)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / f"step-{step + 1:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        self.saved.append(final)
        for old in checkpoint_dirs(self.root.parent)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
