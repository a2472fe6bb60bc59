"""Launcher mode (``hydra.sweeper.isolation=launcher``): each trial is a job of Hydra's configured launcher.

``hydra/launcher=submitit_slurm`` (or ``submitit_local``, ``joblib``, ``ray``...) on the command line picks
it unless ``hydra.sweeper.isolation`` is given there (:func:`choose_isolation`). The worker threads of
:mod:`.workers` dispatch trials as usual; :class:`LauncherRunner` stands in for the process runner. A job
gets ``VRAMSWEEP_TRIAL_SPEC`` (via ``hydra.job.env_set``) pointing at its spec JSON under
``<sweep dir>/jobs`` and runs it like a fork-server child (:func:`vramsweep.sweeper.multirun._task`):
result JSON written atomically next to the study, pruning reports through the shared storage. This
process tells the study and keeps the trials' heartbeat while it waits for the jobs.

submitit launchers get one ``launch()`` per trial, from every worker thread at once: a job that dies
(killed, node lost, ``timeout_min``) fails its own trial (``error``, with submitit's reason), never the
others, and no trial waits for a slow batch mate. Other launchers (``basic``, ``joblib``, ``ray``) are
not known to be safe to call from several threads: their trials are gathered into batches of up to
``n_jobs`` jobs per ``launch()`` call, as Hydra's own sweepers do.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.sweeper.isolation import Runner
from vramsweep.sweeper.trialproc import (
    SPEC_ENV,
    RunReport,
    TrialSpec,
    _load_child_result,
    parent_side_result,
    report_from_json,
    save_spec,
)

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
#: Launchers whose ``launch()`` may run in several threads at once (a new executor per call, no globals).
CONCURRENT_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.",)


def choose_isolation(
    isolation: str, launcher_target: str | None, hydra_overrides: list[str]
) -> tuple[str, str | None]:
    """The isolation a sweep runs with, and a note for the user (``None``: nothing to say).

    A launcher other than Hydra's basic one, chosen without ``hydra.sweeper.isolation`` on the command line,
    means launcher mode: the user asked for the cluster. With an explicit isolation other than ``launcher``
    the launcher is not used, and the note says so.
    """
    if not launcher_target or launcher_target == BASIC_LAUNCHER or isolation == "launcher":
        return isolation, None
    explicit = any(o.lstrip("+").startswith("hydra.sweeper.isolation=") for o in hydra_overrides)
    short = launcher_target.rsplit(".", 1)[-1]
    if not explicit:
        return "launcher", None
    return isolation, (
        f"vramsweep: hydra.sweeper.isolation={isolation}: the configured Hydra launcher ({short}) is not used; "
        "each trial runs in a process of this sweeper (hydra.sweeper.isolation=launcher hands trials to it)"
    )


def _wall(result: dict[str, Any], fallback: float) -> float:
    w = (result.get("meta") or {}).get("wall_s")
    return float(w) if isinstance(w, int | float) else fallback


@dataclass
class _Request:
    spec: TrialSpec
    overrides: list[str]
    ret: Any = None
    error: str | None = None
    done: bool = False


class LauncherRunner(Runner):
    """The runner of launcher mode: ``run(spec)`` hands the trial to the Hydra launcher and waits for it."""

    name = "launcher"

    def __init__(self, launcher_factory: Any, sweep_dir: Path, *, batch_size: int = 1, gather_s: float = 0.3):
        self.factory = launcher_factory
        self.sweep_dir = Path(sweep_dir)
        self.batch_size = max(1, batch_size)
        self.gather_s = gather_s
        self.launcher: Any = None
        self.target = ""
        self.concurrent = False
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False

    def start(self) -> None:
        self.launcher = self.factory()
        self.target = f"{type(self.launcher).__module__}.{type(self.launcher).__qualname__}"
        self.concurrent = self.target.startswith(CONCURRENT_LAUNCHERS)
        cfg = getattr(self.launcher, "config", None)
        if cfg is not None:  # the launcher makes its sweep dir: ours (not the unnamed default's)
            from omegaconf import OmegaConf, open_dict

            default = None
            with contextlib.suppress(Exception):
                default = str(OmegaConf.select(cfg, "hydra.sweep.dir"))
            with contextlib.suppress(Exception), open_dict(cfg):
                cfg.hydra.sweep.dir = str(self.sweep_dir)
            # settings resolved from the default sweep dir when the launcher was made (submitit_folder:
            # ${hydra.sweep.dir}/.submitit/%j) move into ours
            params = getattr(self.launcher, "params", None)
            if default and isinstance(params, dict):
                for k, v in params.items():
                    if isinstance(v, str) and (v == default or v.startswith(default + "/")):
                        params[k] = str(self.sweep_dir) + v[len(default) :]

    def run(
        self,
        spec: TrialSpec,
        *,
        tick: Any = None,
        tick_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> RunReport:
        """Run one trial as a launcher job. ``timeout_s`` is the launcher's business (e.g.
        ``hydra.launcher.timeout_min``): a job cannot be killed from here."""
        spec.env, spec.parent_pid, spec.parent_ctime, spec.log_path = {}, 0, None, None  # runs elsewhere
        path = self.sweep_dir / "jobs" / f"{spec.number:04d}.spec.json"
        save_spec(spec, str(path))
        with contextlib.suppress(FileNotFoundError):
            Path(spec.result_path).unlink()
        req = _Request(
            spec,
            [
                *spec.overrides,
                f"++hydra.job.env_set.{SPEC_ENV}='{path}'",
                f"++hydra.job.env_set.VRAMSWEEP_SWEEP_DIR='{self.sweep_dir}'",
                f"hydra.sweep.dir='{self.sweep_dir}'",
            ],
        )
        t0 = time.perf_counter()
        if self.concurrent:
            self._launch([req])
        else:
            self._batched(req)
        wall = time.perf_counter() - t0
        data = _load_child_result(spec.result_path)
        if data is not None:
            return report_from_json(data, _wall(data, wall), None)
        if req.error is not None:
            reason = f"launcher job failed without a result: {req.error}"
        else:
            why = getattr(req.ret, "_return_value", None) if req.ret is not None else None
            status = getattr(getattr(req.ret, "status", None), "name", "no return")
            reason = f"launcher job ended without a result (job status {status}{f': {why}' if why else ''})"
        return report_from_json(parent_side_result(spec, reason[:1000], wall), wall, None)

    def _launch(self, batch: list[_Request]) -> None:
        """One ``launch()`` call; a failure is every unfinished job's (a launcher raises for the batch)."""
        try:
            returns = list(
                self.launcher.launch([r.overrides for r in batch], initial_job_idx=batch[0].spec.number)
            )
        except Exception as exc:
            text = " ".join(str(exc).split())
            for r in batch:
                r.error = f"{type(exc).__name__}: {text[:600]}"
            return
        for r, ret in zip(batch, returns):
            r.ret = ret

    def _batched(self, req: _Request) -> None:
        """Launchers called from one thread at a time: the first waiting worker gathers up to ``batch_size``
        requests (for ``gather_s`` at most) and launches them as one batch; the others wait for theirs."""
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
        while True:
            with self._cond:
                while self._busy and not req.done:
                    self._cond.wait(0.5)
                if req.done:
                    return
                self._busy = True
                deadline = time.monotonic() + self.gather_s
                while len(self._pending) < self.batch_size and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
            try:
                self._launch(batch)
            finally:
                with self._cond:
                    for r in batch:
                        r.done = True
                    self._busy = False
                    self._cond.notify_all()
