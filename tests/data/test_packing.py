"""Packing (``data.packing``): examples in rows of ``context.max_tokens``, positions restarting per example,
attention never crossing examples; a packed step's loss and gradients equal its examples' unpacked."""

from __future__ import annotations

import pytest
import torch

from _grads import _examples, _KeepGrads, _rel, _step_grads
from vramsweep.config import ConfigError, compose
from vramsweep.config.rules import validate
from vramsweep.data.examples import IGNORE_INDEX, position_ids
from vramsweep.data.packing import pack_examples, packing_stats
from vramsweep.data.prep import collate_batch
from vramsweep.knobs import build_model, packed_attention
from vramsweep.knobs.packed_attention import PACKED_NAMES
from vramsweep.knobs.registry import loss_fn
from vramsweep.loop import Loop, fit

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

_LT = [(70, 58), (250, 239), (40, 9), (180, 120), (33, 20)]


def test_best_fit_decreasing_is_deterministic_and_keeps_every_token():
    ex = _examples([(n, n // 2) for n in (120, 90, 60, 60, 45, 30, 200, 10)])
    a = pack_examples(ex, 256, seed=1)
    assert [r.doc_id for r in a] == [r.doc_id for r in pack_examples(ex, 256, seed=1)]
    assert all(len(r.input_ids) <= 256 for r in a)
    assert sorted(d for r in a for d in r.doc_id.split("+")) == sorted(e.doc_id for e in ex)
    assert sum(len(r.input_ids) for r in a) == sum(len(e.input_ids) for e in ex)
    # 615 tokens: at least 3 rows of 256, and best fit finds 3
    assert len(a) == 3
    st = packing_stats(a, 256)
    assert st["rows"] == 3 and st["examples"] == 8
    assert st["padding_fraction"] == pytest.approx(1 - 615 / 768)


def test_labels_are_masked_at_every_boundary_and_positions_restart():
    ex = _examples([(5, 5), (4, 4), (3, 3)])
    (row,) = pack_examples(ex, 16, seed=0)
    starts = [0]
    for n in row.segments[:-1]:
        starts.append(starts[-1] + n)
    for s in starts[1:]:
        assert row.labels[s] == IGNORE_INDEX  # never predicted from the previous example's last token
    assert sum(1 for t in row.labels if t != IGNORE_INDEX) == 12 - 2
    assert position_ids(row.segments, 16)[starts[1] : starts[1] + 3] == [0, 1, 2]
    b = collate_batch([row], 0, 16)
    assert b["packed"] and b["input_ids"].shape == (1, 16)
    assert b["position_ids"][0, 12:].tolist() == [0, 1, 2, 3]  # the padding is a segment of its own
    assert b["n_tokens"] == 12 and b["n_loss_tokens"] == 12 - 3


def _packed_step(overrides, rows, width, packing=True):
    cfg = compose(["train.dtype=fp32", *overrides, f"data.packing={str(packing).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg).model
    if packing:  # eager/sdpa packing loads the segment-wise attention (knobs/packed_attention.py)
        impl = str(cfg.attention.implementation)
        assert model.config._attn_implementation == PACKED_NAMES[impl]
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    keep = _KeepGrads(params)
    batch = collate_batch(rows, 0, width)
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=[batch], loss_fn=loss_fn(cfg, model),
                device=torch.device("cpu"), steps=1, grad_accum=1, params=params)  # fmt: skip
    return fit(loop, [keep])[0], keep.grads


@pytest.mark.parametrize(
    "overrides",
    [
        ["attention=sdpa"],
        ["attention=eager"],
        ["attention=sdpa", "tiling=loss", "tiling.loss_chunk_tokens=64"],
    ],
    ids=["sdpa", "eager", "sdpa_tiled_loss"],
)
def test_a_packed_step_equals_its_examples_unpacked(overrides):
    ex = _examples(_LT)
    rows = pack_examples(ex, 320, seed=0)
    assert len(rows) < len(ex) and any(len(r.segments) > 1 for r in rows)
    packed_loss, packed = _packed_step(overrides, rows, 320)
    ref_loss, ref = _step_grads(overrides, ex, micro_batch=len(ex), grad_accum=1)
    assert _rel(packed, ref) < 1e-5, f"relative gradient difference {_rel(packed, ref):.2e}"
    assert packed_loss == pytest.approx(ref_loss, rel=1e-5)


def test_the_mask_path_also_equals_the_unpacked_step():
    """Rows packed onto a model built without data.packing (transformers' dense block-diagonal mask from
    the positions): the same numbers, so the segment-wise path and the mask path agree."""
    ex = _examples(_LT)
    rows = pack_examples(ex, 320, seed=0)
    mask_loss, mask_grads = _packed_step(["attention=sdpa"], rows, 320, packing=False)
    seg_loss, seg_grads = _packed_step(["attention=sdpa"], rows, 320)
    assert _rel(seg_grads, mask_grads) < 1e-5
    assert seg_loss == pytest.approx(mask_loss, rel=1e-5)


def test_segment_attention_runs_per_example_without_a_dense_mask(monkeypatch):
    """Every SDPA call of a packed step is causal over one segment, with no attn_mask (no T x T tensor)."""
    ex = _examples(_LT)
    rows = pack_examples(ex, 320, seed=0)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[0], q.shape[2], attn_mask is None, kw.get("is_causal")))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _packed_step(["attention=sdpa"], rows, 320)
    segments = {n for r in rows for n in [*r.segments, 320 - len(r.input_ids)] if n}
    assert seen and all(none for _, _, none, _ in seen)
    assert {n for _, n, _, _ in seen} <= segments and max(n for _, n, _, _ in seen) < 320
    assert all(b == 1 and (causal or n == 1) for b, n, _, causal in seen)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_ignoring_the_segments_attends_across_examples(monkeypatch, impl):
    """The exactness test can fail on the segment-wise path: one segment per row (attention across the
    packed examples) gives another loss than the unpacked step."""
    ex = _examples(_LT)
    rows = pack_examples(ex, 320, seed=0)
    monkeypatch.setattr(packed_attention, "segment_bounds", lambda pos: [[(0, pos.shape[1])]] * pos.shape[0])
    crossed, _ = _packed_step([f"attention={impl}"], rows, 320)
    ref_loss, _ = _step_grads([f"attention={impl}"], ex, micro_batch=len(ex), grad_accum=1)
    assert abs(crossed - ref_loss) > 1e-3


def test_without_restarting_positions_the_rows_attend_across_examples():
    """The exactness test above can fail: with positions 0..T-1 over the whole row (plain concatenation)
    the loss differs from the unpacked one."""
    ex = _examples(_LT)
    rows = pack_examples(ex, 320, seed=0)
    for r in rows:
        r.segments = [len(r.input_ids)]  # one segment: causal attention over the whole row
    naive_loss, _ = _packed_step(["attention=sdpa"], rows, 320)
    ref_loss, _ = _step_grads(["attention=sdpa"], ex, micro_batch=len(ex), grad_accum=1)
    assert abs(naive_loss - ref_loss) > 1e-3


def test_the_rules_accept_long_packed_rows_and_refuse_random_and_unsloth():
    """No T x T mask (segment-wise attention): eager/sdpa packing has no length cap of its own."""
    for impl in ("sdpa", "eager"):
        cfg = compose(
            ["model=qwen3_0_6b", "data.packing=true", f"attention={impl}", "context.max_tokens=32768"]
        )
        validate(cfg, machine=False)
    with pytest.raises(ConfigError, match="data.packing"):
        validate(compose(["data=random", "data.packing=true"]), machine=False)
    validate(compose(["data.packing=true", "context.max_tokens=512"]), machine=False)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_estimate_counts_full_rows_and_no_mask(impl):
    from vramsweep.estimate import estimate

    base = ["context.max_tokens=1024", "train.micro_batch=2", f"attention={impl}"]
    plain = estimate(compose(base), seq_len=300)
    packed = estimate(compose([*base, "data.packing=true"]), seq_len=300)
    assert packed["peak_memory_bytes"] > plain["peak_memory_bytes"]  # a row is always 1024 long
    full = estimate(compose(base), seq_len=1024)  # padded: (b,1,s,s) masks; packed rows have none
    assert packed["peak_memory_bytes"] <= full["peak_memory_bytes"]
    if impl == "sdpa":  # SDPA's bool + float (b,1,s,s) masks are saved for backward
        assert packed["peak_memory_bytes"] < full["peak_memory_bytes"]
    one = ["context.max_tokens=1024", "train.micro_batch=1", "attention=sdpa"]
    assert (
        estimate(compose([*one, "data.packing=true"]), seq_len=300)["peak_memory_bytes"]
        == estimate(compose(one), seq_len=1024)["peak_memory_bytes"]
    )  # sdpa, one row: a packed row costs what an unpadded full row costs


def test_max_context_grows_the_packed_rows_and_the_rules_accept_it():
    from vramsweep.estimate import estimate, max_context

    over = ["model=qwen3_0_6b", "hardware.budget_gib=100", "quant=nf4_dq", "checkpointing=on"]
    free = max_context(compose(over))["max_tokens"]
    res = max_context(compose([*over, "data.packing=true"]))
    got = res["max_tokens"]
    assert got >= free > 16_384  # no mask cap any more (the old one was 16,384 tokens)
    cfg = compose([*over, "data.packing=true", f"context.max_tokens={got}"])
    validate(cfg, machine=False)  # what max_context proposes, the rules accept
    assert estimate(cfg)["fits"]  # and the pre-flight agrees
    nxt = compose([*over, "data.packing=true", f"context.max_tokens={got + 1}"])
    assert not estimate(nxt)["fits"]


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_packing_on_flash_attention_2_refuses_more_than_one_row_per_forward(micro_batch):
    """transformers takes FA2's varlen path for packed rows only at batch 1; at micro_batch >= 2 the packed
    examples would attend to each other (issue 49.4). Refused by the rules (no CUDA needed to decide), naming
    the overrides; micro_batch=1, sdpa/eager, or no packing pass."""
    base = ["data.packing=true", "attention=flash_attention_2", "hardware=h100_80gb"]
    with pytest.raises(ConfigError) as err:
        compose([*base, f"train.micro_batch={micro_batch}", "train.grad_accum=2"], rules="config")
    msg = str(err.value)
    assert err.value.key == "train.micro_batch" and "\n" not in msg
    assert "train.micro_batch=1" in msg and f"train.grad_accum={2 * micro_batch}" in msg
    assert "attention=sdpa" in msg
    compose([*base, "train.micro_batch=1"], rules="config")
    for ok in (["attention=sdpa"], ["data.packing=false"]):
        compose([*base, f"train.micro_batch={micro_batch}", *ok], rules="config")


def test_packing_on_flash_attention_2_with_micro_batch_2_exits_2_before_building(tmp_path, capsys):
    from vramsweep.cli import main

    over = [
        "data.packing=true",
        "attention=flash_attention_2",
        "train.micro_batch=2",
        f"results_dir={tmp_path}",
    ]
    assert main(["train", *over]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.micro_batch=1" in err[0], err
    assert not any(tmp_path.iterdir())  # nothing written
