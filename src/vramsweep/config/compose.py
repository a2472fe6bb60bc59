"""Compose a trial config from ``conf/`` with Hydra's compose API (no output dirs, no logging)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A bad override or incompatible combination. ``str()`` names the override and allowed values."""

    def __init__(self, message: str, key: str | None = None, allowed: list | tuple | None = None):
        self.key = key
        self.allowed = list(allowed) if allowed is not None else None
        full = message
        if allowed is not None:
            full += f" (allowed: {', '.join(str(a) for a in allowed)})"
        super().__init__(full)


def repo_root() -> Path:
    """The project root (holds ``conf/`` and ``sweeps/``); ``VRAMSWEEP_ROOT`` overrides."""
    env = os.environ.get("VRAMSWEEP_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "conf" / "train.yaml").is_file():
            return parent
    return Path.cwd()


def conf_dir() -> Path:
    return repo_root() / "conf"


def list_options(group: str) -> list[str]:
    d = conf_dir() / group
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.yaml"))


def _translate_hydra_error(exc: Exception) -> ConfigError:
    msg = str(exc).strip().splitlines()
    text = " ".join(line.strip() for line in msg if line.strip())
    # Unknown option in a group: "Could not find 'quant/nf5'" -> name the group's options.
    import re

    m = re.search(r"Could not find '([\w/]+)/([\w.\-]+)'", text)
    if m:
        group, opt = m.group(1), m.group(2)
        return ConfigError(f"unknown option {group}={opt}", key=group, allowed=list_options(group))
    m = re.search(r"Could not override '([\w.]+)'", text)
    if m:
        return ConfigError(f"bad override for '{m.group(1)}': {text}", key=m.group(1))
    return ConfigError(f"invalid config: {text}")


def compose(overrides: list[str] | tuple[str, ...] = (), *, validate_rules: bool = True) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides``; raise :class:`ConfigError` on any bad input.

    Args:
        overrides: Hydra overrides, e.g. ``["quant=nf4", "adapter.r=64"]``.
        validate_rules: also run :func:`vramsweep.config.rules.validate` (range and cross-knob rules).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from vramsweep.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="train", overrides=list(overrides))
    except Exception as exc:  # hydra raises several exception types for bad overrides
        raise _translate_hydra_error(exc) from exc
    finally:
        GlobalHydra.instance().clear()
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:
        raise ConfigError(f"cannot resolve config: {exc}") from exc
    if validate_rules:
        from vramsweep.config.rules import validate

        validate(cfg)
    return cfg
