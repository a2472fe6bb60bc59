"""Samplers and pruners from ``hydra.sweeper.sampler`` / ``hydra.sweeper.pruner``.

Short names: ``tpe`` (multivariate, grouped, constant liar so parallel workers do not pile onto one
point), ``random``, ``grid`` (handled as a grid design: exact enumeration, exact resume), ``nsga2``,
``gp`` (needs scipy): :data:`SAMPLER_TABLE` / :data:`PRUNER_TABLE` hold each one's class, defaults,
needed packages and Hydra option names. A dict with ``name`` adds keyword arguments
(``{name: tpe, n_startup_trials: 4}``); a dict with ``_target_`` is instantiated as-is, like
hydra-optuna-sweeper's sampler configs. Constraints are passed per trial with ``Trial.set_constraint`` (Optuna
5), which every sampler here reads; the deprecated ``constraints_func`` is not used.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from vramsweep.config.compose import ConfigError

#: TPE's default of 10 random start-up trials is a fifth of a 48-point space; 5 is enough with
#: multivariate TPE on the categorical spaces our sweeps use (see bench/sweep_efficiency.py).
TPE_STARTUP = 5


def _kwargs(spec: Any) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, dict) else {}


@dataclass(frozen=True)
class Algo:
    """One sampler or pruner: its short name, the class it makes, that class's keyword defaults, the optional
    packages it needs at its first trial, and its option names in hydra-optuna-sweeper's
    ``hydra/sweeper/sampler`` group. ``short=False``: reachable by ``_target_`` or the group only."""

    name: str
    target: str
    defaults: dict[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    short: bool = True


#: Every sampler: ``hydra.sweeper.sampler=<name>`` (:data:`SAMPLERS`), the plugin's ``hydra/sweeper/sampler``
#: group (:data:`SAMPLER_GROUP`) and the optional packages a ``_target_`` needs (:data:`NEEDS`) all read it.
SAMPLER_TABLE: tuple[Algo, ...] = (
    Algo(
        "tpe",
        "optuna.samplers.TPESampler",
        {"multivariate": True, "group": True, "constant_liar": True, "n_startup_trials": TPE_STARTUP},
        aliases=("tpe",),
    ),
    Algo("random", "optuna.samplers.RandomSampler", aliases=("random",)),
    # a grid is a fixed design: its points are enqueued and the sampler (a RandomSampler) stays idle
    Algo("grid", "optuna.samplers.GridSampler", aliases=("grid",)),
    Algo("nsga2", "optuna.samplers.NSGAIISampler", aliases=("nsgaii",)),
    Algo(
        "gp",
        "optuna.samplers.GPSampler",
        {"n_startup_trials": TPE_STARTUP},
        needs=("scipy", "torch"),
        aliases=("gp",),
    ),
    Algo("cmaes", "optuna.samplers.CmaEsSampler", needs=("cmaes",), aliases=("cmaes",), short=False),
    # removed in Optuna 4.0: TPE, said in one line
    Algo("motpe", "vramsweep.sweeper.samplers.motpe_sampler", aliases=("motpe",), short=False),
    Algo("qmc", "optuna.samplers.QMCSampler", aliases=("qmc",), short=False),
    Algo("botorch", "optuna_integration.BoTorchSampler", needs=("botorch",), short=False),
)
#: Every pruner (``hydra.sweeper.pruner=<name>``, :data:`PRUNERS`).
PRUNER_TABLE: tuple[Algo, ...] = (
    Algo("median", "optuna.pruners.MedianPruner", {"n_startup_trials": 3, "n_warmup_steps": 0}),
    Algo("sha", "optuna.pruners.SuccessiveHalvingPruner", {"min_resource": 1}),
    Algo("hyperband", "optuna.pruners.HyperbandPruner", {"min_resource": 1, "reduction_factor": 3}),
    Algo("none", "optuna.pruners.NopPruner"),
)
#: Samplers accepted by short name (``hydra.sweeper.sampler=<name>``).
SAMPLERS = tuple(a.name for a in SAMPLER_TABLE if a.short)
#: Pruners accepted by short name (``hydra.sweeper.pruner=<name>``).
PRUNERS = tuple(a.name for a in PRUNER_TABLE if a.short)
#: hydra-optuna-sweeper's sampler group (``hydra/sweeper/sampler=tpe``, then ``hydra.sweeper.sampler.seed=1``)
SAMPLER_GROUP = {alias: a.target for a in SAMPLER_TABLE for alias in a.aliases}
#: Optional packages a sampler needs at its first trial (Optuna imports them lazily): checked up front.
NEEDS = {a.target.rsplit(".", 1)[-1]: a.needs for a in SAMPLER_TABLE if a.needs}


def _check_needs(cls_name: str, what: str) -> None:
    missing = [m for m in NEEDS.get(cls_name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"hydra.sweeper.{what}: {cls_name} needs {', '.join(missing)} (pip install {' '.join(missing)}); "
            "not installed here",
            key=f"hydra.sweeper.{what}",
            allowed=[a.name for a in SAMPLER_TABLE if a.short and not a.needs],
        )


def _make(algo: Algo, kw: dict[str, Any]) -> Any:
    """``algo``'s class called with ``kw`` over its defaults."""
    import importlib

    module, _, attr = algo.target.rpartition(".")
    _check_needs(attr, "sampler" if algo in SAMPLER_TABLE else "pruner")
    return getattr(importlib.import_module(module), attr)(**{**algo.defaults, **kw})


