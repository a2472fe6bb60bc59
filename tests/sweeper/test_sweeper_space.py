"""Search-space syntax as hydra-optuna-sweeper reads it, and bad space input.

``UPSTREAM`` is the distribution table of hydra-optuna-sweeper's own test
(``plugins/hydra_optuna_sweeper/tests/test_optuna_sweeper_plugin.py``,
``test_create_optuna_distribution_from_override``), row by row; each row is checked against what Optuna
receives: the distribution of a real trial after :func:`suggest`. The one deliberate difference: a
``range``'s stop is excluded, as Hydra's grammar enumerates it (docs/SWEEPS.md), so ``range(1,3)`` is
``IntDistribution(1, 2)`` where upstream passes ``high=3``.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.space import parse_params, suggest

pytestmark = pytest.mark.torchfree

#: (override, upstream's expected distribution, ours where it deliberately differs or None)
UPSTREAM = [
    ("key=choice(1,2)", CategoricalDistribution([1, 2]), None),
    ("key=choice(true, false)", CategoricalDistribution([True, False]), None),
    ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"]), None),
    ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2)), None),
    ("key=range(1,3)", IntDistribution(1, 3), IntDistribution(1, 2)),  # stop excluded
    ("key=interval(1, 5)", FloatDistribution(1, 5), None),
    ("key=int(interval(1, 5))", IntDistribution(1, 5), None),
    ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True), None),
    ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True), None),
    ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1), FloatDistribution(0.5, 4.5, step=1)),
]


def _received(override: str, sampler: optuna.samplers.BaseSampler | None = None) -> tuple[object, object]:
    """(the distribution Optuna holds for the trial, the value it suggested)."""
    key, _, text = override.partition("=")
    dims, fixed = parse_params({key: text})
    assert not fixed and len(dims) == 1
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=sampler or optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    value = suggest(trial, dims[0])
    assert dims[0].distribution() == trial.distributions[key]
    return trial.distributions[key], value


def _same(expected: object, actual: object) -> None:
    if isinstance(expected, CategoricalDistribution):  # upstream's check_distribution: shuffle reorders
        assert isinstance(actual, CategoricalDistribution)
        assert set(expected.choices) == set(actual.choices)
    else:
        assert actual == expected


@pytest.mark.parametrize(("override", "upstream", "ours"), UPSTREAM, ids=[r[0] for r in UPSTREAM])
def test_every_row_of_upstreams_distribution_table(override, upstream, ours):
    dist, value = _received(override)
    _same(ours if ours is not None else upstream, dist)
    if ours is not None:  # the difference is only the stop, never the kind, low or step
        assert type(ours) is type(upstream) and ours.low == upstream.low and ours.step == upstream.step
    if isinstance(dist, IntDistribution):
        assert type(value) is int, f"{override}: sampled {value!r}, not an int"


def test_shuffled_range_is_one_space_whatever_the_shuffle():
    """Upstream's docs-page command ``y=shuffle(range(-5, 5))``: the space never comes from the shuffled
    list's first/last items (200 parses gave 90 spaces and ``low <= high`` crashes)."""
    spaces = {repr(parse_params({"y": "shuffle(range(-5, 5))"})[0][0].distribution()) for _ in range(200)}
    assert spaces == {repr(CategoricalDistribution(list(range(-5, 5))))}
    for seed in range(20):
        _dist, value = _received("y=shuffle(range(-5, 5))", optuna.samplers.RandomSampler(seed=seed))
        assert value in range(-5, 5)


@pytest.mark.parametrize(
    ("override", "expected"),
    [  # upstream's docs page (plugins/optuna_sweeper.md) commands
        ("x=int(interval(-5.0, 5.0))", IntDistribution(-5, 5)),
        ("y=tag(log, interval(1, 10))", FloatDistribution(1, 10, log=True)),
        ("x=range(-5.0, 5.0)", FloatDistribution(-5.0, 4.0, step=1.0)),
        ("x=range(-5.5, 5.5, step=0.5)", FloatDistribution(-5.5, 5.0, step=0.5)),
        ("x=range(0, 5, step=0.5)", FloatDistribution(0.0, 4.5, step=0.5)),
        ("x=range(8, 33, 8)", IntDistribution(8, 32, step=8)),
        ("x=range(5, 1, -1)", IntDistribution(2, 5)),
    ],
)
def test_docs_page_commands(override, expected):
    dist, value = _received(override)
    assert dist == expected
    if isinstance(expected, FloatDistribution) and expected.step:
        assert ((value - expected.low) / expected.step) == pytest.approx(
            round((value - expected.low) / expected.step)
        )


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("adapter.r=range(1, 10, 0)", "search space adapter.r=range(1, 10, 0): range step 0"),
        ("adapter.r=choice(choice(8,16),32)", "a choice cannot hold another sweep"),
    ],
)
def test_bad_syntax_is_a_config_error_naming_the_key(override, needle):
    key, _, text = override.partition("=")
    with pytest.raises(ConfigError, match="adapter.r") as info:
        parse_params({key: text})
    assert needle in str(info.value)
