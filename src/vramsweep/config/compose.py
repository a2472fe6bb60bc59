"""The one way to compose a trial config: Hydra's compose API over the config search path.

Config search path, first match wins (a file in a higher layer replaces the packaged file of the same
name; options of a group are the union of all layers):

1. the user's conf dir: ``--config-dir DIR`` (``vramsweep train|estimate|pick``, exported to
   ``VRAMSWEEP_CONFIG_DIR`` so trial processes see it too), else ``$VRAMSWEEP_CONFIG_DIR``, else ``./conf``
   when the current folder has one. It holds the user's experiments (``experiment/<name>.yaml``, written
   by ``vramsweep pick``), sweeps (``sweep/<name>.yaml``) and extra group options (``hardware/my_gpu.yaml``).
2. the shipped defaults, :func:`packaged_conf_dir` (the repository's ``conf/``: ``train.yaml``, every
   group's options);
3. the shipped sweeps, :func:`packaged_sweeps_dir` (the repository's ``sweeps/``), seen as the group
   ``sweep`` through the ``vramsweep-sweeps://`` config source (``hydra_plugins/vramsweep_sweeper``).

Every layer that composes (the CLI, the sweeper's planner and validator, trial processes, ``pick``'s
check of the file it wrote) calls :func:`compose`; ``vramsweep train -m`` (Hydra's own app) gets the same
search path from the search-path plugin in ``hydra_plugins/vramsweep_sweeper``, which calls
:func:`layer_user_conf`. :func:`hydra_state` is the one place that saves and restores Hydra's global state.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.errors import ConfigError, one_line
from vramsweep.config.fit import fit_unset, say_fitted
from vramsweep.config.paths import (  # noqa: F401 - re-exported: the search path is part of composing
    _EXPLICIT,
    _PACKAGED,
    CONFIG_DIR_ENV,
    conf_dirs,
    find_option,
    list_options,
    packaged_conf_dir,
    packaged_sweeps_dir,
    use_conf_dir,
    user_conf_dir,
    writable_conf_dir,
)

RULES = ("all", "config", "values", "none")


def layer_user_conf(search_path: Any) -> None:
    """Put the user's conf dir in front of the shipped defaults in a Hydra ``ConfigSearchPath``, and the
    shipped sweeps (group ``sweep``) after them.

    Only when the primary config dir is the shipped one (another Hydra app is left alone).
    """
    from hydra.core.config_search_path import SearchPathQuery

    main = [e for e in search_path.get_path() if e.provider == "main"]
    if not main or Path(re.sub(r"^file://", "", main[0].path)).resolve() != _PACKAGED:
        return
    user = user_conf_dir()
    if user is not None and user.is_dir():
        search_path.prepend(
            provider="vramsweep-user", path=f"file://{user}", anchor=SearchPathQuery(provider="main")
        )
    if not any(e.provider == "vramsweep-sweeps" for e in search_path.get_path()):
        search_path.append(
            provider="vramsweep-sweeps",
            path=f"vramsweep-sweeps://{packaged_sweeps_dir()}",
            anchor=SearchPathQuery(provider="main"),
        )


@contextlib.contextmanager
def hydra_state() -> Iterator[None]:
    """Run a block with a clean Hydra global state and give the caller's back afterwards.

    Composing clears Hydra's ``GlobalHydra``; inside a running Hydra app (the sweeper, an in-process
    trial) that state belongs to the app, so it is saved on entry and restored on exit.
    """
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    saved = gh.hydra
    gh.clear()
    try:
        yield
    finally:
        gh.clear()
        gh.hydra = saved


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


#: Which package adds a Hydra plugin option that is not installed (named in the unknown-option error).
PLUGIN_PACKAGES = {
    "hydra/launcher": {
        "submitit": "hydra-submitit-launcher (or 'vramsweep[cluster]')",
        "joblib": "hydra-joblib-launcher",
        "ray": "hydra-ray-launcher",
        "rq": "hydra-rq-launcher",
    },
    "hydra/sweeper": {
        "optuna": "hydra-optuna-sweeper",
        "ax": "hydra-ax-sweeper",
        "nevergrad": "hydra-nevergrad-sweeper",
    },
}


def hydra_group_options(group: str) -> list[str]:
    """The options of one of Hydra's groups (``hydra/launcher``...) that Hydra and its installed plugins
    offer."""
    try:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()  # imports the installed plugins: they register their configs
        node: Any = ConfigStore.instance().repo
        for part in group.split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return sorted(str(k).removesuffix(".yaml") for k in node) if isinstance(node, dict) else []
    # broad on purpose: the option list is a hint in an error message; Hydra's repo shape varies
    except Exception:
        return []


def translate_hydra_error(exc: Exception) -> ConfigError:
    """A Hydra/OmegaConf composition error as one :class:`ConfigError` naming the override and options."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    cause = exc.__cause__
    cause_line = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    # Unknown option in a group: "Could not find 'quant/nf5'" -> name the group's options.
    m = re.search(r"Could not find '([\w/]+)/([\w.\-]*)'", text)
    if m:
        group, opt = m.group(1), m.group(2)
        if group.startswith("hydra/"):  # Hydra's own groups: the options its installed plugins register
            allowed = hydra_group_options(group)
        else:
            allowed = list_options(group)
        if not opt:
            return ConfigError(f"{group}= needs an option", key=group, allowed=allowed)
        hint = PLUGIN_PACKAGES.get(group, {}).get(opt.split("_")[0])
        where = f"; {opt} comes with `pip install {hint}`" if hint else ""
        return ConfigError(f"unknown option {group}={opt}{where}", key=group, allowed=allowed)
    m = re.search(r"Error parsing override '([^']*)'", text)
    if m:
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
    return ConfigError(one_line(f"invalid config: {text}" + (f": {cause_line}" if cause_line else "")))


