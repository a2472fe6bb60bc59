"""Fit a document's earlier sections into a token budget (``context.truncation``).

Sections are ordered oldest -> newest; the newest is the one just before the training target, so it is the
most relevant. Every strategy is deterministic, never exceeds the budget and returns one (possibly empty)
token list per input section. When everything fits, every strategy returns the sections unchanged.

* ``none``: no truncation; :class:`ContextOverflowError` when the sections do not fit.
* ``head``: the first ``budget`` tokens of the concatenation (the oldest material).
* ``tail``: the last ``budget`` tokens of the concatenation (the newest material).
* ``exp_decay``: recency-weighted shares, described below.

``exp_decay`` (parameters ``decay`` in [0, 1] and ``min_tokens_per_section``):

1. The newest section is kept whole when it fits, else its last ``budget`` tokens.
2. The remaining budget ``R`` is shared among the older sections by weighted water-filling: the k-th older
   section (k = 1 for the one just before the newest) has weight ``decay**k`` and receives
   ``min(length_k, theta * decay**k)`` tokens, with the level ``theta`` chosen so that the allocations add up
   to ``min(R, total length)``. A section shorter than its share is kept whole and the unused part of its
   share flows to the others (in particular to older sections), so the budget is used fully whenever there
   is enough material.
3. A section is *too thin* when its share is below ``min(min_tokens_per_section, length)``, i.e. it would be
   cut to fewer than ``min_tokens_per_section`` tokens. While any section is too thin, the oldest remaining
   section is dropped (kept as ``[]``) and the shares are recomputed: recency wins, and dropping a section
   only ever increases the shares of the newer ones.
4. Real-valued shares are rounded to integers by the largest-remainder method (ties to the newer section),
   so the kept total is exactly ``min(R, length of the surviving sections)``.
5. Each truncated section keeps its *last* tokens (nearest to the target).

Why this is monotone in ``decay``: a larger ``decay`` flattens the weights, so the share of the oldest
uncut section can only grow; fewer sections are too thin, so at least as many survive, and the kept total
``min(R, surviving length)`` cannot shrink. The set of surviving sections is always the newest ``j`` older
sections, found by bisection (a set without thin sections stays so when its oldest member is removed).
``decay = 0`` keeps only the newest section; ``decay = 1`` gives all older sections equal weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["STRATEGIES", "ContextOverflowError", "kept_lengths", "truncate_sections"]

STRATEGIES: tuple[str, ...] = ("none", "head", "tail", "exp_decay")

# Float slack when comparing real-valued shares with integer thresholds (shares are sums/products of
# at most a few hundred terms; errors are ~1e-12 relative, far below this).
_EPS = 1e-7


class ContextOverflowError(ValueError):
    """The sections (or the target) do not fit the budget and ``context.truncation=none`` forbids cutting."""


#: Characters tokenised per batch when ``truncation=none`` is checked over a data set (records or documents
#: longest first; the check stops at the first batch holding one that does not fit). A 55 MB file was
#: refused only after all of it was tokenised (~60 s); a file that fits is tokenised whole either way.
CHECK_BATCH_CHARS = 1 << 21


def longest_first(sizes: Sequence[int]) -> Iterator[list[int]]:
    """The indices of ``sizes`` in batches of about :data:`CHECK_BATCH_CHARS` in total (at least one index
    each), largest first, ties in order: a ``truncation=none`` check meets the likeliest offenders first."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    batch: list[int] = []
    total = 0
    for i in order:
        if batch and total + sizes[i] > CHECK_BATCH_CHARS:
            yield batch
            batch, total = [], 0
        batch.append(i)
        total += sizes[i]
    if batch:
        yield batch


def _check(budget: int, strategy: str, decay: float, min_tokens_per_section: int) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown truncation strategy {strategy!r}; use context.truncation= one of {STRATEGIES}"
        )
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    if not (isinstance(decay, (int, float)) and 0.0 <= float(decay) <= 1.0):
        raise ValueError(f"context.decay must be in [0, 1], got {decay!r}")
    if isinstance(min_tokens_per_section, bool) or not isinstance(min_tokens_per_section, int):
        raise ValueError(f"context.min_tokens_per_section must be an int, got {min_tokens_per_section!r}")
    if min_tokens_per_section < 0:
        raise ValueError(f"context.min_tokens_per_section must be >= 0, got {min_tokens_per_section}")


