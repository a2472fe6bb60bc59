"""The Hydra ``Sweeper`` subclass: hands the composed config and the command line to the engine."""

import sys
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class VramsweepSweeper(Sweeper):
    """Optuna 5 sweeper with fork-server trial isolation, VRAM-budget constraints, pruning and exact resume.

    Hydra instantiates it with the ``hydra.sweeper`` node as keyword arguments; ``sweep()`` gets the
    task overrides of the command line (``sweep=quant quant=nf4,nf4_dq train.steps=5``). Exits with
    code 2 (``SystemExit``) when the search space or settings are invalid, before any trial starts,
    and 1 when the failure-rate cap aborts the sweep.
    """

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def _launcher(self) -> Any:
        """The configured Hydra launcher (``hydra/launcher=...``), for ``isolation=launcher``."""
        from hydra.core.plugins import Plugins

        assert self.hydra_context is not None and self.config is not None
        return Plugins.instance().instantiate_launcher(
            hydra_context=self.hydra_context, task_function=self.task_function, config=self.config
        )

    def sweep(self, arguments: list[str]) -> Any:
        from vramsweep.sweeper import multirun
        from vramsweep.sweeper.engine import run_sweep

        multirun.SWEEPER_STARTED = True
        assert self.config is not None
        sweeper_cfg = OmegaConf.to_container(self.config.hydra.sweeper, resolve=True)
        if self.task_function is not multirun._task:
            # another Hydra app: optimise its return value(s) like hydra-optuna-sweeper (function mode)
            from vramsweep.sweeper.function_mode import run_function_sweep

            code = run_function_sweep(dict(sweeper_cfg), list(arguments), self.config, self._launcher)
            if code:
                raise SystemExit(code)
            return None
        from vramsweep.sweeper.launch import choose_isolation

        # hydra/launcher=submitit_slurm (or any launcher but the basic one) hands the trials to that launcher
        isolation, note = choose_isolation(
            str(sweeper_cfg.get("isolation") or "fork"),
            OmegaConf.select(self.config, "hydra.launcher._target_"),
            [str(o) for o in OmegaConf.to_container(self.config.hydra.overrides.hydra, resolve=False)],
        )
        sweeper_cfg["isolation"] = isolation
        if note:
            print(note, file=sys.stderr)
        task = OmegaConf.masked_copy(self.config, [k for k in self.config.keys() if k != "hydra"])
        task_cfg = OmegaConf.to_container(task, resolve=True)
        code = run_sweep(dict(sweeper_cfg), dict(task_cfg), list(arguments), launcher_factory=self._launcher)
        if code:
            raise SystemExit(code)
        return None
