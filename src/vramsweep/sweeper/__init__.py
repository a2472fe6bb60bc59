"""vramsweep's sweep engine (used by the Hydra plugin ``hydra/sweeper=vramsweep``).

Modules: :mod:`.settings` (``hydra.sweeper.*``), :mod:`.space` (override grammar -> distributions),
:mod:`.design` (grid / ablation / stacking), :mod:`.validate` (reject bad spaces before any trial),
:mod:`.samplers`, :mod:`.storage` (study, slots, resume, heartbeat), :mod:`.runner` (fork-server trial
processes), :mod:`.outcome` (statuses -> Optuna states and constraints), :mod:`.engine` (workers),
:mod:`.multirun` (the CLI entry), :mod:`.production_run` (a production run as a SLURM job, requeued and
resumed).

Importing this package is cheap (Hydra's plugin scan imports the plugin, which imports us lazily).
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_multirun", "run_sweep"]


def run_multirun(args: list[str]) -> int:
    """``vramsweep train -m <args>``: Hydra multirun with our sweeper; returns the exit code."""
    from vramsweep.sweeper.multirun import run_multirun as _run

    return _run(args)


def run_sweep(sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]) -> int:
    """Run a sweep from plain dicts (what the Hydra plugin calls); returns the exit code."""
    from vramsweep.sweeper.engine import run_sweep as _run

    return _run(sweeper_cfg, task_cfg, arguments)
