"""Samplers and pruners from ``hydra.sweeper.sampler`` / ``hydra.sweeper.pruner``.

Short names: ``tpe`` (multivariate, grouped, constant liar so parallel workers do not pile onto one
point), ``random``, ``grid`` (handled as a grid design: exact enumeration, exact resume), ``nsga2``,
``gp`` (needs scipy). A dict with ``name`` adds keyword arguments (``{name: tpe, n_startup_trials: 4}``);
a dict with ``_target_`` is instantiated as-is, like hydra-optuna-sweeper's sampler configs.
Constraints are passed per trial with ``Trial.set_constraint`` (Optuna 5), which every sampler here
reads; the deprecated ``constraints_func`` is not used.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from vramsweep.config.compose import ConfigError

#: TPE's default of 10 random start-up trials is a fifth of a 48-point space; 5 is enough with
#: multivariate TPE on the categorical spaces our sweeps use (see bench/sweep_efficiency.py).
TPE_STARTUP = 5


def _kwargs(spec: Any) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, dict) else {}


#: Optional packages a sampler needs at its first trial (Optuna imports them lazily): checked up front.
NEEDS = {
    "CmaEsSampler": ("cmaes",),
    "GPSampler": ("scipy", "torch"),
    "BoTorchSampler": ("botorch",),
}


def _check_needs(cls_name: str, what: str) -> None:
    missing = [m for m in NEEDS.get(cls_name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"hydra.sweeper.{what}: {cls_name} needs {', '.join(missing)} (pip install {' '.join(missing)}); "
            "not installed here",
            key=f"hydra.sweeper.{what}",
            allowed=["tpe", "random", "grid", "nsga2"],
        )


def _instantiate(spec: dict[str, Any], what: str) -> Any:
    from hydra.utils import instantiate

    target = str(spec.get("_target_"))
    _check_needs(target.rsplit(".", 1)[-1], what)
    try:
        obj = instantiate(spec, _convert_="all")
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(
            f"hydra.sweeper.{what}: cannot instantiate {target}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}",
            key=f"hydra.sweeper.{what}",
        ) from exc
    import optuna

    base = optuna.samplers.BaseSampler if what == "sampler" else optuna.pruners.BasePruner
    if not isinstance(obj, base):
        raise ConfigError(
            f"hydra.sweeper.{what}: {target} is not an Optuna {what} ({type(obj).__name__})",
            key=f"hydra.sweeper.{what}",
        )
    return obj


#: said once per process (a sweep instantiates its sampler to check it, then to run it)
_MOTPE_SAID: list[bool] = []


def motpe_sampler(**kwargs: Any) -> Any:
    """``hydra/sweeper/sampler=motpe`` (hydra-optuna-sweeper's group): Optuna 4.0 removed ``MOTPESampler``;
    its ``TPESampler`` handles several objectives, so that is what runs, and stderr says so in one line."""
    import sys

    import optuna

    if not _MOTPE_SAID:
        _MOTPE_SAID.append(True)
        print(
            "vramsweep: note: the 'motpe' sampler was removed in Optuna 4.0; hydra/sweeper/sampler=motpe runs "
            "TPESampler, which handles multi-objective optimization (hydra/sweeper/sampler=tpe says so directly)",
            file=sys.stderr,
            flush=True,
        )
    return optuna.samplers.TPESampler(**kwargs)


#: short name -> (Optuna sampler class, default keywords); ``grid`` is a fixed design (its points are
#: enqueued, the sampler is idle) and runs a seeded ``RandomSampler`` whatever keywords it is given
SAMPLER_TABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "tpe": (
        "TPESampler",
        {"multivariate": True, "group": True, "constant_liar": True, "n_startup_trials": TPE_STARTUP},
    ),
    "random": ("RandomSampler", {}),
    "grid": ("RandomSampler", {}),
    "nsga2": ("NSGAIISampler", {}),
    "gp": ("GPSampler", {"n_startup_trials": TPE_STARTUP}),
}

#: short name -> (Optuna pruner class, default keywords); ``none`` takes no keywords
PRUNER_TABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "median": ("MedianPruner", {"n_startup_trials": 3, "n_warmup_steps": 0}),
    "sha": ("SuccessiveHalvingPruner", {"min_resource": 1}),
    "hyperband": ("HyperbandPruner", {"min_resource": 1, "reduction_factor": 3}),
    "none": ("NopPruner", {}),
}


def _from_spec(spec: Any, what: str, table: dict[str, tuple[str, dict[str, Any]]], **fixed: Any) -> Any:
    """The Optuna sampler or pruner (``what``) that ``spec`` names: an instance as-is, a ``_target_`` dict
    instantiated, a short name (or ``{name: ..., **keywords}``) looked up in ``table``. ``fixed``: keywords
    set unless the spec gives them.

    Raises:
        ConfigError: unknown name, bad keyword, or a class this install cannot run.
    """
    import optuna

    module = optuna.samplers if what == "sampler" else optuna.pruners
    if isinstance(spec, module.BaseSampler if what == "sampler" else module.BasePruner):
        return spec
    if isinstance(spec, dict) and "_target_" in spec:
        return _instantiate(spec, what)
    name = spec if isinstance(spec, str) else str(spec.get("name"))
    if name not in table:
        raise ConfigError(f"unknown {what} {name!r}", key=f"hydra.sweeper.{what}", allowed=list(table))
    cls_name, defaults = table[name]
    kw = {**defaults, **fixed, **_kwargs(spec)}
    if name in ("grid", "none"):  # keywords are not read
        kw = dict(fixed)
    try:  # TypeError: an unknown keyword; ValueError: Optuna's range check (n_startup_trials=-1)
        _check_needs(cls_name, what)  # its ConfigError is a ValueError: wrapped like the others
        return getattr(module, cls_name)(**kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hydra.sweeper.{what}={spec}: {exc}", key=f"hydra.sweeper.{what}") from exc


def make_sampler(spec: Any, *, seed: int | None, n_jobs: int, n_objectives: int) -> Any:
    """The Optuna sampler for a search design.

    Raises:
        ConfigError: unknown name, bad keyword, or a sampler this install cannot run (``gp`` without scipy).
    """
    return _from_spec(spec, "sampler", SAMPLER_TABLE, seed=seed)


def make_pruner(spec: Any, *, active: bool) -> Any:
    """The Optuna pruner (a ``NopPruner`` when pruning is not active for this study)."""
    return _from_spec(spec if active else "none", "pruner", PRUNER_TABLE)