def _instantiate(spec: dict[str, Any], what: str) -> Any:
    from hydra.utils import instantiate

    target = str(spec.get("_target_"))
    _check_needs(target.rsplit(".", 1)[-1], what)
    try:
        obj = instantiate(spec, _convert_="all")
    # broad on purpose: a sampler's constructor may raise anything for bad arguments: ConfigError
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(
            f"hydra.sweeper.{what}: cannot instantiate {target}: "
            f"{str(cause).splitlines()[0] if str(cause) else type(cause).__name__}",
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
            "vramsweep: note: the 'motpe' sampler was removed in Optuna 4.0; hydra/sweeper/sampler=motpe "
            "runs TPESampler, which handles multi-objective optimization (hydra/sweeper/sampler=tpe says so "
            "directly)",
            file=sys.stderr,
            flush=True,
        )
    return optuna.samplers.TPESampler(**kwargs)


def make_sampler(spec: Any, *, seed: int | None, n_jobs: int, n_objectives: int) -> Any:
    """The Optuna sampler for a search design.

    Raises:
        ConfigError: unknown name, bad keyword, or a sampler this install cannot run (``gp`` without scipy).
    """
    import optuna

    if isinstance(spec, optuna.samplers.BaseSampler):
        return spec
    if isinstance(spec, dict) and "_target_" in spec:
        return _instantiate(spec, "sampler")
    name = spec if isinstance(spec, str) else str(spec.get("name"))
    kw = _kwargs(spec)
    kw.setdefault("seed", seed)
    algo = next((a for a in SAMPLER_TABLE if a.short and a.name == name), None)
    if algo is None:
        raise ConfigError(f"unknown sampler {name!r}", key="hydra.sweeper.sampler", allowed=list(SAMPLERS))
    if name == "grid":  # only reached for a fixed design: points are enqueued, the sampler is idle
        return optuna.samplers.RandomSampler(seed=seed)
    try:
        return _make(algo, kw)
    except (
        TypeError,
        ValueError,
    ) as exc:  # an unknown keyword, or Optuna's range check (n_startup_trials=-1)
        raise ConfigError(f"hydra.sweeper.sampler={spec}: {exc}", key="hydra.sweeper.sampler") from exc


def make_pruner(spec: Any, *, active: bool) -> Any:
    """The Optuna pruner (a ``NopPruner`` when pruning is not active for this study)."""
    import optuna

    if not active:
        return optuna.pruners.NopPruner()
    if isinstance(spec, optuna.pruners.BasePruner):
        return spec
    if isinstance(spec, dict) and "_target_" in spec:
        return _instantiate(spec, "pruner")
    name = spec if isinstance(spec, str) else str(spec.get("name"))
    algo = next((a for a in PRUNER_TABLE if a.short and a.name == name), None)
    if algo is None:
        raise ConfigError(f"unknown pruner {name!r}", key="hydra.sweeper.pruner", allowed=list(PRUNERS))
    if name == "none":
        return optuna.pruners.NopPruner()
    try:
        return _make(algo, _kwargs(spec))
    except (
        TypeError,
        ValueError,
    ) as exc:  # an unknown keyword, or Optuna's range check (n_startup_trials=-1)
        raise ConfigError(f"hydra.sweeper.pruner={spec}: {exc}", key="hydra.sweeper.pruner") from exc
