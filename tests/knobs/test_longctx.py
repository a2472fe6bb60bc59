"""Long-context components (vramsweep.longctx): exact against the plain computation, and smaller.

Tiled loss == HF's loss; tiled MLP == untiled; offloaded checkpoints == checkpointing=on (values and
gradients, fp32 on CPU, LoRA dropout on so the RNG replay is exercised); the CPU tracker shows the drop.
"""

from __future__ import annotations

import pytest
import torch

from vramsweep.longctx.loss import causal_lm_loss, chunked_linear_cross_entropy
from vramsweep.longctx.mlp import TiledMLP, tile_mlps
from vramsweep.longctx.offload import enable_offload
from vramsweep.measure.cpu import TensorMemoryTracker

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_matches_cross_entropy(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v = 50, 16, 97
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100)
    ref.backward()
    rh, rw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    (out * 2).backward()  # a non-unit upstream gradient must scale both gradients
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.item() == pytest.approx(ref.item(), rel=tol, abs=tol)
    torch.testing.assert_close(hidden.grad.float(), 2 * rh.float(), rtol=tol * 5, atol=tol)
    torch.testing.assert_close(weight.grad.float(), 2 * rw.float(), rtol=tol * 5, atol=tol)


def test_chunked_ce_rejects_bad_chunk():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_linear_cross_entropy(
            torch.zeros(2, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), chunk_tokens=0
        )


def _model(*overrides):
    from vramsweep.config import compose
    from vramsweep.knobs import build_model

    cfg = compose(["train.dtype=fp32", "adapter.dropout=0.1", *overrides])
    built = build_model(cfg)
    built.model.train()
    return built.model


def _batch(seq=96, b=2, vocab=3072):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (b, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 3] = -100  # context tokens are not targets
    return ids, labels


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, fn, seed=123):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = fn()
    loss.backward()
    return loss.detach(), _grads(model)


def _same(a, b, rtol=1e-4, atol=1e-6):
    la, ga = a
    lb, gb = b
    assert la.item() == pytest.approx(lb.item(), rel=1e-5)
    assert ga.keys() == gb.keys() and ga
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=rtol, atol=atol, msg=k)


def test_tiled_loss_equals_hf_loss_on_the_tiny_model():
    model = _model()
    ids, labels = _batch()
    ref = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    got = _run(model, lambda: causal_lm_loss(model, ids, None, labels, chunk_tokens=17))
    _same(ref, got)


def test_tiled_mlp_equals_untiled():
    # Dropout off: tiles draw their dropout masks tile by tile (a different, equally distributed mask than
    # one draw over the whole sequence); the recompute replays each tile's mask exactly.
    model = _model("adapter.dropout=0.0")
    ids, labels = _batch()
    ref = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    assert tile_mlps(model, 20) == 4  # 4 decoder layers
    got = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    _same(ref, got)
    names = {n for n, _ in model.named_parameters()}
    assert not any(".mlp.mlp." in n for n in names)  # module names (and PEFT adapter names) unchanged


def test_offload_equals_checkpointing_on_with_lora_dropout():
    model = _model("checkpointing=on")
    ids, labels = _batch()
    ref = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    notes = enable_offload(model, torch.device("cpu"))
    assert notes["layers"] == 4 and notes["saves_device_memory"] is False and "saves nothing" in notes["note"]
    got = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    _same(ref, got)
    assert not model._vramsweep_offload.slots  # every offloaded input consumed by backward


def test_offload_plus_tiling_equals_plain():
    model = _model("checkpointing=on", "adapter.dropout=0.0")
    ids, labels = _batch()
    ref = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    enable_offload(model, torch.device("cpu"))
    tile_mlps(model, 32)
    got = _run(model, lambda: causal_lm_loss(model, ids, None, labels, chunk_tokens=64))
    _same(ref, got)


def _peak(model, fn):
    model.zero_grad(set_to_none=True)
    tracker = TensorMemoryTracker(model)
    with tracker:
        fn().backward()
    tracker.close()
    return tracker.peak_bytes, tracker.breakdown()


def test_tracker_shows_the_drop():
    """Tiled loss removes the seq x vocab logits (fp32 copy + gradient); tiled MLP the seq x intermediate
    tensors; at 512 tokens x 2 sequences on the tiny model (vocab 3072, intermediate 768)."""
    model = _model("adapter.dropout=0.0")
    ids, labels = _batch(seq=512)
    plain, _ = _peak(model, lambda: model(input_ids=ids, labels=labels).loss)
    tiled_loss, _ = _peak(model, lambda: causal_lm_loss(model, ids, None, labels, chunk_tokens=128))
    tile_mlps(model, 128)
    both, _ = _peak(model, lambda: causal_lm_loss(model, ids, None, labels, chunk_tokens=128))
    logits_fp32 = 2 * 511 * 3072 * 4
    assert plain - tiled_loss > logits_fp32, (plain, tiled_loss)
    assert both < tiled_loss, (tiled_loss, both)
    print(
        f"\npeak MiB: plain {plain / 2**20:.1f}, tiled loss {tiled_loss / 2**20:.1f}, + tiled MLP {both / 2**20:.1f}"
    )


