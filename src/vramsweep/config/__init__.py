"""Config: Hydra composition, typed schema, and the rules checked before anything is built."""

from vramsweep.config.compose import ConfigError, compose, conf_dir
from vramsweep.config.rules import validate

__all__ = ["ConfigError", "compose", "conf_dir", "validate"]