def check_deletions(overrides: Sequence[str]) -> None:
    """``~quant`` (delete a config group) is refused: every group in the defaults list is required."""
    from vramsweep.config.schema import CONFIG_GROUPS

    for ov in overrides:
        if ov.startswith("~"):
            key = ov[1:].partition("=")[0]
            if key in CONFIG_GROUPS:
                raise ConfigError(
                    f"{ov}: the {key} group is required and cannot be removed; choose an option "
                    f"with {key}=<option>",
                    key=key,
                    allowed=list_options(key),
                )


def compose(
    overrides: Sequence[str] = (),
    *,
    conf_dir: str | os.PathLike[str] | None = None,
    rules: str = "all",
    return_hydra_config: bool = False,
) -> DictConfig:
    """Compose ``train.yaml`` with ``overrides``; raise :class:`ConfigError` on any bad input.

    Args:
        overrides: Hydra overrides, e.g. ``["quant=nf4", "adapter.r=64"]`` (``hydra.*`` ones too).
        conf_dir: the user's conf dir for this call (default :func:`user_conf_dir`), layered over the
            packaged defaults.
        rules: which :mod:`vramsweep.config.rules` to run: ``all`` (ranges, cross-knob, this machine),
            ``config`` (all but the machine's), ``values`` (ranges and values only), ``none``.
        return_hydra_config: keep the ``hydra`` node (then the config is returned unresolved and
            ``rules`` must be ``none``).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from vramsweep.config.schema import register_configs

    if rules not in RULES:
        raise ValueError(f"rules={rules!r} (allowed: {', '.join(RULES)})")
    if return_hydra_config and rules != "none":
        raise ValueError("return_hydra_config=True composes without rules (rules='none')")
    check_deletions(overrides)
    register_configs()
    explicit = Path(conf_dir).expanduser().resolve() if conf_dir is not None else None
    token = _EXPLICIT.set(explicit)
    try:
        with hydra_state():
            try:
                with initialize_config_dir(config_dir=str(_PACKAGED), version_base=None):
                    cfg = hydra_compose(
                        config_name="train",
                        overrides=list(overrides),
                        return_hydra_config=return_hydra_config,
                    )
            except ConfigError:
                raise
            except Exception as exc:  # hydra raises several exception types for bad overrides
                raise translate_hydra_error(exc) from exc
        if return_hydra_config:
            return cfg
        try:
            OmegaConf.resolve(cfg)
        # broad on purpose: any resolver or interpolation error is the user's config: one ConfigError
        except Exception as exc:
            raise ConfigError(f"cannot resolve config: {exc}") from exc
        shrunk = fit_unset(cfg)  # train.dtype=auto, unset warm-ups fitted to train.steps (config.fit)
        check_rules(cfg, rules)  # with the same search path: a user's option files are options
        say_fitted(cfg, shrunk)
    finally:
        _EXPLICIT.reset(token)
    return cfg


def check_rules(cfg: DictConfig, rules: str = "all") -> None:
    """Run the ``rules`` level of :func:`compose` on an already composed ``cfg``."""
    from vramsweep.config.rules import check_values, validate

    if rules == "all":
        validate(cfg)
    elif rules == "config":
        validate(cfg, machine=False)
    elif rules == "values":
        from vramsweep.config.modules import check_module_names

        check_values(cfg)
        check_module_names(cfg)  # adapter.targets / quant.skip_modules against the model (validate does too)
    elif rules != "none":
        raise ValueError(f"rules={rules!r} (allowed: {', '.join(RULES)})")