def test_tiled_mlp_module_wrapper_and_validation():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 33, 8, requires_grad=True)
    ref = mlp(x)
    ref.sum().backward()
    gx, gw = x.grad.clone(), mlp[0].weight.grad.clone()
    x.grad = None
    mlp.zero_grad()
    out = TiledMLP(mlp, 10)(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(mlp[0].weight.grad, gw)
    with pytest.raises(ValueError, match="tile_tokens"):
        TiledMLP(mlp, 0)


# ---- the knobs: checkpointing=offload, tiling=loss|mlp|on change what runs --------------------------------


def test_offload_knob_installs_the_offloaded_checkpoint():
    from vramsweep.config import compose
    from vramsweep.knobs import build_model
    from vramsweep.longctx.offload import OffloadManager

    built = build_model(compose(["checkpointing=offload"]))
    assert built.notes["knobs"]["offload"]["layers"] == 4
    assert isinstance(built.model._vramsweep_offload, OffloadManager)
    plain = build_model(compose(["checkpointing=on"]))
    assert "offload" not in plain.notes["knobs"]


def test_tiling_knob_lowers_the_trial_peak(tmp_path):
    from conftest import FAST
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    def trial(name, *over):
        # fp32: the tiled loss and MLP are the same function, equal to rounding (in bf16 the shards' matmuls
        # round differently: 1e-4 relative on this eval loss, inside bf16's 2^-8)
        ov = [*FAST, "context.max_tokens=256", "train.micro_batch=2", "train.dtype=fp32"]
        ov += [f"results_dir={tmp_path / name}", *over]
        return run_trial(compose(ov), overrides=ov)

    off = trial("off")
    on = trial("on", "tiling=on", "tiling.loss_chunk_tokens=64", "tiling.mlp_tile_tokens=64")
    assert off["status"] == on["status"] == "ok", (off["reason"], on["reason"])
    assert on["meta"]["build"]["knobs"]["mlp_tiles"]["layers"] == 4
    assert on["metrics"]["peak_memory_bytes"] < 0.8 * off["metrics"]["peak_memory_bytes"]
    # same model, same data, same seed: the loss the loop sees is the same function
    assert on["metrics"]["initial_eval_loss"] == pytest.approx(off["metrics"]["initial_eval_loss"], rel=1e-6)
    assert on["metrics"]["train_loss"] == pytest.approx(off["metrics"]["train_loss"], rel=2e-2)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["checkpointing=offload", "checkpointing.use_reentrant=true"], "checkpointing.use_reentrant"),
        (["checkpointing=offload", "checkpointing.enabled=false"], "checkpointing"),
        (["tiling.loss_chunk_tokens=-1"], "tiling.loss_chunk_tokens"),
        (["tiling.mlp_tile_tokens=1.5"], "tiling.mlp_tile_tokens"),
    ],
)
def test_longctx_rules(overrides, key):
    from vramsweep.config import ConfigError, compose

    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert err.value.key == key


def test_unsloth_with_tiling_refused():
    from vramsweep.config import compose
    from vramsweep.config.rules import ConfigError, _rules_combinations

    cfg = compose(["kernels=unsloth", "tiling=on"], rules="none")
    with pytest.raises(ConfigError, match="kernels=unsloth"):
        _rules_combinations(cfg)


def test_adapter_dtype_compute_keeps_adapters_in_bf16_and_drops_fp32_input_copies():
    """adapter.dtype=compute: LoRA weights in the compute dtype, so PEFT no longer keeps an fp32 copy of each
    adapted projection's input for backward (the dominant activation term at long context)."""
    from vramsweep.config import compose
    from vramsweep.knobs import build_model

    peaks, dtypes = {}, {}
    ids, labels = _batch(seq=256)
    for mode in ("fp32", "compute"):
        built = build_model(compose([f"adapter.dtype={mode}"]))  # default train.dtype=bf16
        model = built.model
        model.train()
        dtypes[mode] = {p.dtype for p in model.parameters() if p.requires_grad}
        peaks[mode], bd = _peak(model, lambda m=model: m(input_ids=ids, labels=labels).loss)
        peaks[mode] = bd["activations"]
    assert dtypes == {"fp32": {torch.float32}, "compute": {torch.bfloat16}}
    assert peaks["compute"] < 0.8 * peaks["fp32"], peaks


