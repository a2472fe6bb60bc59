"""The embedded base model: the committed weights asset, its checks, and the recipe that rebuilds it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vramsweep import embedded as emb
from vramsweep.config import compose


def test_asset_matches_the_default_tiny_config_and_its_sha256():
    """The committed weights are the default model's: same key (dims, recipe keys, RECIPE_VERSION) and every
    file matches its recorded sha256. Fails when tiny.yaml or the recipe changes without a rebuilt asset."""
    info = emb.check_asset()
    assert info["recipe_version"] == emb.RECIPE_VERSION
    assert info["key"] == emb._key(compose([]).model)
    assert set(info["files_sha256"]) == set(emb.ASSET_FILES)
    assert info["stored_dtype"] == "float16"
    size = sum((emb.ASSET_DIR / f).stat().st_size for f in emb.ASSET_FILES)
    assert size < 9 * 2**20, size  # keep the repository small (README states the size)


def test_a_corrupted_or_missing_asset_file_is_refused_with_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "asset"
    shutil.copytree(emb.ASSET_DIR, bad)
    blob = bytearray((bad / "model.safetensors").read_bytes())
    blob[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(
        emb.EmbeddedAssetError, match=r"model.safetensors has sha256 .* expected .*--write-asset"
    ):
        emb.check_asset(bad)
    assert emb.main(["--check-asset", "--out", str(bad)]) == 1
    assert "error: embedded asset file" in capsys.readouterr().err
    shutil.copy(emb.ASSET_DIR / "model.safetensors", bad / "model.safetensors")
    assert emb.check_asset(bad)["key"]
    (bad / "tokenizer.json").unlink()
    with pytest.raises(emb.EmbeddedAssetError, match="tokenizer.json is missing"):
        emb.check_asset(bad)


def test_ensure_embedded_installs_the_committed_asset_without_building(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))

    def no_build(*a, **k):
        raise AssertionError("the default model must come from the committed asset, not a build")

    monkeypatch.setattr(emb, "build_embedded", no_build)
    out = emb.ensure_embedded(compose([]).model, progress=False)
    assert (out / "COMPLETE").exists() and out.parent == tmp_path / "cache" / "embedded"
    assert emb.check_asset(out)["key"] == emb._key(compose([]).model)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32  # stored as fp16, loaded at the config's fp32 unless asked otherwise


# small dims and a few steps of each phase: the recipe's code path, not its quality
_SMALL = [
    "model.vocab_size=600",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
    "model.pretrain_drill_steps=3",
    "model.pretrain_steps=4",
    "model.pretrain_seq_len=512",
]


@pytest.mark.slow  # three small builds, ~1 min: each generates and tokenises the 200 tokenizer documents
def test_other_dims_build_the_recipe_deterministically(tmp_path, monkeypatch):
    """A config that is not the asset's builds recipe 3 (drills, then documents/task rows); the same config
    builds the same weights bit for bit, and the drill phase is real (dropping it changes the weights)."""
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    mcfg = compose(_SMALL).model
    out = emb.ensure_embedded(mcfg, progress=False)
    info = json.loads((out / emb.INFO_FILE).read_text())
    assert info["key"] == emb._key(mcfg) != emb.asset_info()["key"]
    assert info["pretrain_drill_steps"] == 3 and info["pretrain_steps"] == 4
    assert info["pretrain_tokens"] > 4 * emb.DRILL_BATCH * 2 * emb.DRILL_SEG[0]
    again = emb.build_embedded(mcfg, tmp_path / "again", progress=False)
    assert again["weights_sha256"] == info["weights_sha256"]
    no_drills = emb.build_embedded(
        compose([*_SMALL, "model.pretrain_drill_steps=0"]).model, tmp_path / "nodrill", progress=False
    )
    assert no_drills["weights_sha256"] != info["weights_sha256"]
