"""``rope``: RoPE scaling reaches the built model's rotary embedding (inv_freq, attention scaling, cos/sin at
long positions), the rules refuse a context beyond the positions without it (exit 2, naming the fix), the
estimator's max-context search reaches the scaled positions, and the build records it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from vramsweep.cli import main
from vramsweep.config import ConfigError, compose
from vramsweep.config.rules import UnsupportedError, validate

ARCH = ["model.source=arch", "train.dtype=fp32", "quant=none"]


def _rotary(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))


def _arch(over):
    from vramsweep.knobs.arch import build_arch_model

    model, _ = build_arch_model(compose([*ARCH, *over]), "cpu")
    return model


def _cos_sin(rot, position: int):
    x = torch.zeros(1, 1, 8)
    return rot(x, torch.tensor([[position]]))


def test_yarn_changes_the_rotary_frequencies_and_attention_scaling():
    base, yarn = _rotary(_arch([])), _rotary(_arch(["rope=yarn", "rope.factor=4"]))
    assert base.rope_type == "default" and base.attention_scaling == 1.0
    assert yarn.rope_type == "yarn"
    # YaRN's attention factor 0.1 ln(s) + 1 multiplies cos/sin
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    # high frequencies kept (extrapolated), low frequencies divided by the factor (interpolated)
    assert torch.allclose(yarn.inv_freq[0], base.inv_freq[0])
    assert torch.allclose(yarn.inv_freq[-1], base.inv_freq[-1] / 4)
    # what attention sees at a position beyond the native 4,096
    (c0, s0), (c1, s1) = _cos_sin(base, 6000), _cos_sin(yarn, 6000)
    assert not torch.allclose(c0, c1) and not torch.allclose(s0, s1)


def test_linear_and_dynamic_reach_the_model():
    base = _rotary(_arch([]))
    lin = _arch(["rope=linear", "rope.factor=4"])
    assert lin.config.rope_parameters["rope_type"] == "linear" and lin.config.max_position_embeddings == 16384
    assert torch.allclose(_rotary(lin).inv_freq, base.inv_freq / 4)
    dyn = _arch(["rope=dynamic", "rope.factor=2"])
    # dynamic NTK reads max_position_embeddings as the original length: it stays 4,096
    assert dyn.config.rope_parameters["rope_type"] == "dynamic" and dyn.config.max_position_embeddings == 4096
    rot = _rotary(dyn)
    assert torch.allclose(_cos_sin(rot, 100)[0], _cos_sin(base, 100)[0])  # unchanged inside the window
    c_dyn, _ = _cos_sin(rot, 7000)  # beyond it the base frequency grows
    assert not torch.allclose(c_dyn, _cos_sin(base, 7000)[0])


def test_yarn_with_the_qwen_original_length():
    """Qwen's documented recipe: factor 4 over 32,768 positions -> 131,072."""
    from vramsweep.knobs.arch import meta_skeleton

    cfg = compose(
        ["model=qwen3_8b", "rope=yarn", "rope.factor=4", "rope.original_max_position_embeddings=32768"]
    )
    config = meta_skeleton(cfg).config
    assert config.rope_parameters["original_max_position_embeddings"] == 32768
    assert config.rope_parameters["factor"] == 4.0 and config.max_position_embeddings == 131072


def test_build_model_records_rope_for_embedded_and_local_path(embedded_model_dir, tmp_path):
    from vramsweep.knobs.build import build_model

    built = build_model(compose(["rope=yarn", "rope.factor=4", "train.dtype=fp32"]))
    note = built.notes["rope"]  # -> meta.build.rope in the result JSON
    assert note["knob"] == "yarn" and note["positions"] == 16384
    assert note["rope_parameters"]["rope_type"] == "yarn" and note["rope_parameters"]["factor"] == 4.0
    assert note["attention_scaling"] == pytest.approx(0.1 * math.log(4) + 1)
    assert _rotary(built.model).attention_scaling == pytest.approx(note["attention_scaling"])

    local = ["model=local", f"model.path={embedded_model_dir}", "train.dtype=fp32"]
    plain = build_model(compose(local))
    assert plain.notes["rope"]["rope_parameters"]["rope_type"] == "default"
    lin = build_model(compose([*local, "rope=linear", "rope.factor=2"]))
    assert lin.notes["rope"]["rope_parameters"]["rope_type"] == "linear"
    assert torch.allclose(_rotary(lin.model).inv_freq, _rotary(plain.model).inv_freq / 2)


