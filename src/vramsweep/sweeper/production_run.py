"""A production run as a SLURM job through submitit, requeued on preemption and time limit (docs/RUNS.md).

``vramsweep train [overrides] hydra/launcher=submitit_slurm hydra.launcher.*`` (no ``-m``) composes and
checks the config here (a bad one exits 2, nothing submitted), fixes the run folder, and submits one
submitit job running :class:`ProductionJob` - then returns, printing the job id, the run folder and the
log paths. The job always runs with ``train.resume=auto`` in that folder, so every start of it continues
from the folder's newest complete checkpoint:

- **time limit**: SLURM sends submitit's signal (SIGUSR2, ``$SUBMITIT_PREEMPT_SIGNAL``)
  ``hydra.launcher.signal_delay_s`` before ``timeout_min``; the run's
  :class:`~vramsweep.production.checkpoint.Checkpointer` checkpoints after the current step and stops,
  then the job re-raises the signal to submitit's handler, which calls :meth:`ProductionJob.checkpoint`
  (submitit's checkpoint protocol: the same job again), ``scontrol requeue`` s the job and exits; up to
  ``hydra.launcher.max_num_timeout`` times (default here :data:`DEFAULT_MAX_NUM_TIMEOUT`).
- **requeue / preemption** (``scontrol requeue``, a preempting partition): SLURM sends SIGTERM (submitit
  ignores it), the run checkpoints and stops within ``KillWait``, SLURM starts the job again.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vramsweep.config.compose import ConfigError, compose
from vramsweep.config.errors import error_line
from vramsweep.production.fingerprint import check_data
from vramsweep.production.layout import LOSS_LOG
from vramsweep.production.owner import Claim, check_contents, claim, complete_line
from vramsweep.record.status import Status

#: How many times a run that reaches its time limit is requeued when ``hydra.launcher.max_num_timeout`` is
#: not given (hydra-submitit-launcher's own default, 0, would end a production run at its first limit).
DEFAULT_MAX_NUM_TIMEOUT = 20
SLURM_LAUNCHER = "submitit_slurm"


def launcher_choice(overrides: list[str]) -> str | None:
    """The ``hydra/launcher=<name>`` of a command line (the last one), or None."""
    vals = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")]
    return vals[-1].strip() if vals else None


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+").startswith(f"{key}=") for o in overrides)


def run_overrides(overrides: list[str]) -> list[str]:
    """The run's own overrides: no ``hydra`` ones."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra/", "hydra."))]


def job_overrides(overrides: list[str]) -> list[str]:
    """The job's overrides: the run's own, with ``train.resume=auto`` (every start continues the folder)."""
    keep = [o for o in run_overrides(overrides) if not o.lstrip("+").startswith("train.resume=")]
    return [*keep, "train.resume=auto"]


