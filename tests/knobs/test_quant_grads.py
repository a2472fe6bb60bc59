"""Gradients through frozen 4-bit weights do not depend on whether an eval ran before (issue 49, item 1).

bitsandbytes 0.50 repacks a ``Linear4bit`` weight for CPU inference on its first eval-mode forward whose
input needs no gradient, on CPUs with AVX512-BF16; afterwards ``matmul_4bit`` bypasses its autograd
Function and no input gradient flows through the base weight (``vramsweep.knobs.quant
.keep_trainable_4bit_layout`` has the mechanism). The tests force the CPU capability flag so they exercise
that path on any CPU (on one without AVX512-BF16 bitsandbytes' fallback kernel runs the packed layout, and
the missing gradient shows all the same).
"""

from __future__ import annotations

import pytest
import torch

from vramsweep.config import compose
from vramsweep.data.prep import collate_batch
from vramsweep.knobs import build_model
from vramsweep.measure.eval import evaluate

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


@pytest.fixture
def avx512bf16_cpu(monkeypatch):
    """``Linear4bit`` built as on a CPU with AVX512-BF16 (this machine may or may not have it)."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)


def _batch():
    from _grads import _examples

    return collate_batch(_examples([(40, 20), (30, 10)]), 0)


def _lora_grads(quant: str, prior_eval: bool) -> dict[str, torch.Tensor]:
    cfg = compose(["train.dtype=fp32", f"quant={quant}", "adapter.dropout=0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).model
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # lora_B starts at 0: give every LoRA factor a gradient
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    batch = _batch()
    if prior_eval:
        evaluate(model, [batch], torch.device("cpu"))  # what every trial does before step 0
    model.train()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quant", ["nf4", "nf4_dq", "fp4"])
def test_lora_gradients_through_4bit_weights_are_the_same_after_an_eval(avx512bf16_cpu, quant):
    """Before the fix (bitsandbytes' CPU repacking left on): relative difference 0.97 over all LoRA grads,
    layer-0 grads several times smaller; now bitwise equal."""
    fresh, after_eval = _lora_grads(quant, False), _lora_grads(quant, True)
    assert fresh.keys() == after_eval.keys() and len(fresh) > 0
    layer0 = [n for n in fresh if ".layers.0." in n]
    assert layer0 and all(float(fresh[n].abs().sum()) > 0 for n in layer0)
    diff = {n: float((after_eval[n] - fresh[n]).norm() / fresh[n].norm()) for n in fresh}
    assert all(torch.equal(fresh[n], after_eval[n]) for n in fresh), {n: d for n, d in diff.items() if d}


def test_built_4bit_layers_never_repack_for_cpu_inference(avx512bf16_cpu):
    """An eval forward leaves every 4-bit weight in the layout ``MatMul4Bit`` differentiates through."""
    cfg = compose(["quant=nf4_dq"])
    model = build_model(cfg).model
    evaluate(model, [_batch()], torch.device("cpu"))
    states = [m.weight.quant_state for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert states and not any(getattr(s, "packing_format_for_cpu", False) for s in states)
    assert all(s.nested for s in states)  # the repacking would also have undone double quantisation


@pytest.mark.parametrize(
    "overrides",
    [
        ["quant=nf4"],
        ["quant=nf4_dq", "adapter=dora"],
        ["quant=fp4", "checkpointing=on"],
        ["quant=int8"],
        ["quant=nf4", "train.dtype=bf16"],
    ],
    ids=["nf4", "nf4_dq-dora", "fp4-checkpointing", "int8", "nf4-bf16"],
)
def test_torch_never_warns_of_a_missing_autograd_kernel_in_eval_train_eval(avx512bf16_cpu, overrides):
    """torch's "an autograd kernel was not registered ... silently incorrect behavior" fired after an eval
    (the packed path above) and vramsweep.noise once filed it as harmless; it no longer fires in an
    eval, a training step and an eval, so vramsweep.noise shows it in full if it ever does."""
    import warnings

    model = build_model(compose(overrides)).model
    batch = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate(model, [batch], torch.device("cpu"))
        model.train()
        model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss.backward()
        evaluate(model, [batch], torch.device("cpu"))
    assert not [str(w.message) for w in caught if "autograd kernel was not registered" in str(w.message)]
