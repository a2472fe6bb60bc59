"""Packed rows on SDPA without a host read in the forward (issue 53): collate computes each row's segments
on the host, the loop hands them to the segment-wise attention with the position ids it moves to the
device, and the forward never reads ``position_ids`` back (a device sync per forward on CUDA). The SDPA
launches are counted: one per segment per row per layer."""

from __future__ import annotations

import pytest
import torch

from _grads import _examples
from vramsweep.config import compose
from vramsweep.data.packing import pack_examples
from vramsweep.data.prep import collate_batch
from vramsweep.knobs import build_model, packed_attention
from vramsweep.knobs.registry import loss_fn
from vramsweep.loop import Loop, fit, loss_kwargs

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

_LT = [(70, 58), (250, 239), (40, 9), (180, 120), (33, 20)]


def _rows():
    rows = pack_examples(_examples(_LT), 320, seed=0)
    assert any(len(r.segments) > 1 for r in rows)
    return rows


def test_collate_computes_the_segments_on_the_host():
    rows = _rows()
    b = collate_batch(rows, 0, 320)
    assert b["segment_bounds"] == packed_attention.bounds_of(b["position_ids"])
    for r, bounds in zip(rows, b["segment_bounds"], strict=True):
        ends = [e for _, e in bounds]
        lengths = [e - s for s, e in bounds]
        assert lengths[: len(r.segments)] == list(r.segments) and ends[-1] == 320  # + the padding segment
    assert "segment_bounds" not in collate_batch([_examples([(20, 5)])[0]], 0)  # unpacked rows: none


def test_a_packed_step_reads_no_positions_back_and_launches_one_sdpa_per_segment(monkeypatch):
    """Before: one ``position_ids.tolist()`` per forward (HOST_READS +1 per micro-batch); now 0. The SDPA
    calls are layers x segments (4 layers here)."""
    rows = _rows()
    cfg = compose(["train.dtype=fp32", "attention=sdpa", "data.packing=true"])
    torch.manual_seed(0)
    model = build_model(cfg).model
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *a, **kw):
        calls.append(q.shape[2])
        return real(q, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    batches = [collate_batch([r], 0, 320) for r in rows]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn(cfg, model),
                device=torch.device("cpu"), steps=len(batches), grad_accum=1, params=params)  # fmt: skip
    reads = packed_attention.HOST_READS[0]
    fit(loop, [])
    assert packed_attention.HOST_READS[0] == reads  # no forward read the positions back
    segments = sum(len(b["segment_bounds"][0]) for b in batches)
    assert len(calls) == 4 * segments  # one launch per segment per layer (no recompute: checkpointing off)
    assert sorted(calls) == sorted(
        e - s for b in batches for s, e in b["segment_bounds"][0] for _ in range(4)
    )


def test_without_collates_segments_the_forward_reads_them_once():
    """The fallback (positions given without bounds, e.g. a caller's own batch): one host read per forward,
    counted, not one per layer."""
    cfg = compose(["train.dtype=fp32", "attention=sdpa", "data.packing=true"])
    model = build_model(cfg).model
    b = collate_batch(_rows()[:1], 0, 320)
    reads = packed_attention.HOST_READS[0]
    with torch.no_grad():
        model(input_ids=b["input_ids"], position_ids=b["position_ids"].clone())
    assert packed_attention.HOST_READS[0] == reads + 1
    kw = loss_kwargs(b, torch.device("cpu"))
    with torch.no_grad():
        model(input_ids=b["input_ids"], **kw)
    assert packed_attention.HOST_READS[0] == reads + 1  # the loop's path: none