def launcher_params(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """``hydra.launcher.*`` of ``hydra/launcher=submitit_slurm`` with the run's defaults: submitit logs in
    ``<run>/.submitit/%j``, the job named ``vramsweep-train``, :data:`DEFAULT_MAX_NUM_TIMEOUT` requeues."""
    hc = compose(overrides, rules="none", return_hydra_config=True)
    node = hc.hydra.launcher
    defaults = {
        "submitit_folder": str(run_dir / ".submitit" / "%j"),
        "name": "vramsweep-train",
        "max_num_timeout": DEFAULT_MAX_NUM_TIMEOUT,
    }
    params: dict[str, Any] = {}
    for key in node:
        if key == "_target_":
            continue
        if key in defaults and not _given(overrides, f"hydra.launcher.{key}"):
            params[key] = defaults[key]
            continue
        try:
            value = OmegaConf.select(hc, f"hydra.launcher.{key}", throw_on_resolution_failure=True)
        # broad on purpose: any resolver error in the launcher config is the user's: ConfigError
        except Exception as exc:
            raise ConfigError(f"hydra.launcher.{key}: cannot resolve {node._get_node(key)}: {exc}") from exc
        params[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return params


def submitit_executor(kind: str, params: dict[str, Any]) -> Any:
    """A submitit executor from a hydra-submitit-launcher's settings (``hydra.launcher.*``), exactly as
    ``BaseSubmititLauncher.launch()`` builds it; ``kind``: ``slurm`` or ``local``."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = dict(params)
    init_keys = {"max_num_timeout", "submitit_folder"}
    init = {"folder": params["submitit_folder"]} | {
        f"{kind}_{k}": v for k, v in params.items() if k == "max_num_timeout"
    }
    executor = submitit.AutoExecutor(cluster=kind, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{k if k in base else f"{kind}_{k}": v for k, v in params.items() if k not in init_keys}
    )
    return executor


@dataclass
class ProductionJob:
    """The function a submitit job runs: the production run in ``result_path``'s folder, resumed from its
    newest complete checkpoint. A checkpointable callable (``checkpoint``: submitit's protocol)."""

    overrides: list[str]
    result_path: str

    def __call__(self) -> dict[str, Any]:
        from vramsweep.production.checkpoint import check_same_config
        from vramsweep.trial import run_trial

        cfg = compose(self.overrides, rules="all")  # this machine's rules: the node's, not the login host's
        run_dir = Path(self.result_path).parent
        check_same_config(run_dir, OmegaConf.to_container(cfg, resolve=True))
        check_data(cfg, run_dir)  # changed data is refused (train.resume_on_changed_data=true allows it)
        own = claim(run_dir, str(cfg.train.resume))  # one owner; a finished run is complete: nothing to do
        if own.complete:
            print(f"vramsweep: {complete_line(own)}", flush=True)
            return {"status": Status.OK.value, "reason": None, "result": self.result_path}
        if own.note:
            print(f"vramsweep: {own.note}", flush=True)
        try:
            res = run_trial(cfg, result_path=Path(self.result_path), overrides=self.overrides)
        finally:
            own.release()
        sig = ((res.get("meta") or {}).get("checkpoints") or {}).get("signal")
        why = f" ({res['reason']})" if res.get("reason") else ""
        print(f"vramsweep: run {res['status']}{why}", flush=True)
        if sig is not None and sig != "SIGTERM":
            # checkpointed on the pre-timeout signal: hand submitit's own signal to its handler (restored
            # when the run closed its checkpointer), which calls checkpoint(), requeues the job and exits
            import submitit

            signal.raise_signal(getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG))
        return {"status": str(res["status"]), "reason": res.get("reason"), "result": self.result_path}

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's checkpoint hook: the requeued job runs this job again (it resumes by itself)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def submit_run(overrides: list[str]) -> int:
    """``vramsweep train ... hydra/launcher=submitit_slurm``: check, submit one job, say where it is."""
    from vramsweep.trial import default_result_path

    name = launcher_choice(overrides)
    if name != SLURM_LAUNCHER:
        return _err(
            f"hydra/launcher={name}: a production run (train without -m) is submitted with "
            f"hydra/launcher={SLURM_LAUNCHER}; other launchers run sweeps (add -m)"
        )
    mine = job_overrides(overrides)
    try:
        import submitit
        from hydra_plugins.hydra_submitit_launcher import submitit_launcher  # noqa: F401
    except ImportError as exc:
        return _err(
            f"hydra/launcher={name} needs hydra-submitit-launcher (pip install 'vramsweep[cluster]'): {exc}"
        )
    try:
        # the folder as `train` would pick it here (a new one unless the user resumes); the node's own rules
        # (hardware) run in the job
        user = run_overrides(overrides)
        cfg = compose(user, rules="config")
        result = default_result_path(cfg, user).resolve()
        # a finished or stopped run is not overwritten; resume=auto on a finished one: nothing to submit
        done = check_contents(result.parent, str(cfg.train.resume))
        compose(mine, rules="config")
        params = launcher_params(overrides, result.parent)
    except ConfigError as exc:
        return _err(str(exc))
    if done is not None:
        print(complete_line(Claim(result.parent, complete=True, result=done)))
        return 0
    try:
        result.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _err(f"results_dir: cannot create the run folder {result.parent}: {exc.strerror or exc}")
    try:
        job = submitit_executor("slurm", params).submit(ProductionJob(mine, str(result)))
    except Exception as exc:  # sbatch failed: nothing runs
        print(
            f"vramsweep train: error: the job could not be submitted: {' '.join(str(exc).split())[:600]}",
            file=sys.stderr,
        )
        return 1
    run = result.parent
    print(f"submitted: SLURM job {job.job_id} (submitit), run folder {run}")
    print(f"  losses: {run / LOSS_LOG}   result: {result}")
    print(f"  logs: {job.paths.stdout} / {job.paths.stderr}")
    print(
        f"  checkpoints on SIG{submitit.JobEnvironment.USR_SIG} {params.get('signal_delay_s')} s before "
        f"timeout_min={params.get('timeout_min')} and on scontrol requeue; resumes itself (requeued up to "
        f"max_num_timeout={params.get('max_num_timeout')} times at the time limit)"
    )
    return 0


def _err(msg: str) -> int:
    print(error_line("train", msg), file=sys.stderr)
    return 2


__all__ = [
    "ProductionJob",
    "job_overrides",
    "launcher_choice",
    "launcher_params",
    "submit_run",
    "submitit_executor",
]
