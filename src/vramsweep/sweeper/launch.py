"""Launcher mode (``hydra.sweeper.isolation=launcher``): trials as jobs of Hydra's configured launcher.
Mixed into :class:`vramsweep.sweeper.engine.Sweep` (uses its attributes).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from vramsweep.sweeper.storage import storage_lock
from vramsweep.sweeper.study import Job
from vramsweep.sweeper.trialproc import TrialSpec, _load_child_result


def _wall(result: dict[str, Any], fallback: float) -> float:
    w = (result.get("meta") or {}).get("wall_s")
    return float(w) if isinstance(w, int | float) else fallback


class LauncherMixin:
    """Launcher mode of :class:`~vramsweep.sweeper.engine.Sweep`."""

    def run_launcher(self) -> None:
        """``isolation=launcher``: batches of ``n_jobs`` trials through Hydra's launcher (submitit, ...).

        Each job gets ``VRAMSWEEP_TRIAL_SPEC`` (via ``hydra.job.env_set``) pointing at its spec JSON and
        runs it like a fork-server child: result JSON next to the study, pruning reports through the
        storage. This process keeps the trials' heartbeat while the launcher waits for them.
        """
        from vramsweep.sweeper.trialproc import SPEC_ENV, parent_side_result, report_from_json, save_spec

        launcher = self.launcher_factory()
        cfg = getattr(launcher, "config", None)
        if cfg is not None:  # the launcher makes its sweep dir: ours (not the unnamed default's)
            from omegaconf import open_dict

            with contextlib.suppress(Exception), open_dict(cfg):
                cfg.hydra.sweep.dir = str(self.s.sweep_dir)
        while not self.abort.is_set():
            batch: list[tuple[Job, TrialSpec]] = []
            for _ in range(max(1, self.s.n_jobs)):
                job = self.next_job()
                if job is None:
                    break
                if job.duplicate_of is not None:
                    self._record_duplicate(job)
                    continue
                spec = self._spec_for(
                    job.number, job.trial._trial_id, job.slot, job.overrides, job.design, job.retry_of, 0
                )
                spec.env, spec.parent_pid, spec.parent_ctime, spec.log_path = (
                    {},
                    0,
                    None,
                    None,
                )  # runs elsewhere
                batch.append((job, spec))
            if not batch:
                with storage_lock(self.s.storage, self.s.study_name):
                    if self.reconcile():
                        continue
                return
            job_overrides = []
            for job, spec in batch:
                path = str(self.s.sweep_dir / "jobs" / f"{job.number:04d}.spec.json")
                save_spec(spec, path)
                job_overrides.append(
                    [
                        *job.overrides,
                        f"++hydra.job.env_set.{SPEC_ENV}='{path}'",
                        f"hydra.sweep.dir='{self.s.sweep_dir}'",
                    ]
                )
            t0 = time.perf_counter()
            returns = launcher.launch(job_overrides, initial_job_idx=batch[0][0].number)
            wall = time.perf_counter() - t0
            for (job, spec), ret in zip(batch, list(returns) + [None] * (len(batch) - len(list(returns)))):
                data = _load_child_result(spec.result_path)
                if data is not None:
                    report = report_from_json(data, _wall(data, wall), None)
                else:
                    why = getattr(ret, "_return_value", None) if ret is not None else None
                    status = getattr(getattr(ret, "status", None), "name", "no return")
                    reason = f"launcher job ended without a result (job status {status}{f': {why}' if why else ''})"
                    report = report_from_json(parent_side_result(spec, reason[:1000], wall), wall, None)
                self._record(job, report)
