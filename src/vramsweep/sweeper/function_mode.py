"""Function mode: ``hydra/sweeper=vramsweep`` on any Hydra app, as a drop-in for hydra-optuna-sweeper.

When the task function is not vramsweep's trial (``vramsweep train -m``), the sweeper optimises the
app's return value(s) the way hydra-optuna-sweeper 1.2 does, on Optuna 5: each trial's params become
overrides, the app runs through the configured Hydra launcher in batches of ``n_jobs``, and the
returned float (or sequence, for several ``direction`` entries) is told to the study. Accepted:
``params`` (override grammar, plus command-line sweeps), ``direction`` (str or list), ``sampler`` (short
name or ``_target_`` incl. ``GridSampler``/``CmaEsSampler``; a missing optional package exits 2),
``custom_search_space`` (``module.function(cfg, trial)``), ``n_trials``, ``n_jobs``, ``storage`` (``null``
= in memory), ``study_name``, ``seed``, ``max_failure_rate``. vramsweep-only settings are ignored here.
The settings are read through the same typed :class:`~vramsweep.sweeper.settings.SweeperConf` as the main
driver's (:func:`~vramsweep.sweeper.settings.sweeper_conf`): one default per setting, whichever driver runs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.samplers import make_sampler
from vramsweep.sweeper.settings import SweeperConf, _param_str, resolve_custom_search_space, sweeper_conf
from vramsweep.sweeper.space import (
    Param,
    cli_sweep_params,
    grid_points,
    merge_overrides,
    override_key,
    parse_params,
    suggest,
)

DEFAULT_N_TRIALS = 20


def _directions(raw: Any) -> list[str]:
    dirs = ["minimize"] if raw is None else [raw] if isinstance(raw, str) else list(raw)
    out = []
    for d in dirs:
        d = str(getattr(d, "name", d)).lower()
        if d not in ("minimize", "maximize"):
            raise ConfigError(
                f"hydra.sweeper.direction={d!r}",
                key="hydra.sweeper.direction",
                allowed=["minimize", "maximize"],
            )
        out.append(d)
    return out


def _custom(path: str | None) -> Callable[[Any, Any], Any] | None:
    """The ``custom_search_space`` function: any path ``hydra.utils.get_method`` resolves, as upstream."""
    return resolve_custom_search_space(str(path)) if path else None


def _sampler(spec: Any, seed: int | None, dims: Sequence[Param], n_jobs: int, n_objectives: int) -> Any:
    import optuna

    if spec is None:
        return optuna.samplers.TPESampler(seed=seed)
    is_grid = spec == "grid" or (
        isinstance(spec, dict) and str(spec.get("_target_", "")).endswith("GridSampler")
    )
    if is_grid:
        points = grid_points(dims)  # ConfigError for an interval
        space = {d.key: list(d.values) for d in dims}
        s = (spec.get("seed") if isinstance(spec, dict) else None) or seed
        return optuna.samplers.GridSampler(space, seed=s), len(points)
    return make_sampler(spec, seed=seed, n_jobs=n_jobs, n_objectives=n_objectives)


def _values(ret: Any, n: int) -> list[float]:
    value = ret.return_value  # raises the job's exception when the app failed
    vals = [value] if n == 1 and not isinstance(value, list | tuple) else list(value)
    if len(vals) != n:
        raise ValueError(f"the app returned {len(vals)} value(s) for {n} direction(s)")
    out = [float(v) for v in vals]
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"the app returned a non-finite value: {out}")
    return out


def _tell(study: Any, trial: Any, values: Any = None, state: Any = None) -> None:
    """``study.tell``; GridSampler calls ``study.stop()`` when its grid is done, which outside
    ``optimize`` raises after the trial is told: that is the end of the grid, not an error."""
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


@dataclass
class FunctionPlan:
    """A function-mode sweep, parsed and checked: the typed settings (``conf``) and what is derived from
    them: the space, fixed overrides, directions, sampler and trial count."""

    conf: SweeperConf
    dims: list[Any]
    fixed: list[str]
    directions: list[str]
    sampler: Any
    n_jobs: int
    n_trials: int
    custom: Any  # custom_search_space(cfg, trial) or None


def plan_function_sweep(settings: dict[str, Any], arguments: list[str]) -> FunctionPlan:
    """Every ``hydra.sweeper.*`` setting checked and the space parsed; :class:`ConfigError` otherwise."""

    sampler_spec = settings.get("sampler")
    if isinstance(sampler_spec, dict) and not sampler_spec.get("name") and not sampler_spec.get("_target_"):
        # a conf that sets only ``sampler.seed`` (upstream's examples): upstream's default sampler, TPE
        settings = {**settings, "sampler": {"name": "tpe", **sampler_spec}}
    conf = sweeper_conf(settings)  # every hydra.sweeper.* key: known, type and range; typed
    cli_params, cli_fixed = cli_sweep_params(arguments)
    params = {str(k): _param_str(v) for k, v in (conf.params or {}).items()} | cli_params
    pinned = {override_key(o) for o in cli_fixed}  # `y=0` on the command line pins a param, as upstream
    dims, fixed_params = parse_params({k: v for k, v in params.items() if k not in pinned})
    directions = _directions(conf.direction)
    # auto: the launcher's own parallelism decides; batches of 1
    n_jobs = 1 if conf.n_jobs in (None, "auto") else int(conf.n_jobs)
    sampler = _sampler(conf.sampler, conf.seed, dims, n_jobs, len(directions))
    grid_size = None
    if isinstance(sampler, tuple):
        sampler, grid_size = sampler
    n_trials = DEFAULT_N_TRIALS if conf.n_trials is None else int(conf.n_trials)
    return FunctionPlan(
        conf=conf,
        dims=dims,
        fixed=merge_overrides(fixed_params, cli_fixed),
        directions=directions,
        sampler=sampler,
        n_jobs=n_jobs,
        n_trials=n_trials if grid_size is None else min(n_trials, grid_size),
        custom=_custom(conf.custom_search_space),
    )


def run_function_sweep(
    settings: dict[str, Any], arguments: list[str], config: Any, launcher_factory: Any
) -> int:
    """Optimise a Hydra app's return value, in the shape of hydra-optuna-sweeper's ``sweep()``: ask a
    batch, launch it, tell the returns. 0 done, 1 failure-rate cap, 2 bad settings (nothing run)."""
    import optuna

    try:
        plan = plan_function_sweep(settings, arguments)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=plan.conf.study_name,
        storage=plan.conf.storage,
        sampler=plan.sampler,
        directions=plan.directions,
        load_if_exists=True,
    )
    launcher = launcher_factory()
    done = failures = 0
    last_error = ""
    while done < plan.n_trials:
        trials, overrides = [], []
        for _ in range(min(plan.n_jobs, plan.n_trials - done)):  # each point suggested before the next ask
            trials.append(study.ask())
            overrides.append(_trial_overrides(plan, config, trials[-1]))
        returns = launcher.launch(overrides, initial_job_idx=done)
        for trial, ret in zip(trials, returns):
            try:
                values = _values(ret, len(plan.directions))
            # broad on purpose: the app's own exception (any type) is a failed trial, as upstream
            except Exception as exc:
                failures += 1
                last_error = f"{type(exc).__name__}: {exc}"
                trial.set_user_attr("error", last_error[:1000])
                _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                # upstream's wording: a tolerated failure is a warning with the message; only an abort
                # raises the app's exception (`RuntimeError: ...`), so the abort line below carries it
                print(
                    f"vramsweep: trial {trial.number} failed ({type(exc).__name__}): {exc}", file=sys.stderr
                )
                continue
            _tell(study, trial, values)
        done += len(trials)
        if failures and failures / done > plan.conf.max_failure_rate:
            print(
                f"vramsweep: ABORTED: {failures}/{done} trials failed > "
                f"hydra.sweeper.max_failure_rate={plan.conf.max_failure_rate}; last error: {last_error}",
                file=sys.stderr,
            )
            return 1
    best = study.best_trials if len(plan.directions) > 1 else [study.best_trial]
    for b in best:
        print(f"vramsweep: best: trial {b.number} values={b.values} params={b.params}", flush=True)
    _save_best(config, best, len(plan.directions))
    return 0


def _trial_overrides(plan: FunctionPlan, config: Any, trial: Any) -> tuple[str, ...]:
    """Suggest the trial's point (the space, then the app's ``custom_search_space``): its overrides."""
    for d in plan.dims:
        suggest(trial, d)
    if plan.custom is not None:
        plan.custom(config, trial)
    return tuple(merge_overrides(plan.fixed, [f"{k}={v}" for k, v in trial.params.items()]))


def _save_best(config: Any, best: list[Any], n_directions: int) -> None:
    """``<hydra.sweep.dir>/optimization_results.yaml``, as hydra-optuna-sweeper writes it."""
    from pathlib import Path

    from omegaconf import OmegaConf

    sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
    if not sweep_dir:
        return
    Path(str(sweep_dir)).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(
        OmegaConf.create(
            {"name": "optuna", "best_params": dict(best[0].params), "best_value": best[0].values[0]}
            if len(best) == 1 and n_directions == 1
            else {
                "name": "optuna",
                "solutions": [{"params": dict(b.params), "values": b.values} for b in best],
            }
        ),
        f"{sweep_dir}/optimization_results.yaml",
    )
