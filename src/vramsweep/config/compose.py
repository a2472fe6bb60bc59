"""Compose a trial config from ``conf/`` with Hydra's compose API (no output dirs, no logging)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.errors import ConfigError  # noqa: E402,F401 - defined below rules; re-exported


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


def _schema_fields(dotted: str) -> list[str] | None:
    """Known keys of the node that ``dotted`` would live in (for unknown-key messages)."""
    import dataclasses

    from vramsweep.config.schema import TrialConfig

    node: Any = TrialConfig
    for part in dotted.split(".")[:-1]:
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return None
        f = fields[part]
        node = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if node is None or not dataclasses.is_dataclass(node):
            return None
    return sorted(f.name for f in dataclasses.fields(node))


def _translate_hydra_error(exc: Exception) -> ConfigError:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    cause = exc.__cause__
    cause_line = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    # Unknown option in a group: "Could not find 'quant/nf5'" -> name the group's options.
    m = re.search(r"Could not find '([\w/]+)/([\w.\-]*)'", text)
    if m:
        group, opt = m.group(1), m.group(2)
        allowed = [o for o in list_options(group) if not o.startswith("base_")]
        if not opt:
            return ConfigError(f"{group}= needs an option", key=group, allowed=allowed)
        return ConfigError(f"unknown option {group}={opt}", key=group, allowed=allowed)
    m = re.search(r"Error parsing override '([^']*)'", text)
    if m:
        from vramsweep.config.errors import one_line

        ov = m.group(1)
        why = one_line(cause_line or text.split(m.group(0), 1)[-1])
        why = re.sub(r"^ValueError while evaluating '[^']*': ", "", why)
        if why.startswith("Error parsing override"):
            why = "syntax error"
        return ConfigError(f"cannot parse override {ov!r}: {why}", key=ov.partition("=")[0].lstrip("+~"))
    m = re.search(r"Could not override '([\w.]+)'", text)
    if m:
        key = m.group(1)
        return ConfigError(
            f"unknown key '{key}' ({cause_line or text})", key=key, allowed=_schema_fields(key)
        )
    m = re.search(r"Error merging override ([\w.]+)=(.*)", text)
    if m:
        key = m.group(1)
        return ConfigError(f"bad value for {key}={m.group(2)}: {cause_line}", key=key)
    from vramsweep.config.errors import one_line

    return ConfigError(one_line(f"invalid config: {text}" + (f": {cause_line}" if cause_line else "")))


def check_deletions(overrides: list[str] | tuple[str, ...]) -> None:
    """``~quant`` (delete a config group) is refused: every group in the defaults list is required."""
    from vramsweep.config.schema import CONFIG_GROUPS

    for ov in overrides:
        if ov.startswith("~"):
            key = ov[1:].partition("=")[0]
            if key in CONFIG_GROUPS:
                raise ConfigError(
                    f"{ov}: the {key} group is required and cannot be removed; choose an option with {key}=<option>",
                    key=key,
                    allowed=[o for o in list_options(key) if not o.startswith("base_")],
                )


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

    check_deletions(overrides)
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