def _scaled_copy(src, dst, key):
    """A local model folder whose config.json already carries YaRN scaling (factor 2 over 4,096)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw[key] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 2.0,
        "original_max_position_embeddings": 4096,
    }
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])  # transformers 5 / 4.x spelling
def test_local_config_with_rope_scaling_is_respected_and_conflicts_refused(embedded_model_dir, tmp_path, key):
    d = _scaled_copy(embedded_model_dir, tmp_path / "scaled", key)
    # rope=none keeps the file's scaling: its 8,192 positions are allowed
    kept = compose(
        ["model=local", f"model.path={d}", "context.max_tokens=8000", "train.dtype=fp32"], rules="none"
    )
    validate(kept, machine=False)
    if key == "rope_parameters":
        from vramsweep.knobs.build import build_model

        note = build_model(kept).notes["rope"]
        assert note["knob"] == "none" and note["positions"] == 8192
        assert note["rope_parameters"]["rope_type"] == "yarn"  # the file's own scaling, as loaded
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=local", f"model.path={d}", "rope=yarn"], rules="none"), machine=False)
    assert err.value.key == "rope" and "already scales RoPE" in str(err.value) and "none" in err.value.allowed
    with pytest.raises(ConfigError) as err:  # the file's own positions are checked too
        validate(
            compose(
                ["model=local", f"model.path={embedded_model_dir}", "context.max_tokens=6000"], rules="none"
            )
        )
    assert "rope=yarn rope.factor=2" in err.value.allowed


BAD = [
    (["context.max_tokens=6000"], "context.max_tokens", "rope=yarn rope.factor=2"),
    (["context.max_tokens=100000"], "context.max_tokens", "rope=yarn rope.factor=25"),
    (["rope=yarn", "context.max_tokens=9000"], "context.max_tokens", "rope.factor=3"),
    (["rope.factor=2"], "rope", "yarn"),
    (["rope=yarn", "rope.factor=0.5"], "rope.factor", "[1.0, 1024.0]"),
    (
        ["rope=linear", "rope.original_max_position_embeddings=8192"],
        "rope.original_max_position_embeddings",
        "4096",
    ),
    (["rope=nope"], "rope", "yarn"),
]


@pytest.mark.parametrize(("overrides", "key", "hint"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_rope_exits_2_and_names_the_fix(overrides, key, hint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FORCE_NO_CUDA", "1")
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"results_dir={tmp_path / 'results'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err and hint in err, err
    assert not (tmp_path / "results").exists()


def test_estimate_preflight_qwen3_8b_beyond_its_positions(capsys):
    """The max-context sweep's model: 65,536 tokens is past Qwen3-8B's 40,960 positions without scaling."""
    over = ["model=qwen3_8b", "quant=nf4_dq", "train.micro_batch=1", "context.max_tokens=65536"]
    assert main(["estimate", *over]) == 2
    err = capsys.readouterr().err
    # Qwen3's YaRN recipe scales from 32,768 (its model card; config.json says 40,960): the smallest factor
    # over that length (before: factor 2 over 40,960 positions, a recipe Qwen does not document)
    fix = "rope=yarn rope.original_max_position_embeddings=32768 rope.factor=2"
    assert "context.max_tokens=65536" in err and fix in err, err
    assert main(["estimate", *over, *fix.split(), "--json"]) == 0  # the proposal itself passes
    assert json.loads(capsys.readouterr().out)["peak_memory_bytes"] > 0


@pytest.mark.parametrize(("tokens", "factor"), [(40961, 2), (65536, 2), (65537, 3), (131072, 4)])
def test_the_proposed_rope_is_the_smallest_factor_over_the_models_native_length(tokens, factor):
    over = ["model=qwen3_8b", "quant=nf4_dq", "train.micro_batch=1", f"context.max_tokens={tokens}"]
    with pytest.raises(ConfigError) as err:
        validate(compose(over, rules="none"), machine=False)
    fix = f"rope=yarn rope.original_max_position_embeddings=32768 rope.factor={factor}"
    assert fix in err.value.allowed, err.value.allowed
    validate(compose([*over, *fix.split()], rules="none"), machine=False)  # it reaches the tokens
    if factor > 2:  # and nothing smaller does
        smaller = fix.replace(f"rope.factor={factor}", f"rope.factor={factor - 1}")
        with pytest.raises(ConfigError):
            validate(compose([*over, *smaller.split()], rules="none"), machine=False)


def test_the_max_context_search_reaches_the_scaled_positions():
    from vramsweep.estimate import max_context

    over = ["model=qwen3_8b", "quant=nf4_dq", "train.micro_batch=1", "hardware=h200_141gb", "kernels=liger"]
    assert max_context(compose(over, rules="none"), calibration=False)["upper_bound"] == 40960
    yarn = ["rope=yarn", "rope.factor=4", "rope.original_max_position_embeddings=32768"]
    assert max_context(compose([*over, *yarn], rules="none"), calibration=False)["upper_bound"] == 131072


def test_max_context_16gb_uses_rope_not_a_positions_override():
    from vramsweep.config.paths import packaged_sweeps_dir

    text = (packaged_sweeps_dir() / "max_context_16gb.yaml").read_text()
    assert "model.max_position_embeddings" not in text and "rope=yarn" in text


def test_unsloth_with_rope_scaling_is_unsupported():
    with pytest.raises(UnsupportedError) as err:
        validate(compose(["kernels=unsloth", "rope=yarn"], rules="none"), machine=False)
    assert err.value.key == "rope"
