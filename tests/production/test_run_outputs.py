"""A ``train`` run's folder: adapter (PEFT), tokenizer, pinned config, loss log; the adapter loaded with plain
transformers + peft gives the logits the run ended with (docs/RUNS.md)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAST
from vramsweep.config import compose
from vramsweep.production import outputs
from vramsweep.trial import run_trial

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

PROBE = "The grant report of the committee"


def _probe_ids(tok) -> torch.Tensor:
    return torch.tensor([tok(PROBE)["input_ids"]])


def _run(tmp_path, monkeypatch, *overrides, sweep=None, trial=None):
    """A run whose end-of-training logits on PROBE are captured when its outputs are saved."""
    seen: dict = {}
    real = outputs.save_outputs

    def capture(run, cfg, model, tokenizer, id_map, base_path):
        ids = _probe_ids(tokenizer)
        if id_map is not None:
            seen["kept"] = id_map.new_to_old.clone()
            ids = torch.as_tensor(id_map.encode(ids[0].tolist())).view(1, -1)
        model.eval()
        with torch.no_grad():
            seen["logits"] = model(input_ids=ids).logits.float()
        model.train()
        return real(run, cfg, model, tokenizer, id_map, base_path)

    monkeypatch.setattr("vramsweep.trial.save_outputs", capture)
    over = [*FAST, f"results_dir={tmp_path}", *overrides]
    res = run_trial(
        compose(over), result_path=tmp_path / "run" / "result.json", overrides=over, sweep=sweep, trial=trial
    )
    assert res["status"] == "ok", res["reason"]
    return tmp_path / "run", seen


def _plain_logits(run_dir, *, nf4: bool = False) -> torch.Tensor:
    """Base + adapter the way a user without vramsweep loads them: transformers + peft only."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    manifest = json.loads((run_dir / "run.json").read_text())
    kw = {"dtype": torch.bfloat16}
    if nf4:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    base = AutoModelForCausalLM.from_pretrained(manifest["base"]["path"], **kw)
    if nf4:  # the kernels training used: on an AVX512-BF16 CPU bitsandbytes would otherwise repack the 4-bit
        # weights for inference (bf16 absmax), which changes the logits (docs/RUNS.md, "Use the model"); on
        # CUDA the attribute is never read
        for mod in base.modules():
            if hasattr(mod, "support_avx512bf16_for_cpu"):
                mod.support_avx512bf16_for_cpu = False
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    tok = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    with torch.no_grad():
        return model(input_ids=_probe_ids(tok)).logits.float()


@pytest.mark.parametrize(
    "adapter,quant",
    [("lora", "none"), ("rslora", "none"), ("dora", "none"), ("lora", "nf4"), ("dora", "nf4")],
)
def test_saved_adapter_reloads_to_the_end_of_training_logits(tmp_path, monkeypatch, adapter, quant):
    run, seen = _run(tmp_path, monkeypatch, f"adapter={adapter}", f"quant={quant}")
    for name in (
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "config.yaml",
        "result.json",
        "losses.jsonl",
        "run.json",
        "tokenizer/tokenizer_config.json",
    ):
        assert (run / name).is_file(), name
    rows = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is (adapter == "rslora") and cfg["use_dora"] is (adapter == "dora")
    got = _plain_logits(run, nf4=quant == "nf4")
    # same weights, same kernels: equal to within bf16 rounding of the last matmul (stated tolerance)
    torch.testing.assert_close(got, seen["logits"], atol=1e-2, rtol=0)
    assert (got - seen["logits"]).abs().max().item() <= 1e-2


def test_a_trained_adapter_differs_from_the_base(tmp_path, monkeypatch):
    """The saved adapter is the trained one: the base alone gives other logits."""
    from transformers import AutoModelForCausalLM

    run, seen = _run(tmp_path, monkeypatch)
    manifest = json.loads((run / "run.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(manifest["base"]["path"], dtype=torch.bfloat16).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    with torch.no_grad():
        plain = base(input_ids=_probe_ids(tok)).logits.float()
    assert (plain - seen["logits"]).abs().max().item() > 0.05


def test_sliced_vocab_adapter_works_on_the_full_base_and_tokenizer(tmp_path, monkeypatch):
    """vocab=sliced trains no embedding rows: the adapter goes on the *full* base with the full tokenizer, and
    the logits at the kept ids (id_map.json) are the sliced model's."""
    run, seen = _run(tmp_path, monkeypatch, "vocab=sliced")
    assert (run / "id_map.json").is_file()
    from vramsweep.knobs.vocab_slice import IdMap

    kept = IdMap.load(run).new_to_old
    assert torch.equal(kept, seen["kept"]) and len(kept) < 3072
    full = _plain_logits(run)  # full tokenizer, full vocabulary
    assert full.shape[-1] == 3072 and seen["logits"].shape[-1] == len(kept)
    torch.testing.assert_close(full[..., kept], seen["logits"], atol=1e-2, rtol=0)


def test_full_finetune_saves_the_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, seen = _run(tmp_path, monkeypatch, "adapter=full", "train.lr=1e-4")
    assert not (run / "adapter").exists()
    model = AutoModelForCausalLM.from_pretrained(str(run / "model"), dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    with torch.no_grad():
        got = model(input_ids=_probe_ids(tok)).logits.float()
    torch.testing.assert_close(got, seen["logits"], atol=1e-2, rtol=0)


def test_sweep_trials_save_nothing_unless_asked(tmp_path, monkeypatch):
    over = [*FAST, f"results_dir={tmp_path}"]
    res = run_trial(
        compose(over), result_path=tmp_path / "t" / "0001.json", overrides=over, sweep="s", trial=1
    )
    assert res["status"] == "ok"
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["0001.json"]
    over.append("train.save_adapter=always")
    res = run_trial(
        compose(over), result_path=tmp_path / "t" / "0002.json", overrides=over, sweep="s", trial=2
    )
    assert (tmp_path / "t" / "0002.run" / "adapter" / "adapter_model.safetensors").is_file()


def test_save_adapter_never_keeps_only_the_result_and_log(tmp_path, monkeypatch):
    over = [*FAST, f"results_dir={tmp_path}", "train.save_adapter=never"]
    res = run_trial(compose(over), result_path=tmp_path / "r" / "result.json", overrides=over)
    assert res["status"] == "ok"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "config.yaml",
        "losses.jsonl",
        "result.json",
    ]
