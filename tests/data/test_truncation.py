"""Truncation strategies: hand-checked cases and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramsweep.data.truncation import ContextOverflowError, kept_lengths, truncate_sections

PROPS = settings(max_examples=150, deadline=None)


def make_sections(lengths: list[int]) -> list[list[int]]:
    """Distinct tokens per section so prefixes/suffixes can be recognised: section i = [i*1000, i*1000+1, ...]."""
    return [[i * 1000 + j for j in range(n)] for i, n in enumerate(lengths)]


lengths_st = st.lists(st.integers(0, 300), min_size=1, max_size=12)
budget_st = st.integers(0, 1500)
decay_st = st.floats(0.0, 1.0, allow_nan=False)
min_tok_st = st.integers(0, 40)
strategy_st = st.sampled_from(["head", "tail", "exp_decay"])


# ----------------------------------------------------------------------------------------------- examples
def test_everything_fits_is_unchanged_for_every_strategy():
    secs = make_sections([5, 7, 3])
    for strategy in ("none", "head", "tail", "exp_decay"):
        assert truncate_sections(secs, 15, strategy) == secs


def test_none_raises_when_over_budget():
    with pytest.raises(ContextOverflowError, match="16 tokens exceeds the budget of 15") as info:
        truncate_sections(make_sections([5, 8, 3]), 15, "none")
    assert isinstance(info.value, ValueError)
    assert "context.truncation" in str(info.value)


def test_head_and_tail_keep_the_ends_of_the_concatenation():
    secs = make_sections([4, 4, 4])
    assert truncate_sections(secs, 6, "head") == [secs[0], secs[1][:2], []]
    assert truncate_sections(secs, 6, "tail") == [[], secs[1][2:], secs[2]]


def test_exp_decay_hand_checked_allocation():
    # newest 250 kept whole; R = 250 shared with weights 0.5, 0.25, 0.125, 0.0625 (k-th older):
    # 150 (k=1) is kept whole at theta>=300, then the rest (100) is split 2:1:0.5:... and thin ones dropped.
    lengths = [300, 200, 400, 150, 250]
    assert kept_lengths(lengths, 500, "exp_decay", 0.5, 16) == [17, 33, 67, 133, 250]
    assert kept_lengths(lengths, 500, "exp_decay", 0.5, 64) == [0, 0, 100, 150, 250]
    # decay=1: equal weights among the older sections; largest-remainder ties go to the newer section.
    assert kept_lengths(lengths, 500, "exp_decay", 1.0, 16) == [62, 62, 63, 63, 250]
    # decay=0: older sections only when they fit whole, newest first.
    assert kept_lengths(lengths, 500, "exp_decay", 0.0, 16) == [0, 0, 0, 150, 250]


def test_exp_decay_keeps_tails_and_newest_tail_when_it_alone_overflows():
    secs = make_sections([50, 60, 400])
    out = truncate_sections(secs, 100, "exp_decay")
    assert out == [[], [], secs[2][-100:]]
    out = truncate_sections(secs, 460, "exp_decay", decay=0.5, min_tokens_per_section=16)
    assert out[2] == secs[2]
    for kept, sec in zip(out[:2], secs[:2]):
        assert kept == sec[len(sec) - len(kept) :]  # suffix: nearest to the target
    assert sum(map(len, out)) == 460


def test_exp_decay_drops_oldest_first_even_if_it_is_short():
    # The 5-token section (k=2) would fit, but then the 1000-token k=1 section could only get 15 < 16 tokens:
    # recency wins, the old short one is dropped and k=1 gets the whole remaining budget.
    assert kept_lengths([5, 1000, 300], 320, "exp_decay", 0.9, 16) == [0, 20, 300]
    # When the newer section cannot reach the floor even alone, it is dropped and the budget is left unused.
    assert kept_lengths([1000, 5, 300], 320, "exp_decay", 0.9, 16) == [0, 5, 300]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(strategy="middle"), "unknown truncation strategy"),
        (dict(decay=1.5), "context.decay"),
        (dict(decay=-0.1), "context.decay"),
        (dict(min_tokens_per_section=-1), "min_tokens_per_section"),
        (dict(budget=-1), "budget"),
    ],
)
def test_bad_parameters_raise(kwargs, match):
    args = dict(sections=make_sections([10, 10]), budget=5, strategy="exp_decay") | kwargs
    with pytest.raises(ValueError, match=match):
        truncate_sections(**args)


def test_input_is_not_modified():
    secs = make_sections([30, 40, 50])
    copy = [list(s) for s in secs]
    truncate_sections(secs, 70, "exp_decay")
    assert secs == copy


# ----------------------------------------------------------------------------------------------- properties
@PROPS
@given(lengths_st, budget_st, strategy_st, decay_st, min_tok_st)
def test_never_over_budget_and_keeps_contiguous_ends(lengths, budget, strategy, decay, min_tok):
    secs = make_sections(lengths)
    out = truncate_sections(secs, budget, strategy, decay=decay, min_tokens_per_section=min_tok)
    assert len(out) == len(secs)
    assert sum(map(len, out)) <= budget
    assert sum(map(len, out)) == min(budget, sum(lengths)) or strategy == "exp_decay"
    for kept, sec in zip(out, secs):
        if strategy == "head":
            assert kept == sec[: len(kept)]
        else:
            assert kept == sec[len(sec) - len(kept) :]


@PROPS
@given(lengths_st, budget_st, decay_st, min_tok_st)
def test_exp_decay_newest_whole_when_it_fits(lengths, budget, decay, min_tok):
    secs = make_sections(lengths)
    out = truncate_sections(secs, budget, "exp_decay", decay=decay, min_tokens_per_section=min_tok)
    if lengths[-1] <= budget:
        assert out[-1] == secs[-1]
    else:
        assert out[-1] == secs[-1][-budget:] if budget else out[-1] == []
        assert all(k == [] for k in out[:-1])


@PROPS
@given(lengths_st, budget_st, decay_st, decay_st, min_tok_st)
# Float regressions: a running-total subtraction cancelled, and theta = R / w overflowed for subnormal w.
@example(lengths=[2, 0, 0], budget=1, d1=1.0, d2=5.6023504718035163e-132, min_tok=2)
@example(lengths=[2, 0], budget=1, d1=1.0, d2=2.225073858507e-311, min_tok=2)
def test_exp_decay_monotone_in_decay(lengths, budget, d1, d2, min_tok):
    lo, hi = sorted((d1, d2))
    older_lo = sum(kept_lengths(lengths, budget, "exp_decay", lo, min_tok)[:-1])
    older_hi = sum(kept_lengths(lengths, budget, "exp_decay", hi, min_tok)[:-1])
    assert older_lo <= older_hi


@PROPS
@given(lengths_st, budget_st, strategy_st, decay_st, min_tok_st)
def test_deterministic(lengths, budget, strategy, decay, min_tok):
    a = truncate_sections(
        make_sections(lengths), budget, strategy, decay=decay, min_tokens_per_section=min_tok
    )
    b = truncate_sections(
        make_sections(lengths), budget, strategy, decay=decay, min_tokens_per_section=min_tok
    )
    assert a == b


@PROPS
@given(lengths_st, budget_st)
def test_none_raises_exactly_when_over(lengths, budget):
    secs = make_sections(lengths)
    if sum(lengths) > budget:
        with pytest.raises(ContextOverflowError):
            truncate_sections(secs, budget, "none")
    else:
        assert truncate_sections(secs, budget, "none") == secs


@PROPS
@given(lengths_st, budget_st, decay_st, st.integers(1, 40))
def test_exp_decay_uses_budget_and_respects_floor_and_recency(lengths, budget, decay, min_tok):
    kept = kept_lengths(lengths, budget, "exp_decay", decay, min_tok)
    older = list(zip(lengths[:-1], kept[:-1]))[::-1]  # newest older section first
    cut = [(n, k) for n, k in older if 0 < k < n]
    # A partly kept section holds at least the floor; if any is cut, the whole budget is used.
    assert all(k >= min_tok for _, k in cut)
    if cut:
        assert sum(kept) == budget
    # Dropping is oldest first: after the first dropped (non-empty) section, every older one is dropped too.
    dropped = [n > 0 and k == 0 for n, k in older]
    if True in dropped:
        first = dropped.index(True)
        assert all(k == 0 for _, k in older[first:])
    # Among cut sections, a newer one keeps at least as many tokens as an older one.
    cut_kept = [k for _, k in cut]
    assert cut_kept == sorted(cut_kept, reverse=True)
    # Unused budget only when every surviving section is whole.
    if sum(kept) < min(budget, sum(lengths)):
        assert not cut
