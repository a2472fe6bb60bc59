"""Config: Hydra composition, typed schema, and the rules checked before anything is built."""

from vramsweep.config.compose import (
    ConfigError,
    compose,
    conf_dirs,
    hydra_state,
    list_options,
    packaged_conf_dir,
    packaged_sweeps_dir,
    translate_hydra_error,
    user_conf_dir,
)
from vramsweep.config.rules import validate

__all__ = [
    "ConfigError",
    "compose",
    "conf_dirs",
    "hydra_state",
    "list_options",
    "packaged_conf_dir",
    "packaged_sweeps_dir",
    "translate_hydra_error",
    "user_conf_dir",
    "validate",
]
