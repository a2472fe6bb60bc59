"""Structured config of ``hydra/sweeper=vramsweep`` (registered in Hydra's ConfigStore at plugin scan)."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from vramsweep.sweeper.settings import SweeperConf


@dataclass
class VramsweepSweeperConf(SweeperConf):
    """``hydra.sweeper.*``; see :class:`vramsweep.sweeper.settings.SweeperConf` for every key."""

    _target_: str = "hydra_plugins.vramsweep_sweeper.vramsweep_sweeper.VramsweepSweeper"
    # ``sampler``/``pruner`` given by ``_target_`` arrive as dicts: the engine instantiates them with its
    # own checks (GridSampler -> our grid, a missing optional package -> exit 2 before any file).
    _recursive_: bool = False


ConfigStore.instance().store(
    group="hydra/sweeper", name="vramsweep", node=VramsweepSweeperConf, provider="vramsweep"
)
