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
    try:
        if name == "tpe":
            kw.setdefault("multivariate", True)
            kw.setdefault("group", True)
            kw.setdefault("constant_liar", True)
            kw.setdefault("n_startup_trials", TPE_STARTUP)
            return optuna.samplers.TPESampler(**kw)
        if name == "random":
            return optuna.samplers.RandomSampler(**kw)
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(**kw)
        if name == "gp":
            _check_needs("GPSampler", "sampler")
            kw.setdefault("n_startup_trials", TPE_STARTUP)
            return optuna.samplers.GPSampler(**kw)
        if name == "grid":  # only reached for a fixed design: points are enqueued, the sampler is idle
            return optuna.samplers.RandomSampler(seed=seed)
    except (
        TypeError,
        ValueError,
    ) as exc:  # an unknown keyword, or Optuna's range check (n_startup_trials=-1)
        raise ConfigError(f"hydra.sweeper.sampler={spec}: {exc}", key="hydra.sweeper.sampler") from exc
    raise ConfigError(
        f"unknown sampler {name!r}",
        key="hydra.sweeper.sampler",
        allowed=["tpe", "random", "grid", "nsga2", "gp"],
    )


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
    kw = _kwargs(spec)
    try:
        if name == "median":
            kw.setdefault("n_startup_trials", 3)
            kw.setdefault("n_warmup_steps", 0)
            return optuna.pruners.MedianPruner(**kw)
        if name == "sha":
            kw.setdefault("min_resource", 1)
            return optuna.pruners.SuccessiveHalvingPruner(**kw)
        if name == "hyperband":
            kw.setdefault("min_resource", 1)
            kw.setdefault("reduction_factor", 3)
            return optuna.pruners.HyperbandPruner(**kw)
        if name == "none":
            return optuna.pruners.NopPruner()
    except (
        TypeError,
        ValueError,
    ) as exc:  # an unknown keyword, or Optuna's range check (n_startup_trials=-1)
        raise ConfigError(f"hydra.sweeper.pruner={spec}: {exc}", key="hydra.sweeper.pruner") from exc
    raise ConfigError(
        f"unknown pruner {name!r}", key="hydra.sweeper.pruner", allowed=["median", "sha", "hyperband", "none"]
    )
