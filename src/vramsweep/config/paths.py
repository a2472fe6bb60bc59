"""The config search path: the packaged defaults (``vramsweep/conf``) under a user's conf dir, and the
options of each group (the YAML files there: no other list of options exists)."""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

from vramsweep.config.errors import ConfigError

CONFIG_DIR_ENV = "VRAMSWEEP_CONFIG_DIR"
_PACKAGED = Path(__file__).resolve().parents[1] / "conf"
# An explicit ``compose(conf_dir=...)`` wins over the environment for the duration of the call.
_EXPLICIT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("vramsweep_conf_dir", default=None)


def packaged_conf_dir() -> Path:
    """The packaged defaults (``vramsweep/conf``), shipped inside the installed package."""
    return _PACKAGED


def user_conf_dir() -> Path | None:
    """The user's conf dir: ``$VRAMSWEEP_CONFIG_DIR`` (must exist), else ``./conf`` if present, else None."""
    explicit = _EXPLICIT.get()
    if explicit is not None:
        return explicit
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        path = Path(env).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"{CONFIG_DIR_ENV}={env}: no such folder", key=CONFIG_DIR_ENV)
        return None if path == _PACKAGED else path
    local = (Path.cwd() / "conf").resolve()
    return local if local.is_dir() and local != _PACKAGED else None


def writable_conf_dir() -> Path:
    """Where ``vramsweep pick`` writes ``experiment/<name>.yaml``: the user's conf dir, else ``./conf``."""
    return user_conf_dir() or (Path.cwd() / "conf").resolve()


def use_conf_dir(path: str | os.PathLike[str]) -> Path:
    """Make ``path`` the user's conf dir for this process and its children (``--config-dir``)."""
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise ConfigError(f"--config-dir {path}: no such folder", key="--config-dir")
    os.environ[CONFIG_DIR_ENV] = str(p)
    return p


def conf_dirs(conf_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The config search path, highest priority first: ``[user conf dir, packaged defaults]``.

    ``conf_dir`` (explicit) replaces :func:`user_conf_dir`.
    """
    user = Path(conf_dir).expanduser().resolve() if conf_dir is not None else user_conf_dir()
    # an explicit dir that does not exist yet (pick creates it when it writes) adds nothing
    return [user, _PACKAGED] if user is not None and user != _PACKAGED and user.is_dir() else [_PACKAGED]


def list_options(group: str, conf_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Options of a config group across the search path (``base_*`` schema names are not files)."""
    names: set[str] = set()
    for d in conf_dirs(conf_dir):
        if (d / group).is_dir():
            names.update(p.stem for p in (d / group).glob("*.yaml"))
    return sorted(names)


def find_option(group: str, name: str, conf_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The file ``<group>=<name>`` composes from (the highest layer that has it), or None."""
    for d in conf_dirs(conf_dir):
        path = d / group / f"{name}.yaml"
        if path.is_file():
            return path
    return None
