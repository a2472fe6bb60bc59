"""Reject a bad search space before any trial starts (the CLI exits 2, no files are written).

Every choice value (and both ends of every interval) is composed on top of the sweep's fixed
overrides and range-checked by :mod:`vramsweep.config.rules`; an unknown option, unknown key, wrong
type or out-of-range value raises :class:`~vramsweep.config.ConfigError` naming the override.
Combinations are checked per point only for fixed designs (ablation/stacking/grid), whose points the
user listed; in a search a bad *combination* is recorded as ``unsupported`` when sampled. Machine
rules (CUDA, optional packages) are not checked here: those points are recorded ``unsupported``.
``optimizer._target_`` and ``optimizer.kwargs`` are checked from the optimizer's source
(:func:`vramsweep.knobs.optim.check_optimizer_source`): this process never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.compose import ConfigError, compose
from vramsweep.knobs.optim import check_optimizer_source
from vramsweep.sweeper.design import DesignPoint
from vramsweep.sweeper.space import Param, merge_overrides


def compose_base(fixed: Sequence[str]) -> DictConfig:
    """The sweep's base config (fixed overrides only), value-checked."""
    try:
        cfg = compose(fixed, rules="values")
        check_optimizer_source(cfg)  # once here, not in every trial (read from source: no torch here)
    except ConfigError as exc:
        raise ConfigError(f"the sweep's fixed overrides are invalid: {exc}", key=exc.key) from exc
    return cfg


def int_keys(base: DictConfig, keys: Sequence[str]) -> list[str]:
    """Which of ``keys`` are integer nodes in the schema (an interval over them samples integers)."""
    from omegaconf.nodes import IntegerNode

    out = []
    for key in keys:
        parent_key, _, leaf = key.rpartition(".")
        try:
            parent: Any = OmegaConf.select(base, parent_key) if parent_key else base
            node = parent._get_node(leaf) if isinstance(parent, DictConfig) else None
        # broad on purpose: a key the base config lacks or a non-dict parent: no type to read
        except Exception:
            node = None
        if isinstance(node, IntegerNode):
            out.append(key)
    return out


def _probe(fixed: Sequence[str], extra: Sequence[str]) -> None:
    check_optimizer_source(compose(merge_overrides(fixed, extra), rules="values"))


def validate_space(fixed: Sequence[str], dims: Sequence[Param]) -> int:
    """Compose every value of every dimension; raise ConfigError for the first bad one.

    Values are probed in rounds (one value of each dimension per compose) and a failing round is
    re-probed value by value, so the error names the exact override.

    Returns:
        the number of composes done.
    """
    rounds = max((len(d.probe_values()) for d in dims), default=0)
    n = 0
    for j in range(rounds):
        extra = []
        for d in dims:
            vals = d.probe_values()
            if j < len(vals):
                extra.append(f"{d.key}={d.text(vals[j])}")
        try:
            n += 1
            _probe(fixed, extra)
            continue
        except ConfigError:
            pass
        for ov in extra:
            try:
                n += 1
                _probe(fixed, [ov])
            except ConfigError as exc:
                raise ConfigError(f"search space: '{ov}' is invalid: {exc}", key=exc.key) from exc
        # each value alone is fine: the round failed on a combination (recorded per trial as unsupported)
    return n


def validate_design(fixed: Sequence[str], points: Sequence[DesignPoint], *, combinations: bool = True) -> int:
    """Compose and fully rule-check every point of a fixed design (machine rules excepted)."""
    seen: set[tuple[str, ...]] = set()
    n = 0
    for p in points:
        overrides = tuple(merge_overrides(fixed, p.overrides))
        if overrides in seen:
            continue
        seen.add(overrides)
        try:
            n += 1
            check_optimizer_source(compose(overrides, rules="config" if combinations else "values"))
        except ConfigError as exc:
            what = p.design.get("role") or (f"step {p.design.get('step')}" if "step" in p.design else "point")
            raise ConfigError(f"design {what} {list(p.overrides)} is invalid: {exc}", key=exc.key) from exc
    return n
