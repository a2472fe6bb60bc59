"""Structured config of ``hydra/sweeper=vramsweep`` (registered in Hydra's ConfigStore at plugin scan)."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from vramsweep.sweeper.settings import SweeperConf


@dataclass
class VramsweepSweeperConf(SweeperConf):
    """``hydra.sweeper.*``; see :class:`vramsweep.sweeper.settings.SweeperConf` for every key."""

    _target_: str = "hydra_plugins.vramsweep_sweeper.vramsweep_sweeper.VramsweepSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="vramsweep", node=VramsweepSweeperConf, provider="vramsweep"
)