# --- tiles in every pass; dropout masks the same in forward and recompute


def _tiny_longctx(ckpt: str, dropout: float = 0.0):
    """The tiny model (fp32) with LoRA on the MLP projections, the given checkpointing mode (offload
    installed as the knob does) and the MLP tiled at 16 positions."""
    model = _model(f"checkpointing={ckpt}", f"adapter.dropout={dropout}")
    if ckpt == "offload":
        enable_offload(model, torch.device("cpu"))
    assert tile_mlps(model, 16) == 4
    return model


def _record_mlp_inputs(model):
    """Forward pre-hooks on every decoder MLP's projections: the sequence length of each call."""
    seen: list[int] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-2]))
        for n, m in model.named_modules()
        if n.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    ]
    return seen, handles


@pytest.mark.parametrize("ckpt", ["off", "on", "offload"])
def test_mlp_tiles_in_forward_recompute_and_eval(ckpt):
    """Every pass over the MLP sees tiles of <= 16 positions: the training forward (with grad, or the
    grad-free forward of offloaded checkpointing), the recompute in backward, and evaluation under no_grad
    (measure.eval.evaluate, as the trial's initial/periodic/final evaluation runs it)."""
    from vramsweep.longctx.loss import causal_lm_of
    from vramsweep.measure.eval import evaluate

    model = _tiny_longctx(ckpt)
    ids, labels = _batch(seq=64, b=1)
    seen, handles = _record_mlp_inputs(model)
    loss = model(input_ids=ids, labels=labels).loss
    n_forward = len(seen)
    loss.backward()
    n_train = len(seen)
    evaluate(
        model,
        [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "fact_spans": [[]]}],
        torch.device("cpu"),
        causal_lm=causal_lm_of,
    )
    for h in handles:
        h.remove()
    assert n_forward == 4 * 3 * 4  # 4 layers x 3 projections x 4 tiles of 16
    assert n_train > n_forward  # the backward recomputed (tiled, never a whole sequence)
    assert len(seen) > n_train  # evaluation ran through the hooks
    assert set(seen) == {16}, sorted(set(seen))


class _Replay(torch.nn.Module):
    """Dropout replaced by fixed masks (one per call in order), to rebuild the loss a model computed."""

    def __init__(self, masks):
        super().__init__()
        self.masks = list(masks)

    def forward(self, x):
        return x * self.masks.pop(0)


@pytest.mark.parametrize("ckpt", ["off", "on", "offload"])
def test_tiled_gradients_with_dropout_are_those_of_the_computed_loss(ckpt):
    """With LoRA dropout 0.1 and a tiled MLP, the masks the forward drew are the masks the recompute uses:
    an untiled, uncheckpointed model that replays the forward's masks (concatenated over the tiles) gives
    the same loss and gradients. Before the fix, offload's grad-free forward ran the MLP untiled and drew
    other masks than its tiled recompute (gradients up to ~8 % apart)."""
    model = _tiny_longctx(ckpt, dropout=0.1)
    with torch.no_grad():  # non-zero LoRA B: the masks then shape the loss, not only B's gradient
        g = torch.Generator().manual_seed(7)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids, labels = _batch(seq=64, b=1)
    drops = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0}
    assert any(".mlp." in n for n in drops)
    recording = {"on": True}
    masks: dict[str, list[torch.Tensor]] = {n: [] for n in drops}

    def hook(name):
        def fn(_m, args, out):
            if recording["on"]:
                masks[name].append((out != 0).to(out.dtype) / 0.9)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in drops.items()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = model(input_ids=ids, labels=labels).loss
    recording["on"] = False  # only the forward's masks (the recompute's must equal them)
    loss.backward()
    got = loss.detach(), _grads(model)
    for h in handles:
        h.remove()

    ref_model = _model("checkpointing=off", "adapter.dropout=0.1")
    ref_model.load_state_dict(model.state_dict())
    for name in drops:
        parent, _, leaf = name.rpartition(".")
        full = torch.cat(masks[name], dim=-2)  # tiles in order -> the whole sequence
        ref_model.get_submodule(parent)._modules[leaf] = _Replay([full])
    ref = _run(ref_model, lambda: ref_model(input_ids=ids, labels=labels).loss)
    _same(ref, got, rtol=1e-4, atol=1e-6)


# --- host memory of checkpointing=offload (exact-size pool, host_oom status)


