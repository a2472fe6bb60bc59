"""The config search path: the shipped defaults under a user's conf dir, and the options of each group
(the YAML files there: no other list of options exists).

The shipped defaults are the repository's top-level ``conf/`` (``train.yaml`` and one folder per config
group) and ``sweeps/`` (the sweep files, the config group ``sweep``): the source of truth in a checkout,
copied into the package (``vramsweep/conf``, ``vramsweep/sweeps``) when a wheel is built (``setup.py``),
so a non-editable install composes without the checkout."""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

from vramsweep.config.errors import ConfigError

CONFIG_DIR_ENV = "VRAMSWEEP_CONFIG_DIR"
_PACKAGE = Path(__file__).resolve().parents[1]  # .../vramsweep
#: The config group whose options are the sweep files (``sweep=<name>``).
SWEEP_GROUP = "sweep"


#: The longest file or folder name (one path component) in bytes on Linux, macOS and Windows file systems.
NAME_MAX = 255


def check_path_names(path: str | os.PathLike[str], key: str, label: str | None = None) -> None:
    """:class:`ConfigError` naming ``key`` when a component of ``path`` is over :data:`NAME_MAX` bytes (the
    OS refuses it with ``File name too long``, at the first look or after the work was done). ``label``
    replaces ``key`` at the start of the message."""
    for part in Path(os.fspath(path)).parts:
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            shown = part[:24] + "..." if len(part) > 24 else part
            raise ConfigError(
                f"{label or key}: the name {shown!r} is {size} bytes long; one file or folder name holds at "
                f"most {NAME_MAX} bytes",
                key=key,
                allowed=[f"path components of 1..{NAME_MAX} bytes"],
            )


def _shipped(name: str) -> Path:
    """A checkout's top-level ``<name>/`` (``<root>/src/vramsweep`` is this package), else the copy a wheel
    ships inside the package."""
    root = _PACKAGE.parents[1]
    if _PACKAGE.parent.name == "src" and (root / "pyproject.toml").is_file() and (root / name).is_dir():
        return root / name
    return _PACKAGE / name


_PACKAGED = _shipped("conf")
_SWEEPS = _shipped("sweeps")
# An explicit ``compose(conf_dir=...)`` wins over the environment for the duration of the call.
_EXPLICIT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("vramsweep_conf_dir", default=None)


def packaged_conf_dir() -> Path:
    """The shipped config groups and ``train.yaml``: the checkout's ``conf/`` (a wheel:
    ``vramsweep/conf``)."""
    return _PACKAGED


def packaged_sweeps_dir() -> Path:
    """The shipped sweep files (group ``sweep``): the checkout's ``sweeps/`` (a wheel:
    ``vramsweep/sweeps``)."""
    return _SWEEPS


def user_conf_dir() -> Path | None:
    """The user's conf dir: ``$VRAMSWEEP_CONFIG_DIR`` (must exist), else ``./conf`` if present, else None."""
    explicit = _EXPLICIT.get()
    if explicit is not None:
        return explicit
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        check_path_names(env, CONFIG_DIR_ENV)
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
    check_path_names(path, "--config-dir")
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


def group_dirs(group: str, conf_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The folders holding a group's options, highest priority first: ``<layer>/<group>`` of each conf dir;
    for ``sweep``, the shipped ``sweeps/`` last (a user's ``<conf dir>/sweep/<name>.yaml`` wins)."""
    dirs = [d / group for d in conf_dirs(conf_dir)]
    return [*dirs, _SWEEPS] if group == SWEEP_GROUP else dirs


def list_options(group: str, conf_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Options of a config group across the search path: its YAML files. The group's schema
    ``base_<group>`` (Hydra's ConfigStore, not a file) is never one, even as a user's file of that name; a
    user's ``base_mine.yaml`` is an option like any other."""
    names: set[str] = set()
    for d in group_dirs(group, conf_dir):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    names.discard(schema_name(group))
    return sorted(names)


def _shown(path: Path) -> str:
    """``path`` relative to the current folder when it is under it (as a user typed it), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def misplaced_hint(group: str, name: str) -> str:
    """For an unknown ``<group>=<name>``: where a file of that name sits that vramsweep does not read, and
    where it belongs (``conf/sweeps/mine.yaml`` -> ``conf/sweep/mine.yaml``), as ``"; ..."``; else ``""``.

    Looked for: a plural folder (``sweeps/``, ``experiments/``) or a ``.yml`` file, in the user's conf dir,
    ``./conf`` and the current folder (the repository's own layout has ``sweeps/`` at the top)."""
    try:
        user = user_conf_dir()
    except ConfigError:
        user = None
    cwd = Path.cwd()
    right = (user or cwd / "conf").resolve() / group
    seen: set[Path] = set()
    for base in (user, cwd / "conf", cwd):
        if base is None or base.resolve() in seen:
            continue
        seen.add(base.resolve())
        for folder in (f"{group}s", group):
            for ext in (".yaml", ".yml"):
                path = base / folder / f"{name}{ext}"
                if (
                    path.is_file()
                    and path.resolve().parent != _SWEEPS.resolve()
                    and path.resolve() != (right / f"{name}.yaml")
                ):
                    return (
                        f"; {_shown(path)} is not read: did you mean {_shown(right)}/{name}.yaml? "
                        f"({group} files go in <conf dir>/{group}/, as .yaml)"
                    )
    return ""


def schema_name(group: str) -> str:
    """The ConfigStore name of a group's schema (``quant`` -> ``base_quant``): not a selectable option."""
    return f"base_{group.rsplit('/', 1)[-1]}"


def find_option(group: str, name: str, conf_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The file ``<group>=<name>`` composes from (the highest layer that has it), or None."""
    for d in group_dirs(group, conf_dir):
        path = d / f"{name}.yaml"
        if path.is_file():
            return path
    return None
