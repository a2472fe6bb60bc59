"""Search space: Hydra override grammar -> Optuna distributions, grids and trial overrides.

As hydra-optuna-sweeper reads the grammar (its distribution table is ``tests/sweeper/test_sweeper_space.py``):
``choice(a,b)`` / ``a,b`` -> categorical; ``shuffle(range(...))`` -> categorical over the range's values
(in sorted order, so a sweep's identity does not depend on the shuffle); ``range(8,33,8)`` over ints ->
``IntDistribution(step)`` (ordinal for TPE); a range with a float start, stop or step
(``range(0.5, 5.5, step=1)``) -> ``FloatDistribution(step)``; ``interval(lo,hi)`` -> float;
``int(interval(1,5))`` (also under ``tag(log, ...)``, or the ``int`` tag, or a target config node that is
an int) -> ``IntDistribution``; ``tag(log, interval(...))`` -> log scale. A range's stop is excluded, as
Hydra's grammar (and its basic sweeper and our grid) enumerate it: upstream passes the stop itself as the
distribution's high (docs/SWEEPS.md, deliberate differences). A value that is not a sweep is a fixed
override applied to every trial.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramsweep.config.compose import ConfigError, list_options

Scalar = str | int | float | bool | None


@dataclass
class Param:
    """One search dimension.

    Attributes:
        key: the override key (``quant``, ``adapter.r``).
        kind: ``choice`` | ``range`` | ``interval``.
        values: the discrete values (choice/range), typed; non-scalars are stored as override text.
        low/high/log/integer: interval bounds.
        step: range step (an int for int ranges, a float for float ranges).
    """

    key: str
    kind: str
    values: list[Scalar] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    step: int | float | None = None

    @property
    def discrete(self) -> bool:
        return self.kind in ("choice", "range")

    def size(self) -> float:
        """Number of distinct values (``inf`` for float intervals)."""
        if self.discrete:
            return len(self.values)
        if self.integer:
            return int(self.high) - int(self.low) + 1  # type: ignore[arg-type]
        return math.inf

    def distribution(self) -> Any:
        """The Optuna distribution of this dimension."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "range" and isinstance(self.step, float):
            return FloatDistribution(float(self.values[0]), float(self.values[-1]), step=self.step)
        if self.kind == "range" and self.step is not None:
            return IntDistribution(int(self.values[0]), int(self.values[-1]), step=self.step)
        if self.discrete:
            return CategoricalDistribution(list(self.values))
        if self.integer:
            return IntDistribution(int(self.low), int(self.high), log=self.log)  # type: ignore[arg-type]
        return FloatDistribution(float(self.low), float(self.high), log=self.log)  # type: ignore[arg-type]

    def text(self, value: Any) -> str:
        """The override text of a value of this dimension."""
        if self.discrete:
            for v, t in zip(self.values, self.texts):
                if v == value and type(v) is type(value):
                    return t
            for v, t in zip(self.values, self.texts):
                if v == value:
                    return t
        if self.integer:
            return str(int(value))
        return format_value(value)

    def probe_values(self) -> list[Scalar]:
        """Values checked by composing before any trial starts: every choice (each may be another config
        option), the two ends of a range or interval (one type, and the rules' bounds are intervals)."""
        if self.kind == "range":
            return [self.values[0], self.values[-1]] if len(self.values) > 1 else list(self.values)
        if self.discrete:
            return list(self.values)
        if self.integer:
            return [int(self.low), int(self.high)]  # type: ignore[arg-type]
        return [float(self.low), float(self.high)]  # type: ignore[arg-type]


def format_value(value: Any) -> str:
    """A Python value as override-grammar text (``None`` -> ``null``, lists -> ``[a,b]``)."""
    from hydra.core.override_parser.types import Override

    if isinstance(value, bool):
        return "true" if value else "false"
    return Override._get_value_element_as_str(value)


def override_key(override: str) -> str:
    """The key an override sets: ``+a.b=1`` -> ``a.b``; ``~a`` -> ``a``; ``hydra/launcher=x`` -> itself."""
    s = override.strip()
    while s[:1] in "+~":
        s = s[1:]
    return s.split("=", 1)[0].strip()


def merge_overrides(*groups: Iterable[str]) -> list[str]:
    """Later overrides replace earlier ones with the same key (Hydra rejects two values for a group)."""
    out: dict[str, str] = {}
    for group in groups:
        for ov in group:
            k = override_key(ov)
            out.pop(k, None)
            out[k] = ov
    return list(out.values())