def test_offload_host_pool_is_exact_size_and_reused():
    """The layer inputs of a pass live in one pool of exactly layers x tokens x hidden x dtype bytes (no
    power-of-two rounding per layer); it grows for a longer pass, is reused by a shorter one, and a pass
    whose backward never ran does not leak into the next."""
    model = _model("checkpointing=on", "adapter.dropout=0.0")
    enable_offload(model, torch.device("cpu"))
    mgr = model._vramsweep_offload
    hidden = model.get_base_model().config.hidden_size
    for seq, expect_seq in ((48, 48), (80, 80), (32, 80)):
        ids, labels = _batch(seq=seq, b=2)
        _run(model, lambda ids=ids, labels=labels: model(input_ids=ids, labels=labels).loss)
        assert mgr.pool_bytes == 4 * 2 * expect_seq * hidden * 4  # 4 layers x b x s x h x fp32
        assert mgr.peak_host_bytes <= mgr.pool_bytes and not mgr.slots
    ids, labels = _batch(seq=80, b=2)
    _ = model(input_ids=ids, labels=labels).loss  # forward only: its copies are never consumed
    ref = _run(model, lambda: model(input_ids=ids, labels=labels).loss)
    assert mgr.pool_bytes == 4 * 2 * 80 * hidden * 4 and not mgr.slots
    plain = _model("checkpointing=on", "adapter.dropout=0.0")
    plain.load_state_dict(model.state_dict())
    _same(_run(plain, lambda: plain(input_ids=ids, labels=labels).loss), ref)
    with torch.no_grad():  # no backward will come: nothing is offloaded
        model(input_ids=ids, labels=labels)
    assert not mgr.slots


def test_pinned_allocation_failure_is_a_host_oom(tmp_path, monkeypatch):
    """A pool that cannot be allocated/page-locked ends the trial with status host_oom and a reason naming
    the bytes, not oom (device memory) and not error."""
    from conftest import FAST
    from vramsweep.config import compose
    from vramsweep.longctx import offload
    from vramsweep.trial import run_trial

    def fail(self, nbytes):
        raise offload.HostMemoryError(
            f"host memory for checkpointing=offload: {nbytes / 2**30:.2f} GiB of pinned memory could not be "
            "page-locked (simulated)"
        )

    monkeypatch.setattr(offload.HostPool, "reserve", fail)
    ov = [*FAST, "checkpointing=offload", f"results_dir={tmp_path}"]
    res = run_trial(compose(ov), overrides=ov, result_path=tmp_path / "r.json")
    assert res["status"] == "host_oom", res["reason"]
    assert "pinned memory" in res["reason"] and "GiB" in res["reason"]
    assert "traceback" not in res["meta"]


def test_trial_records_the_host_pool(tmp_path):
    from conftest import FAST
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    ov = [*FAST, "checkpointing=offload", "context.max_tokens=128", f"results_dir={tmp_path}"]
    res = run_trial(compose(ov), overrides=ov)
    assert res["status"] == "ok", res["reason"]
    host = res["meta"]["host_memory"]
    assert host["pinned"] is False and host["pool_bytes"] >= host["peak_offloaded_bytes"] > 0


def test_pool_pins_exactly_with_cuda_host_register(monkeypatch):
    """On CUDA the pool is page-locked in place with cudaHostRegister for its exact size (the caching host
    allocator would round each block up to a power of two); a failed registration is a HostMemoryError."""
    from vramsweep.longctx import offload

    calls = []

    class FakeCudart:
        def __init__(self, code):
            self.code = code

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(size)
            return self.code

        def cudaHostUnregister(self, ptr):
            calls.append(-1)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(0))
    pool = offload.HostPool(pin=True)
    pool.reserve(3 * 681_000_000 // 1000)
    assert calls == [3 * 681_000] and pool.nbytes == 3 * 681_000
    pool.release()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(2))  # cudaErrorMemoryAllocation
    with pytest.raises(offload.HostMemoryError, match="could not be page-locked"):
        offload.HostPool(pin=True).reserve(1000)


@pytest.mark.parametrize("tiling", ["loss", "on"])
def test_liger_fused_loss_with_tiled_loss_refused(tiling):
    """One owner of the loss: kernels=liger (fused linear cross-entropy) with a chunked-loss tiling is
    refused naming the alternatives; tiling=mlp, or Liger without its fused loss, are accepted."""
    from vramsweep.config import ConfigError, compose

    with pytest.raises(ConfigError) as err:
        compose(["kernels=liger", f"tiling={tiling}"], rules="config")
    assert err.value.key == "tiling" and "kernels=liger tiling=mlp" in str(err.value)
    compose(["kernels=liger", "tiling=mlp"], rules="config")
    compose(
        ["kernels=liger", "kernels.liger_fused_linear_cross_entropy=false", f"tiling={tiling}"],
        rules="config",
    )
