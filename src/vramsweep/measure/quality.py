"""Task-quality metrics that move continuously: teacher-forced accuracy and NLL on two token sets.

The held-out eval scores every *target* token (the loss-bearing tokens of an example) under teacher
forcing: the model sees the true prefix and predicts the next token. Two disjoint sets of target tokens
are reported separately:

* **fact tokens** — the tokens of fact values that the target section repeats from an earlier section
  (:attr:`vramsweep.data.examples.Example.fact_spans`). The values are random (acronyms, names, dates,
  amounts), so they are predictable only by copying them from the earlier statement: when truncation
  drops that statement, these tokens fall towards chance.
* **control tokens** — every other target token (template prose, headings, the EOS). They need no long
  context: the section's own prefix predicts them about as well as the whole document does.

So a *lost context* shows as ``fact_*`` getting worse while ``control_*`` stays put, and a *worse model*
(quantisation error, a too-small adapter, too few steps) moves both. ``fact_token_acc`` / ``fact_nll``
also move when the exact-match ``task_score`` does not (a span with one wrong token out of five scores 0
there, 0.8 here).

Metrics (keys of :data:`QUALITY_KEYS`, ``None`` when the set is empty, e.g. no fact spans):

* ``fact_token_acc`` — fraction of fact tokens that are the argmax prediction at the previous position.
* ``fact_nll`` — mean negative log-likelihood (nats) of the fact tokens.
* ``control_token_acc`` / ``control_nll`` — the same over the control tokens.
* ``fact_tokens`` / ``control_tokens`` — how many tokens each mean is over.

This module depends on torch only (``measure/`` is a lower floor of the package).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vramsweep.record.metrics import MetricName

__all__ = ["QUALITY_KEYS", "QualityMeter", "fact_mask"]

#: The metrics this module measures (registry names, as plain strings: the keys of
#: :meth:`QualityMeter.metrics`).
QUALITY_KEYS = tuple(
    str(m)
    for m in (
        MetricName.FACT_TOKEN_ACC,
        MetricName.FACT_NLL,
        MetricName.CONTROL_TOKEN_ACC,
        MetricName.CONTROL_NLL,
        MetricName.FACT_TOKENS,
        MetricName.CONTROL_TOKENS,
    )
)


def fact_mask(n: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Bool mask over the ``n`` *shifted* label positions (index ``t - 1`` scores input token ``t``) that
    marks the tokens inside ``spans`` (``[start, end)`` positions in the input ids, ``start >= 1``).

    Raises:
        ValueError: a span outside ``1..n`` (the caller's spans do not belong to this sequence).
    """
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        if not 1 <= start < end <= n + 1:
            raise ValueError(f"fact span {(start, end)} is outside the sequence (positions 1..{n})")
        mask[start - 1 : end - 1] = True
    return mask


class QualityMeter:
    """Accumulates teacher-forced hits and NLL over fact and control tokens, one sequence at a time."""

    def __init__(self) -> None:
        self._hits = {"fact": 0, "control": 0}
        self._nll = {"fact": 0.0, "control": 0.0}
        self._count = {"fact": 0, "control": 0}

    def add(
        self,
        nll: torch.Tensor,
        pred: torch.Tensor,
        labels: torch.Tensor,
        spans: Sequence[tuple[int, int]],
    ) -> None:
        """Add one sequence.

        Args:
            nll: per-position NLL ``[n]`` (``-log p(labels[t])``; any value where ``labels[t] == -100``).
            pred: per-position argmax ``[n]`` (the model's guess for ``labels[t]``).
            labels: the *shifted* labels ``[n]`` (``labels[t]`` is input token ``t + 1``; -100 = not scored).
            spans: fact spans ``[start, end)`` in input-id positions (as in ``Example.fact_spans``).
        """
        n = int(labels.shape[0])
        if nll.shape[0] != n or pred.shape[0] != n:
            raise ValueError(f"nll {tuple(nll.shape)}, pred {tuple(pred.shape)} and labels ({n},) differ")
        labels = labels.detach().cpu()
        scored = labels != -100
        fact = fact_mask(n, spans) & scored
        control = scored & ~fact
        hit = pred.detach().cpu() == labels
        nll = nll.detach().float().cpu()
        for name, mask in (("fact", fact), ("control", control)):
            self._hits[name] += int((hit & mask).sum())
            self._nll[name] += float(nll[mask].sum())
            self._count[name] += int(mask.sum())

    def metrics(self) -> dict[str, float | int | None]:
        """The :data:`QUALITY_KEYS` (means are ``None`` over an empty set)."""
        out: dict[str, float | int | None] = {}
        for name in ("fact", "control"):
            c = self._count[name]
            out[f"{name}_token_acc"] = self._hits[name] / c if c else None
            out[f"{name}_nll"] = self._nll[name] / c if c else None
            out[f"{name}_tokens"] = c
        return {k: out[k] for k in QUALITY_KEYS}
