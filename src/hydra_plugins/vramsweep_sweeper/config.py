"""Structured config of ``hydra/sweeper=vramsweep`` (registered in Hydra's ConfigStore at plugin scan)."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from vramsweep.sweeper.samplers import SAMPLER_GROUP
from vramsweep.sweeper.settings import SweeperConf


@dataclass
class VramsweepSweeperConf(SweeperConf):
    """``hydra.sweeper.*``; see :class:`vramsweep.sweeper.settings.SweeperConf` for every key."""

    _target_: str = "hydra_plugins.vramsweep_sweeper.vramsweep_sweeper.VramsweepSweeper"
    # ``sampler``/``pruner`` given by ``_target_`` arrive as dicts: the engine instantiates them with its
    # own checks (GridSampler -> our grid, a missing optional package -> exit 2 before any file).
    _recursive_: bool = False
    # hydra-optuna-sweeper's `override hydra/sweeper/sampler: tpe` needs the group in the defaults list
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"sampler": None}])


ConfigStore.instance().store(
    group="hydra/sweeper", name="vramsweep", node=VramsweepSweeperConf, provider="vramsweep"
)

# hydra-optuna-sweeper's sampler group (``hydra/sweeper/sampler=tpe``, then ``hydra.sweeper.sampler.seed=1``)
for _name, _target in SAMPLER_GROUP.items():
    ConfigStore.instance().store(
        group="hydra/sweeper/sampler",
        name=_name,
        node={"_target_": _target, "seed": None},
        package="hydra.sweeper.sampler",
        provider="vramsweep",
    )
