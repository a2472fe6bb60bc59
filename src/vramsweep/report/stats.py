"""Is a difference bigger than run-to-run noise? Two-sample t-tests and a one-way ANOVA, in plain Python.

scipy is not a dependency, so the t and F tail probabilities come from the regularised incomplete beta
function (continued fraction, Numerical Recipes §6.4), accurate to ~1e-10 here:

* two-sided t tail: ``P(|T| ≥ t) = I_{df/(df+t²)}(df/2, 1/2)``;
* F upper tail: ``P(F ≥ f) = I_{d2/(d2+d1·f)}(d2/2, d1/2)``.

Rules (what the report's marks mean, :data:`ALPHA` = 0.05):

* :func:`compare` (a point vs its reference, per metric): with ≥ 2 values in both arms, Welch's unequal
  variance t-test; with one value in one arm and ≥ 2 in the other, Student's t with the variance of the
  arm that has repeats (df = its n − 1: the single value is assumed as noisy as the repeated arm); with
  one value in both arms the noise is unknown and nothing is marked. Both arms exactly constant (e.g.
  peak memory on CPU, which is deterministic): any difference is real (p = 0), none is none (p = 1).
* :func:`anova_p` (does *any* config differ, per metric): one-way ANOVA F-test over the configs with the
  seed repeats as within-config noise; needs at least one config with ≥ 2 values.

These are tests on a handful of seeds: ``p < 0.05`` says "bigger than the seed-to-seed spread measured
here", not that the effect is large or transfers to another model or machine.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: Significance level of every mark in the report.
ALPHA = 0.05
SIGNIFICANT, NOISE, UNKNOWN = "significant", "noise", "unknown"
_TINY = 1e-300


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)`` for ``a, b > 0``, ``0 ≤ x ≤ 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln_front) * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| ≥ |t|)`` for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def f_upper_p(f: float, d1: float, d2: float) -> float:
    """``P(F ≥ f)`` for the F distribution with ``(d1, d2)`` degrees of freedom."""
    if f <= 0.0:
        return 1.0
    if math.isinf(f):
        return 0.0
    return betainc(d2 / 2.0, d1 / 2.0, d2 / (d2 + d1 * f))


@dataclass
class Comparison:
    """``mean(a) − mean(b)`` and whether it exceeds the seed-to-seed noise.

    Attributes:
        delta: difference of the means.
        se: its standard error (None when the noise is unknown).
        p: two-sided p-value (None when the noise is unknown).
        verdict: :data:`SIGNIFICANT` (p < :data:`ALPHA`), :data:`NOISE`, or :data:`UNKNOWN` (too few values).
        test: ``welch``, ``student`` (one arm has a single value) or ``none``.
        n_a, n_b: values per arm.
    """

    delta: float
    se: float | None
    p: float | None
    verdict: str
    test: str
    n_a: int
    n_b: int


def _is_zero(v: float, scale: float) -> bool:
    return v <= 1e-12 * max(1.0, scale)


def compare(a: list[float], b: list[float], alpha: float = ALPHA) -> Comparison | None:
    """Compare the values of arm ``a`` with reference arm ``b`` (see the module docstring); None if either is
    empty."""
    if not a or not b:
        return None
    na, nb = len(a), len(b)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    delta = ma - mb
    scale = max(abs(ma), abs(mb))
    if na >= 2 and nb >= 2:
        va, vb = statistics.variance(a), statistics.variance(b)
        se2 = va / na + vb / nb
        test = "welch"
        if _is_zero(math.sqrt(se2), scale):
            df = float(na + nb - 2)
        else:
            df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    elif na >= 2 or nb >= 2:
        var = statistics.variance(a if na >= 2 else b)
        df = float((na if na >= 2 else nb) - 1)
        se2 = var * (1.0 / na + 1.0 / nb)
        test = "student"
    else:
        return Comparison(delta, None, None, UNKNOWN, "none", na, nb)
    se = math.sqrt(se2)
    if _is_zero(se, scale):
        p = 0.0 if not _is_zero(abs(delta), scale) else 1.0
    else:
        p = t_two_sided_p(delta / se, df)
    return Comparison(delta, se, p, SIGNIFICANT if p < alpha else NOISE, test, na, nb)


def anova_p(groups: list[list[float]]) -> float | None:
    """One-way ANOVA p-value that the group means differ; None when it cannot be told (fewer than two
    groups with values, or no group with ≥ 2 values to measure the noise)."""
    groups = [g for g in groups if g]
    k = len(groups)
    n = sum(len(g) for g in groups)
    if k < 2 or n - k < 1:
        return None
    grand = statistics.fmean(v for g in groups for v in g)
    means = [statistics.fmean(g) for g in groups]
    ss_between = sum(len(g) * (m - grand) ** 2 for g, m in zip(groups, means))
    ss_within = sum((v - m) ** 2 for g, m in zip(groups, means) for v in g)
    scale = max(1.0, abs(grand)) ** 2
    if ss_within <= 1e-24 * scale:
        return 0.0 if ss_between > 1e-24 * scale else 1.0
    f = (ss_between / (k - 1)) / (ss_within / (n - k))
    return f_upper_p(f, k - 1, n - k)
