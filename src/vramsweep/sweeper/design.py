"""Fixed designs: grid, ablation (baseline + one-factor changes) and stacking (cumulative).

Each point becomes one enqueued Optuna trial with fixed params, so a design runs in a known order,
resumes exactly, and shows in optuna-dashboard like any other study. ``meta.design`` in the result
JSON follows docs/CONTRACTS.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.space import Param, grid_points, merge_overrides, override_key, params_to_overrides

DEFAULT_MARK = "(default)"


@dataclass
class DesignPoint:
    """One planned trial.

    Attributes:
        index: position in the design (the trial's slot).
        overrides: the point's overrides, applied after the sweep's fixed overrides.
        params: Optuna params (key -> value) shown in the dashboard.
        design: ``meta.design`` for the result JSON.
    """

    index: int
    overrides: list[str]
    params: dict[str, Any]
    design: dict[str, Any] = field(default_factory=dict)


def _value_text(override: str) -> str:
    return override.split("=", 1)[1].strip() if "=" in override else "null"


def _with_params(points: list[DesignPoint]) -> list[DesignPoint]:
    """Fill each point's params over the union of keys its design varies."""
    keys: list[str] = []
    for p in points:
        for ov in p.overrides:
            k = override_key(ov)
            if k not in keys:
                keys.append(k)
    for p in points:
        by_key = {override_key(ov): _value_text(ov) for ov in p.overrides}
        p.params = {k: by_key.get(k, DEFAULT_MARK) for k in keys}
    return points


def design_choices(points: Sequence[DesignPoint]) -> dict[str, list[Any]]:
    """Categorical choices per param key over the whole design (order of first appearance)."""
    out: dict[str, list[Any]] = {}
    for p in points:
        for k, v in p.params.items():
            lst = out.setdefault(k, [])
            if v not in lst:
                lst.append(v)
    return out


def _repeat_overrides(repeats: int, i: int, base_seed: int) -> list[str]:
    return [f"train.seed={base_seed + i}"] if repeats > 1 else []


def ablation_points(
    baseline: Sequence[str], factors: Sequence[Sequence[str]], *, repeats: int = 1, base_seed: int = 0
) -> list[DesignPoint]:
    """Baseline plus each one-factor change (each factor's overrides applied on top of the baseline).

    Repeats are ordered repeat-major (every point once, then every point again with the next seed), so a
    sweep cut short still covers each point.
    """
    points: list[DesignPoint] = []
    for r in range(repeats):
        rep = _repeat_overrides(repeats, r, base_seed)
        points.append(
            DesignPoint(
                len(points),
                merge_overrides(baseline, rep),
                {},
                {"kind": "ablation", "role": "baseline", "change": [], "repeat": r},
            )
        )
        for change in factors:
            points.append(
                DesignPoint(
                    len(points),
                    merge_overrides(baseline, change, rep),
                    {},
                    {"kind": "ablation", "role": "factor", "change": list(change), "repeat": r},
                )
            )
    return _with_params(points)


def stacking_points(
    baseline: Sequence[str], stack: Sequence[str], *, repeats: int = 1, base_seed: int = 0
) -> list[DesignPoint]:
    """Step 0 is the baseline; step k adds ``stack[k-1]`` to everything before it."""
    points: list[DesignPoint] = []
    for r in range(repeats):
        rep = _repeat_overrides(repeats, r, base_seed)
        for k in range(len(stack) + 1):
            applied = list(stack[:k])
            points.append(
                DesignPoint(
                    len(points),
                    merge_overrides(baseline, applied, rep),
                    {},
                    {
                        "kind": "stacking",
                        "step": k,
                        "added": stack[k - 1] if k else None,
                        "applied": applied,
                        "repeat": r,
                    },
                )
            )
    return _with_params(points)


def grid_design(dims: Sequence[Param], *, repeats: int = 1, base_seed: int = 0) -> list[DesignPoint]:
    """Every combination of the discrete dimensions (a brute-force grid), repeat-major."""
    points: list[DesignPoint] = []
    combos = grid_points(dims)
    for r in range(repeats):
        for combo in combos:
            params = dict(combo)
            rep = _repeat_overrides(repeats, r, base_seed)
            if rep:
                params["train.seed"] = base_seed + r
            points.append(
                DesignPoint(
                    len(points),
                    params_to_overrides(combo, dims) + rep,
                    params,
                    {"kind": "search", "sampler": "grid", "repeat": r},
                )
            )
    return points


def build_design(
    design: str,
    *,
    dims: Sequence[Param],
    baseline: Sequence[str],
    factors: Sequence[Sequence[str]],
    stack: Sequence[str],
    repeats: int,
    base_seed: int,
) -> list[DesignPoint] | None:
    """The planned points of a fixed design, or ``None`` for ``search`` (the sampler decides)."""
    if design in ("ablation", "stacking") and dims:
        raise ConfigError(
            f"sweep.design={design} takes its points from sweep.baseline/factors/stack; the "
            f"search-space entries {', '.join(d.key for d in dims)} would be ignored: drop them or "
            "use sweep.design=search",
            key="hydra.sweeper.params",
        )
    if design == "ablation":
        return ablation_points(baseline, factors, repeats=repeats, base_seed=base_seed)
    if design == "stacking":
        return stacking_points(baseline, stack, repeats=repeats, base_seed=base_seed)
    if design == "grid":
        return grid_design(dims, repeats=repeats, base_seed=base_seed)
    return None
