"""Values that name a model module (adapter.targets, quant.skip_modules) are checked against the module names
of the architecture, before anything is built (vramsweep.config.modules).

The name table is compared with ``named_modules()`` of models instantiated on the meta device (no memory,
no weights), so the table cannot drift from transformers; the matching is compared with PEFT's own
``check_target_module_exists`` and transformers' ``should_convert_module``.
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from vramsweep.config.compose import ConfigError
from vramsweep.config.modules import (
    LORA_KINDS,
    check_adapter_targets,
    check_module_names,
    check_quant_skip,
    model_modules,
    module_table,
)

CFG = {
    "model": {"source": "embedded", "family": "qwen3", "num_layers": 2, "name": "tiny", "path": None},
    "adapter": {"method": "lora", "targets": "all-linear"},
    "quant": {"bits": 16, "skip_modules": ["lm_head"]},
}


def cfg(**over):
    c = OmegaConf.create(CFG)
    for k, v in over.items():
        OmegaConf.update(c, k, v, merge=False)
    return c


def _meta_modules(model_type: str, layers: int = 2) -> dict[str, str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    return {n: type(m).__name__ for n, m in model.named_modules()}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_table_is_what_transformers_builds(family):
    real = _meta_modules(family, layers=3)
    table = module_table(family, 3)
    assert set(table.modules) == set(real)
    for name, kind in table.modules.items():
        if kind in LORA_KINDS:
            assert real[name] == kind, name
        else:
            assert real[name] not in LORA_KINDS, name


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj"],
        ["nonexistent_proj"],
        ["self_attn.q_proj"],
        ["layers.0.mlp.down_proj"],
        ["proj"],
        ["lm_head", "embed_tokens"],
        "model.layers.0.self_attn.q_proj",
        ".*q_proj",
        "q_proj",
        ".*\\.(q|v)_proj",
    ],
)
def test_target_matching_is_pefts(targets):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    table = module_table("qwen3", 2)
    lc = LoraConfig(target_modules=targets)
    peft_hits = {n for n in table.names() if n and check_target_module_exists(lc, n)}
    c = cfg(**{"adapter.targets": targets})
    try:
        check_adapter_targets(c, table)
        ok = True
    except ConfigError:
        ok = False
    lora_hits = {n for n in peft_hits if table.modules[n] in LORA_KINDS}
    # accepted exactly when PEFT would adapt something for every entry and nothing it cannot adapt
    entries = [targets] if isinstance(targets, str) else targets
    every_entry = all(
        {n for n in table.names() if n and check_target_module_exists(LoraConfig(target_modules=[e]), n)}
        if not isinstance(targets, str)
        else peft_hits
        for e in entries
    )
    assert ok == (bool(lora_hits) and lora_hits == peft_hits and every_entry)


@pytest.mark.parametrize("pattern", ["lm_head", "lm_hed", "down_proj", "model.layers.0", "mlp", "xyz"])
def test_skip_matching_is_transformers(pattern):
    from transformers.quantizers.quantizers_utils import should_convert_module

    table = module_table("llama", 2)
    hit = any(not should_convert_module(n, [pattern]) for n in table.names("Linear"))
    c = cfg(**{"quant.bits": 4, "quant.skip_modules": [pattern]})
    try:
        check_quant_skip(c, table)
        ok = True
    except ConfigError:
        ok = False
    assert ok == hit


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        (
            {"adapter.targets": ["nonexistent_proj"]},
            "'nonexistent_proj' matches no module of model=tiny (qwen3)",
        ),
        ({"adapter.targets": ["q_proj", "v_prj"]}, "'v_prj' matches no module"),
        ({"adapter.targets": ["input_layernorm"]}, "a RMSNorm module: LoRA adapts Linear and Embedding"),
        ({"adapter.targets": ["q_norm"]}, "a RMSNorm module"),
        ({"adapter.targets": ["mlp"]}, "a container of modules"),
        ({"adapter.targets": ["act_fn"]}, "a other module"),
        ({"adapter.targets": "q_proj"}, "a list matches by suffix: adapter.targets=[q_proj]"),
        ({"adapter.targets": "(q_proj"}, "not a valid regular expression"),
        ({"adapter.targets": ".*layernorm"}, "LoRA adapts Linear and Embedding"),
        (
            {"quant.bits": 4, "quant.skip_modules": ["lm_hed"]},
            "quant.skip_modules: 'lm_hed' matches no Linear",
        ),
        ({"quant.bits": 8, "quant.skip_modules": [""]}, "an empty entry matches every module"),
        ({"quant.bits": 4, "quant.skip_modules": ["(x"]}, "not a valid regular expression"),
    ],
)
@pytest.mark.torchfree
def test_bad_module_names_are_refused(over, needle):
    with pytest.raises(ConfigError) as ei:
        check_module_names(cfg(**over))
    assert needle in str(ei.value)
    assert "(allowed: " in str(ei.value)
    assert ei.value.key in ("adapter.targets", "quant.skip_modules")


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"adapter.targets": ["q_proj", "v_proj"]},
        {"adapter.targets": ["lm_head", "embed_tokens"]},
        {"adapter.targets": ".*\\.(q|v)_proj"},
        {"adapter.method": "full", "adapter.targets": ["nonexistent_proj"]},  # targets unused
        {"quant.skip_modules": ["nonexistent"]},  # quant off: unused
        {"quant.bits": 4, "quant.skip_modules": ["lm_head", "down_proj"]},
        {"model.family": "llama", "adapter.targets": ["gate_proj"]},
    ],
)
@pytest.mark.torchfree
def test_good_module_names_pass(over):
    check_module_names(cfg(**over))


@pytest.mark.torchfree
def test_model_path_reads_the_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "num_hidden_layers": 3}))
    c = cfg(**{"model.source": "path", "model.path": str(tmp_path)})
    table = model_modules(c)
    assert table is not None and table.family == "mistral" and "model.layers.2.mlp.up_proj" in table.modules
    with pytest.raises(ConfigError, match=r"model.path=.* \(mistral\)"):
        check_module_names(
            cfg(**{"model.source": "path", "model.path": str(tmp_path), "adapter.targets": ["x"]})
        )
    # an architecture outside the table is not guessed at
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert model_modules(c) is None
    check_module_names(
        cfg(**{"model.source": "path", "model.path": str(tmp_path), "adapter.targets": ["c_attn"]})
    )