def _parse(override: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides([override])[0]
    # broad on purpose: Hydra's parser raises several error types for bad grammar: ConfigError
    except Exception as exc:
        raise ConfigError(
            f"cannot parse search-space entry '{override}': {str(exc).splitlines()[0]}",
            key=override_key(override),
        ) from exc


def _scalar(value: Any) -> Scalar:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return format_value(value)


def expand_glob(key: str, text: str) -> str:
    """``quant=glob(nf*)`` -> ``choice(nf4,nf4_dq)`` over the group's options; other entries unchanged.

    Raises:
        ConfigError: ``glob`` over a key that is not a config group, or matching no option.
    """
    from hydra.core.override_parser.types import ValueType

    ov = _parse(f"{key}={text}")
    if ov.value_type != ValueType.GLOB_CHOICE_SWEEP:
        return text
    group = key.lstrip("+~")
    options = list_options(group)
    if not options:
        raise ConfigError(
            f"'{key}={text}': glob(...) selects options of a config group; {group} is not one",
            key=group,
            allowed=["choice(...)", "comma list a,b"],
        )
    picked = ov.value().filter(options)
    if not picked:
        raise ConfigError(f"'{key}={text}' matches no option of {group}", key=group, allowed=options)
    return "choice(" + ",".join(picked) + ")"


def parse_params(params: dict[str, str], *, int_keys: Sequence[str] = ()) -> tuple[list[Param], list[str]]:
    """Split ``params`` into search dimensions and fixed overrides.

    Args:
        params: ``{key: grammar text}``.
        int_keys: keys whose config node is an integer (intervals over them are integer).

    Returns:
        ``(dimensions, fixed_overrides)``.
    """
    dims: list[Param] = []
    fixed: list[str] = []
    for key, text in params.items():
        text = expand_glob(key, text)
        ov = _parse(f"{key}={text}")
        if not ov.is_sweep_override():
            fixed.append(f"{key}={ov.get_value_element_as_str()}")
            continue
        value = ov.value()
        if ov.is_choice_sweep():
            raw = list(ov.sweep_iterator())
            _no_nested_sweep(key, text, raw)
            vals = [_scalar(v) for v in raw]
            if len(set(map(repr, vals))) != len(vals):
                raise ConfigError(f"search space {key}: choice has a repeated value", key=key)
            dims.append(Param(key, "choice", values=vals, texts=[format_value(v) for v in raw]))
        elif ov.is_range_sweep():
            dims.append(_range_param(key, text, ov))
        elif ov.is_interval_sweep():
            tags = set(getattr(value, "tags", set()) or set())
            unknown = tags - {"log", "int"}
            if unknown:
                raise ConfigError(
                    f"search space {key}: unknown tag(s) {sorted(unknown)}", key=key, allowed=["log", "int"]
                )
            low, high = float(value.start), float(value.end)
            # ``int(interval(1, 5))`` keeps int bounds (a plain ``interval(1, 5)`` has float ones), as
            # upstream
            int_bounds = all(type(b) is int for b in (value.start, value.end))
            integer = "int" in tags or key in int_keys or int_bounds
            if integer and not (low.is_integer() and high.is_integer()):
                raise ConfigError(
                    f"search space {key}: integer interval needs integer bounds, got ({low}, {high})", key=key
                )
            if not low < high:
                raise ConfigError(f"search space {key}: interval({low}, {high}) is empty", key=key)
            if "log" in tags and low <= 0:
                raise ConfigError(f"search space {key}: log interval needs a positive lower bound", key=key)
            dims.append(Param(key, "interval", low=low, high=high, log="log" in tags, integer=integer))
        else:  # pragma: no cover - grammar has no other sweep kinds
            raise ConfigError(f"search space {key}: unsupported sweep '{text}'", key=key)
    return dims, fixed


def _no_nested_sweep(key: str, text: str, raw: Sequence[Any]) -> None:
    """A choice's values are plain values: ``choice(choice(8,16),32)`` is refused, naming the key."""
    from hydra.core.override_parser.types import Sweep

    if any(isinstance(v, Sweep) for v in raw):
        raise ConfigError(
            f"search space {key}={text}: a choice cannot hold another sweep (choice/range/interval)",
            key=key,
            allowed=["choice(a,b,...) of plain values", "one sweep per key"],
        )


def _range_param(key: str, text: str, ov: Any) -> Param:
    """A ``range(...)`` dimension: int steps, float steps, or (under ``shuffle``) a categorical."""
    value = ov.value()
    if value.step == 0:
        raise ConfigError(
            f"search space {key}={text}: range step 0 never reaches the stop",
            key=key,
            allowed=["a non-zero step, e.g. range(1, 10, 1)"],
        )
    vals = list(ov.sweep_iterator())
    if not vals:
        raise ConfigError(f"search space {key}: empty range", key=key)
    vals = sorted(vals)  # shuffle() and negative steps: the same values in one canonical order
    if value.shuffle:  # upstream: a categorical over the range's values (never low/high of a shuffled list)
        return Param(key, "choice", values=list(vals), texts=[format_value(v) for v in vals])
    step = abs(value.step)
    if all(type(v) is int for v in vals):
        return Param(key, "range", values=vals, texts=[str(v) for v in vals], step=int(step))
    fvals = [float(v) for v in vals]
    return Param(key, "range", values=fvals, texts=[format_value(v) for v in fvals], step=float(step))


def cli_sweep_params(arguments: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Split command-line task overrides into sweep params (``quant=a,b``, ``x=choice(..)``) and fixed
    ones."""
    params: dict[str, str] = {}
    fixed: list[str] = []
    for arg in arguments:
        ov = _parse(arg)
        if ov.is_sweep_override():
            if arg.lstrip()[:1] in "+~":
                raise ConfigError(
                    f"sweep override '{arg}': add/delete prefixes cannot be swept", key=override_key(arg)
                )
            key, _, text = arg.partition("=")
            key = key.strip()
            if key == "sweep":
                names = ", ".join(str(v) for v in _sweep_values(arg)) or text
                raise ConfigError(
                    f"'{arg}': one {key} file per run ({names}); run them one after another, e.g. "
                    f"vramsweep train -m {key}={names.split(', ')[0]}",
                    key=key,
                )
            params[key] = expand_glob(key, text.strip())
        else:
            fixed.append(arg)
    return params, fixed


def _sweep_values(arg: str) -> list[Any]:
    try:
        return list(_parse(arg).sweep_iterator())
    # broad on purpose: not a sweep (or bad grammar, reported where the space is parsed): no values
    except Exception:
        return []


def grid_points(dims: Sequence[Param]) -> list[dict[str, Scalar]]:
    """Cartesian product of discrete dimensions, in declaration order (last key varies fastest)."""
    bad = [d.key for d in dims if not d.discrete]
    if bad:
        raise ConfigError(
            f"a grid needs discrete dimensions (choice/range); interval given for {', '.join(bad)}",
            key=bad[0],
            allowed=["choice(...)", "range(...)"],
        )
    keys = [d.key for d in dims]
    return [dict(zip(keys, combo)) for combo in itertools.product(*[d.values for d in dims])]


def space_size(dims: Sequence[Param]) -> float:
    """Number of distinct points (``inf`` with a float interval)."""
    total: float = 1
    for d in dims:
        total *= d.size()
    return total


def point_key(params: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A point's identity for comparison (keys sorted, values by ``repr``)."""
    return tuple(sorted((str(k), repr(v)) for k, v in params.items()))


def unmeasured_point(
    dims: Sequence[Param], taken: Iterable[dict[str, Any]], seed: str
) -> dict[str, Any] | None:
    """A point of the space no ``taken`` point equals, at random (``random.Random(seed)``); ``None`` when
    none is left. A space of at most 200,000 points is enumerated (a free point is found if one exists);
    a larger one gets up to 1,000 random draws (uniform, log-uniform on a log interval)."""
    seen = {point_key(p) for p in taken}
    rng = random.Random(seed)
    keys = [d.key for d in dims]
    if space_size(dims) <= 200_000:
        axes = [
            list(d.values) if d.discrete else list(range(int(d.low), int(d.high) + 1))  # type: ignore[arg-type]
            for d in dims
        ]
        free = [c for c in itertools.product(*axes) if point_key(dict(zip(keys, c))) not in seen]
        return dict(zip(keys, rng.choice(free))) if free else None
    for _ in range(1000):
        point: dict[str, Any] = {}
        for d in dims:
            if d.discrete:
                point[d.key] = rng.choice(list(d.values))
            elif d.integer:
                point[d.key] = rng.randint(int(d.low), int(d.high))  # type: ignore[arg-type]
            elif d.log:
                point[d.key] = math.exp(rng.uniform(math.log(d.low), math.log(d.high)))  # type: ignore[arg-type]
            else:
                point[d.key] = rng.uniform(d.low, d.high)  # type: ignore[arg-type]
        if point_key(point) not in seen:
            return point
    return None


def params_to_overrides(params: dict[str, Any], dims: Sequence[Param] = ()) -> list[str]:
    """``{"adapter.r": 16}`` -> ``["adapter.r=16"]``, using each dimension's own override text."""
    by_key = {d.key: d for d in dims}
    out = []
    for k, v in params.items():
        out.append(f"{k}={by_key[k].text(v) if k in by_key else format_value(v)}")
    return out


def suggest(trial: Any, d: Param) -> Any:
    """Ask an Optuna trial for ``d``'s value (int steps, categorical choices, int/float intervals)."""
    if d.kind == "range" and isinstance(d.step, float):
        return trial.suggest_float(d.key, float(d.values[0]), float(d.values[-1]), step=d.step)
    if d.kind == "range" and d.step is not None:
        return trial.suggest_int(d.key, int(d.values[0]), int(d.values[-1]), step=d.step)
    if d.discrete:
        return trial.suggest_categorical(d.key, list(d.values))
    if d.integer:
        return trial.suggest_int(d.key, int(d.low), int(d.high), log=d.log)
    return trial.suggest_float(d.key, float(d.low), float(d.high), log=d.log)
