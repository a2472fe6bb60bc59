"""Composition of every shipped config, and the rules: each bad input exits 2, names the override and
the allowed values, and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _bad_inputs import CONFIG_BAD
from vramsweep.cli import main
from vramsweep.config import ConfigError, compose
from vramsweep.config.compose import list_options, packaged_conf_dir
from vramsweep.config.rules import UnsupportedError
from vramsweep.config.schema import CONFIG_GROUPS, NAMED_GROUPS

GROUPS = list(CONFIG_GROUPS)


def test_defaults_compose_and_validate():
    cfg = compose([])
    assert cfg.model.source == "embedded"
    assert cfg.quant.bits == 16 and cfg.adapter.method == "lora"
    assert cfg.adapter.targets == "all-linear"


@pytest.mark.torchfree
def test_options_are_the_option_files_no_hand_list(tmp_path):
    """A group's options are its YAML files (packaged + the user's conf dir): a new file is a new option
    for compose, the value rules and the error messages, with no list to edit."""
    from vramsweep.config.rules import check_values, group_options

    assert group_options("checkpointing") == ("off", "offload", "on")
    user = tmp_path / "conf"
    (user / "checkpointing").mkdir(parents=True)
    (user / "checkpointing" / "offload_lite.yaml").write_text(
        "# test option\ndefaults: [base_checkpointing, _self_]\nname: offload_lite\nenabled: true\n"
    )
    cfg = compose(["checkpointing=offload_lite"], conf_dir=user, rules="none")
    with pytest.raises(ConfigError) as err:  # not an option without the user's conf dir
        check_values(cfg)
    assert err.value.key == "checkpointing" and "offload" in err.value.allowed
    cfg = compose(["checkpointing=offload_lite"], conf_dir=user, rules="values")
    assert cfg.checkpointing.name == "offload_lite" and cfg.checkpointing.enabled


def _all_options():
    for g in GROUPS:
        for opt in list_options(g):
            yield g, opt


@pytest.mark.parametrize(("group", "option"), list(_all_options()))
@pytest.mark.torchfree
def test_every_option_composes(group, option):
    over = [f"{group}={option}"]
    if group == "model" and option == "local":
        over.append(f"model.path={packaged_conf_dir()}")  # any folder; the rules then ask for config.json
    if group == "data" and option == "jsonl":
        over.append("data.path=/nonexistent.jsonl")
    cfg = compose(over, rules="none")
    if group in NAMED_GROUPS:
        assert cfg[group].name == option


@pytest.mark.torchfree
def test_every_yaml_knob_has_a_comment():
    for path in packaged_conf_dir().glob("*/*.yaml"):
        text = path.read_text()
        assert text.lstrip().startswith("#"), f"{path} should start with a comment on its memory/speed effect"


@pytest.mark.parametrize(
    ("overrides", "key", "allowed_hint"), CONFIG_BAD, ids=[" ".join(b[0]) for b in CONFIG_BAD]
)
@pytest.mark.torchfree
def test_bad_input_exits_2_names_key_and_allowed(overrides, key, allowed_hint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FORCE_NO_CUDA", "1")
    monkeypatch.chdir(tmp_path)
    before = set(Path(tmp_path).rglob("*"))
    code = main(["train", f"results_dir={tmp_path / 'results'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key.split(".")[0] in err
    assert allowed_hint in err, err
    assert set(Path(tmp_path).rglob("*")) == before, "a rejected config must write nothing"


@pytest.mark.torchfree
def test_bad_input_via_console_script_exits_2(tmp_path):
    exe = Path(sys.executable).with_name("vramsweep")
    env = dict(os.environ, VRAMSWEEP_FORCE_NO_CUDA="1")
    p = subprocess.run(
        [str(exe), "train", "quant=nf5"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2
    assert "quant=nf5" in p.stderr and "nf4_dq" in p.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.torchfree
def test_unsupported_is_a_config_error_subclass():
    os.environ["VRAMSWEEP_FORCE_NO_CUDA"] = "1"
    try:
        with pytest.raises(UnsupportedError):
            compose(["kernels=liger"])
        with pytest.raises(ConfigError):
            compose(["kernels=liger"])
        # machine checks can be skipped (estimates, sweep-space validation)
        cfg = compose(["kernels=liger"], rules="none")
        from vramsweep.config.rules import validate

        validate(cfg, machine=False)
    finally:
        del os.environ["VRAMSWEEP_FORCE_NO_CUDA"]


@pytest.mark.torchfree
def test_help_lists_groups(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "nf4_dq" in out and "paged_adamw_8bit" in out and "flash_attention_2" in out


@pytest.mark.torchfree
def test_unsloth_on_a_tiny_vocab_architecture_is_refused_by_the_rules():
    """A config-only rule (it was raised while writing the weights folder, after the build started)."""
    from vramsweep.config.rules import check_unsloth

    cfg = compose(["kernels=unsloth", "model=qwen3_8b", "model.vocab_size=200"], rules="none")
    with pytest.raises(UnsupportedError, match=r"model.vocab_size=200 is too small .*needs >= 261"):
        check_unsloth(cfg)
    check_unsloth(compose(["kernels=unsloth", "model=qwen3_8b", "model.vocab_size=261"], rules="none"))


@pytest.mark.torchfree
def test_4bit_blocksize_other_than_64_refused():
    """The build always makes block-64 4-bit layers (transformers passes no block size to bitsandbytes):
    a quant.blocksize that would only change the estimate is refused."""
    from vramsweep.config import ConfigError, compose

    with pytest.raises(ConfigError) as err:
        compose(["quant=nf4", "quant.blocksize=128"], rules="config")
    assert err.value.key == "quant.blocksize" and "64" in str(err.value)
    compose(["quant=nf4", "quant.blocksize=64"], rules="config")
    compose(["quant=none", "quant.blocksize=128"], rules="config")  # no 4-bit layer: nothing to refuse