def _water_fill(lengths: Sequence[int], weights: Sequence[float], budget: int) -> list[float]:
    """Real shares ``min(L_k, theta * w_k)`` adding up to ``min(budget, sum L)`` (zero weight -> zero
    share)."""
    if sum(lengths) <= budget:
        return [float(n) for n in lengths]
    shares = [0.0] * len(lengths)
    # Sections cap (are kept whole) in order of L_k / w_k: the level theta at which they fill up.
    # (log L_k - log w_k: no overflow for tiny weights; L_k = 0 sorts first.)
    order = sorted(
        (k for k in range(len(lengths)) if weights[k] > 0.0),
        key=lambda k: (math.log(lengths[k]) - math.log(weights[k]) if lengths[k] else -math.inf, k),
    )
    # weight_left[i] = total weight of order[i:], built by additions only: subtracting capped weights from a
    # running total cancels catastrophically when weights span hundreds of orders of magnitude.
    weight_left = [0.0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        weight_left[i] = weight_left[i + 1] + weights[order[i]]
    remaining = budget  # an int: exact
    i = 0
    while i < len(order):
        k = order[i]
        if lengths[k] * weight_left[i] <= remaining * weights[k]:  # L_k / w_k <= theta: kept whole
            shares[k] = float(lengths[k])
            remaining -= lengths[k]
            i += 1
        else:
            break
    for k in order[i:]:  # theta * w_k, written so that tiny weights cannot overflow theta
        shares[k] = min(float(lengths[k]), remaining * (weights[k] / weight_left[i]))
    return shares


def _thin(lengths: Sequence[int], shares: Sequence[float], min_tokens: int) -> bool:
    return any(s + _EPS < min(min_tokens, n) for n, s in zip(lengths, shares))


def _round(lengths: Sequence[int], shares: Sequence[float], total: int) -> list[int]:
    """Largest-remainder rounding of ``shares`` to integers adding up to ``total`` (each <= its length)."""
    out = [min(n, math.floor(s + _EPS)) for n, s in zip(lengths, shares)]
    left = total - sum(out)
    if left > 0:
        # Biggest fractional part first; ties go to the newer section (smaller index = newer here).
        order = sorted(range(len(out)), key=lambda k: (-(shares[k] - out[k]), k))
        for k in order:
            if left == 0:
                break
            if out[k] < lengths[k]:
                out[k] += 1
                left -= 1
    while left < 0:  # float slack over-allocated: take back from the oldest sections first
        for k in reversed(range(len(out))):
            if left == 0:
                break
            if out[k] > 0:
                out[k] -= 1
                left += 1
    return out


def _exp_decay(lengths: Sequence[int], budget: int, decay: float, min_tokens: int) -> list[int]:
    n = len(lengths)
    kept = [0] * n
    newest = min(lengths[-1], budget)
    kept[-1] = newest
    rest = budget - newest
    older = [lengths[n - 1 - k] for k in range(1, n)]  # index k-1 <-> k-th older section
    if rest <= 0 or not older:
        return kept
    weights = [float(decay) ** k for k in range(1, n)]

    def ok(j: int) -> bool:  # the newest j older sections survive without thin sections
        return not _thin(older[:j], _water_fill(older[:j], weights[:j], rest), min_tokens)

    lo, hi = 0, len(older)  # ok(0) is trivially true; find the largest j with ok(j)
    if ok(hi):
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    j = lo
    shares = _water_fill(older[:j], weights[:j], rest)
    alloc = _round(older[:j], shares, min(rest, sum(older[:j])))
    for k, a in enumerate(alloc, start=1):
        kept[n - 1 - k] = a
    return kept


def kept_lengths(
    lengths: Sequence[int],
    budget: int,
    strategy: str,
    decay: float = 0.5,
    min_tokens_per_section: int = 16,
) -> list[int]:
    """How many tokens of each section :func:`truncate_sections` keeps, from the section lengths alone.

    Useful to estimators that do not need the tokens. Same arguments and errors as :func:`truncate_sections`.
    """
    _check(budget, strategy, decay, min_tokens_per_section)
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("section lengths must be >= 0")
    total = sum(lengths)
    if total <= budget:
        return list(lengths)
    if strategy == "none":
        raise ContextOverflowError(
            f"context of {total} tokens exceeds the budget of {budget} tokens; set context.truncation= "
            f"head, tail or exp_decay, or raise context.max_tokens"
        )
    if strategy == "head":
        out, left = [], budget
        for n in lengths:
            out.append(min(n, left))
            left -= out[-1]
        return out
    if strategy == "tail":
        out_rev, left = [], budget
        for n in reversed(lengths):
            out_rev.append(min(n, left))
            left -= out_rev[-1]
        return out_rev[::-1]
    return _exp_decay(lengths, budget, float(decay), min_tokens_per_section)


def truncate_sections(
    sections: list[list[int]],
    budget: int,
    strategy: str,
    decay: float = 0.5,
    min_tokens_per_section: int = 16,
) -> list[list[int]]:
    """Fit ``sections`` (token lists, oldest -> newest) into ``budget`` tokens (module docstring for the
    rules).

    Args:
        sections: one token list per section, oldest first.
        budget: the most tokens the returned sections may hold together (>= 0).
        strategy: ``none`` | ``head`` | ``tail`` | ``exp_decay``.
        decay: ``exp_decay`` only: the k-th older section's weight is ``decay**k`` (0 <= decay <= 1).
        min_tokens_per_section: ``exp_decay`` only: a section that would be cut below this is dropped.

    Returns:
        A new list with one list per input section (``[]`` when dropped): a prefix of the section for
        ``head`` at the cut, a suffix of it otherwise. Their total length is ``<= budget``.

    Raises:
        ContextOverflowError: ``strategy="none"`` and the sections hold more than ``budget`` tokens.
        ValueError: unknown strategy or out-of-range parameters.
    """
    keep = kept_lengths([len(s) for s in sections], budget, strategy, decay, min_tokens_per_section)
    if strategy == "head":
        return [list(s[:k]) for s, k in zip(sections, keep)]
    return [list(s[len(s) - k :]) if k else [] for s, k in zip(sections, keep)]
