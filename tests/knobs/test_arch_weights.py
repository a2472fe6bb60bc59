"""Random weights for architecture-only models written once to a cached HF folder:
created once and reused, deterministic, never used half-written, loadable by transformers, and what
``kernels=unsloth`` on ``model=qwen3_8b`` loads (fake ``unsloth`` module: the real one is optional)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import threading
import time

import pytest
import torch

from vramsweep.config import compose
from vramsweep.config.rules import UnsupportedError
from vramsweep.knobs import arch_weights as aw
from vramsweep.knobs import kernels

#: A small Qwen3 architecture (``source=arch``): 4 shards (embedding, 2 layers, norm + lm_head), ~1.2 MB.
SMALL = ["model=qwen3_tiny_arch", "train.dtype=bf16"]


def _cfg(*extra: str):
    return compose(SMALL + list(extra), rules="none")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_written_once_reused_and_loadable(cache, capsys):
    cfg = _cfg()
    path, notes = aw.ensure_arch_weights(cfg)
    assert path.parent == cache / "arch_weights" and path.name.startswith("qwen3_tiny_arch-")
    assert notes["written_now"] is True and (path / aw.MARKER).exists()
    shards = sorted(path.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert notes["shards"] == 4 and notes["weight_bytes"] == aw.plan_bytes(cfg)["bytes"]
    assert notes["disk_bytes"] > notes["weight_bytes"] and notes["write_s"] >= 0
    assert "writing random qwen3_tiny_arch weights once" in capsys.readouterr().err  # the progress line
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    path2, notes2 = aw.ensure_arch_weights(cfg)
    assert path2 == path and notes2["written_now"] is False
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps  # nothing rewritten
    assert notes2["write_s"] == notes["write_s"]  # the recorded cost of the one write

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 512
    assert torch.equal(model.model.norm.weight, torch.ones(128, dtype=torch.bfloat16))
    w = model.model.layers[1].mlp.down_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())  # untied: lm_head stored too
    tok = AutoTokenizer.from_pretrained(str(path))
    assert 261 <= len(tok) <= 512 and tok.pad_token_id is not None
    assert model.config.eos_token_id == tok.eos_token_id


def test_deterministic_and_keyed(tmp_path, monkeypatch):
    digests, shard_sha = [], []
    for run, workers in (("a", 1), ("b", 3)):  # threads write shards out of order: same bytes
        monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / run))
        path, _ = aw.ensure_arch_weights(_cfg(), progress=False, workers=workers)
        digests.append(aw.folder_digest(path))
        shard_sha.append([_sha(p) for p in sorted(path.glob("*.safetensors"))])
    assert digests[0] == digests[1] and shard_sha[0] == shard_sha[1]
    # seed, dtype and architecture are in the key; the config name is not
    base = aw.arch_key(_cfg())
    assert aw.arch_key(_cfg("train.seed=1")) != base
    assert aw.arch_key(_cfg("train.dtype=fp32")) != base
    assert aw.arch_key(_cfg("model.num_layers=3")) != base
    path_seed1, _ = aw.ensure_arch_weights(_cfg("train.seed=1"), progress=False)
    assert aw.folder_digest(path_seed1) != digests[0]


def test_half_written_folder_is_never_used(cache, monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def dying(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk went away")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", dying)
    cfg = _cfg()
    with pytest.raises(OSError, match="disk went away"):
        aw.ensure_arch_weights(cfg, progress=False)
    out = aw.arch_weights_dir(cfg)
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real)

    # a writer killed after the rename but before the marker: the folder is rewritten, not used
    path, _ = aw.ensure_arch_weights(cfg, progress=False)
    (path / aw.MARKER).unlink()
    (path / "model-00003-of-00004.safetensors").write_bytes(b"truncated")
    path, notes = aw.ensure_arch_weights(cfg, progress=False)
    assert notes["written_now"] is True and (path / aw.MARKER).exists()
    from safetensors import safe_open

    with safe_open(str(path / "model-00003-of-00004.safetensors"), "pt") as fh:
        assert len(list(fh.keys())) > 0


def test_waits_for_the_lock_holder(cache):
    cfg = _cfg()
    out = aw.arch_weights_dir(cfg)
    out.parent.mkdir(parents=True)
    result = {}
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: result.update(r=aw.ensure_arch_weights(cfg, progress=False)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and not out.exists()  # blocked on the writer's lock
        fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(60)
    assert result["r"][1]["written_now"] is True


def test_not_enough_disk_is_unsupported_and_writes_nothing(cache, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(aw.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    cfg = _cfg()
    with pytest.raises(UnsupportedError, match="writes .* GB of random weights") as exc:
        aw.ensure_arch_weights(cfg, progress=False)
    assert exc.value.key == "kernels"
    assert not list((cache / "arch_weights").glob("qwen3_tiny_arch-*"))


def test_qwen3_8b_cost_is_16_4_gb_in_38_shards():
    plan = aw.plan_bytes(compose(["model=qwen3_8b", "train.dtype=bf16"], rules="none"))
    assert plan == {
        "params": 8_190_735_360,
        "bytes": 16_381_470_720,
        "shards": 38,
        "largest_shard_bytes": (151_936 + 1) * 4096 * 2,  # lm_head + final norm: host RAM peak
    }


def test_unsloth_on_an_arch_model_loads_the_materialised_folder(cache, fake_unsloth):
    from vramsweep.knobs.build import build_model

    cfg = _cfg("kernels=unsloth", "quant=nf4_dq", "hardware=cpu")
    kernels.check_unsloth(cfg)  # source=arch is no longer refused (rules.py calls this)
    built = build_model(cfg)
    path = aw.arch_weights_dir(cfg)
    assert fake_unsloth["from_pretrained"]["model_name"] == str(path)
    assert fake_unsloth["from_pretrained"]["load_in_4bit"] is True
    assert (path / aw.MARKER).exists() and (path / "config.json").exists()
    notes = built.notes["arch_weights"]
    assert notes["path"] == str(path) and notes["written_now"] is True and notes["shards"] == 4
    assert built.notes["kernels"] == "unsloth.FastLanguageModel" and built.tokenizer == "tokenizer"
    build_model(cfg)  # the second trial reuses the folder
    assert fake_unsloth["from_pretrained"]["model_name"] == str(path)


def test_tiny_vocab_is_a_clear_error(cache):
    with pytest.raises(UnsupportedError, match="model.vocab_size=256") as exc:
        aw.ensure_arch_weights(_cfg("model.vocab_size=256"), progress=False)
    assert exc.value.key == "model.vocab_size"
