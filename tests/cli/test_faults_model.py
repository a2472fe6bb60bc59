"""Broken local model folders refused by the pre-flight: exit 2 in seconds with one line naming the file
and the problem, nothing written, before any model is built - among them the folders a trial would otherwise
finish ``status: ok`` on with random tokens or random layers (no tokenizer files; a config with more layers
than its weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _bad_inputs import FAKE, check_bad_input
from vramsweep.config.errors import ConfigError
from vramsweep.config.model_folder import check_model_folder, safetensors_header

WEIGHTS = "model.safetensors"
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def _folder(src: Path, dst: Path, *, files=(WEIGHTS, *TOKENIZER), **config) -> Path:
    """A copy of the embedded model's folder with ``files`` and ``config`` changed in its config.json."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in files:
        shutil.copy(src / f, dst / f)
    return dst


def _broken(src: Path, root: Path) -> None:
    """Every broken folder of the cases below, under ``root`` (written before the harness's snapshot)."""
    _folder(src, root / "notok", files=(WEIGHTS,))
    _folder(src, root / "layers", num_hidden_layers=6, layer_types=["full_attention"] * 6)
    _folder(src, root / "noweights", files=TOKENIZER)
    (_folder(src, root / "gguf", files=TOKENIZER) / "model-q4.gguf").write_bytes(b"GGUF" + bytes(64))
    _folder(src, root / "dtype", dtype="float77")
    _folder(src, root / "hidden", hidden_size=512)
    _folder(src, root / "vocab", vocab_size=4096)
    _folder(src, root / "unknown", model_type="frobnicator", architectures=["FrobForCausalLM"])
    _folder(src, root / "encoder", model_type="bert", architectures=["BertModel"])
    data = (src / WEIGHTS).read_bytes()
    (_folder(src, root / "truncated", files=TOKENIZER) / WEIGHTS).write_bytes(data[: len(data) // 2])
    (_folder(src, root / "garbage", files=TOKENIZER) / WEIGHTS).write_bytes(b"\x07" * 5000)
    sharded = _folder(src, root / "shard", files=TOKENIZER)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))


M = "model.path={root}/models/"
CASES = [
    ("no-tokenizer", [M + "notok"], "notok has no tokenizer (no tokenizer.json or tokenizer_config.json)"),
    (
        "more-layers",
        [M + "layers"],
        "num_hidden_layers=6 but the weights hold 4 decoder layers (layers 4, 5 missing",
    ),
    ("no-weights", [M + "noweights"], "noweights has no weights (no model.safetensors"),
    ("gguf-only", [M + "gguf"], "holds GGUF weights only (model-q4.gguf)"),
    ("bogus-dtype", [M + "dtype"], "dtype/config.json: dtype='float77' is no floating dtype"),
    (
        "hidden-mismatch",
        [M + "hidden"],
        "model.embed_tokens.weight is 3072 x 256 but config.json has vocab_size=3072, hidden_size=512",
    ),
    ("vocab-mismatch", [M + "vocab"], "is 3072 x 256 but config.json has vocab_size=4096"),
    ("unknown-type", [M + "unknown"], "model_type='frobnicator' is not a model type transformers knows"),
    ("encoder-only", [M + "encoder"], "model_type='bert' (architectures=['BertModel']) is no decoder"),
    ("truncated", [M + "truncated"], "truncated/model.safetensors: truncated or padded"),
    ("garbage", [M + "garbage"], "garbage/model.safetensors: not a safetensors file"),
    ("missing-shard", [M + "shard"], "names the shard model-00001-of-00002.safetensors, which is not in"),
    ("sweep-no-tokenizer", ["-m", M + "notok", "adapter.r=8,16", *FAKE], "notok has no tokenizer"),
]


@pytest.mark.parametrize(("case_id", "argv", "needle"), CASES, ids=[c[0] for c in CASES])
def test_broken_model_folder_is_refused_before_the_trial(
    tmp_path, capsys, monkeypatch, embedded_model_dir, case_id, argv, needle
):
    _broken(embedded_model_dir, tmp_path / "models")
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, "train", ["model=local", *argv], {}, needle)


def test_a_named_architecture_with_a_weights_folder_is_checked_too(
    tmp_path, capsys, monkeypatch, embedded_model_dir
):
    """``model=<architecture> model.path=<folder>`` loads the folder as well: the same checks apply."""
    _folder(embedded_model_dir, tmp_path / "models" / "notok", files=(WEIGHTS,))
    argv = ["model.source=arch", M + "notok"]
    check_bad_input(tmp_path, capsys, monkeypatch, "arch-notok", "train", argv, {}, "has no tokenizer")


def test_data_random_is_the_opt_in_for_a_folder_without_tokenizer(tmp_path, embedded_model_dir):
    """Random token ids are asked for by name (``data=random``: memory and speed at an exact length)."""
    folder = _folder(embedded_model_dir, tmp_path / "notok", files=(WEIGHTS,))
    check_model_folder(folder, data_source="random")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_model_folder(folder, data_source="embedded")


def test_the_trial_refuses_a_folder_without_tokenizer_too(tmp_path, embedded_model_dir):
    """A trial started without the CLI's pre-flight (a worker, the API) does not fall back to random tokens."""
    from vramsweep.config import compose
    from vramsweep.knobs.build import model_source

    folder = _folder(embedded_model_dir, tmp_path / "notok", files=(WEIGHTS,))
    cfg = compose(["model=local", f"model.path={folder}"], rules="config")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        model_source(cfg)
    cfg = compose(["model=local", f"model.path={folder}", "data=random"], rules="config")
    assert model_source(cfg) == (folder, None)


def test_a_good_folder_passes_and_its_header_is_read_without_loading(embedded_model_dir):
    check_model_folder(embedded_model_dir)
    shapes = safetensors_header(embedded_model_dir / WEIGHTS)
    assert shapes["model.embed_tokens.weight"] == [3072, 256]
    assert sum(n.startswith("model.layers.") and n.endswith(".self_attn.q_proj.weight") for n in shapes) == 4


def test_a_layer_without_one_of_its_tensors_is_named(tmp_path, embedded_model_dir):
    """A checkpoint whose layer 2 lacks ``mlp.down_proj.weight`` would load it at random."""
    from safetensors.torch import load_file, save_file

    folder = _folder(embedded_model_dir, tmp_path / "m", files=TOKENIZER)
    tensors = load_file(str(embedded_model_dir / WEIGHTS))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(folder / WEIGHTS))
    with pytest.raises(ConfigError, match=r"decoder layer 2 has no mlp\.down_proj\.weight"):
        check_model_folder(folder)


# --- the rest of what was caught only inside the trial (exit 1 and a result.json)
SUR = "{root}/models/sur.jsonl"
OTHER = [
    (
        "optimizer-unknown-kwarg",
        ["+optimizer.kwargs.foo=1"],
        "AdamW takes no keyword 'foo' (optimizer.kwargs.foo)",
    ),
    (
        "optimizer-missing-class",
        ["optimizer._target_=torch.optim.NoSuch"],
        "'torch.optim.NoSuch' is not an importable",
    ),
    ("optimizer-lr-twice", ["+optimizer.kwargs.lr=0.1"], "optimizer.kwargs.lr duplicates train.lr"),
    (
        "optimizer-function",
        ["optimizer._target_=os.path.join"],
        "'os.path.join' names a function, not an optimizer",
    ),
    (
        "dora-int8",
        ["adapter=dora", "quant=int8"],
        "adapter=dora (DoRA) with quant=int8 (8-bit) does not run on",
    ),
    (
        "skip-modules-empty",
        ["quant=int8", "quant.skip_modules=[]"],
        "quant.skip_modules=[] quantises lm_head",
    ),
    ("seed-huge", ["train.seed=99999999999999999999"], "train.seed=99999999999999999999 is out of range"),
    ("data-seed-negative", ["data.seed=-1"], "data.seed=-1 is out of range"),
    ("lone-surrogate", ["data=jsonl", f"data.path={SUR}"], "sur.jsonl:2: a lone surrogate \\ud800"),
    (
        "lone-surrogate-documents",
        ["data=jsonl", "data.path={root}/models/surdoc.jsonl"],
        "surdoc.jsonl:2: a lone",
    ),
    (
        "trial-fn-no-module",
        ["-m", "adapter.r=8,16", "hydra.sweeper.trial_fn=nosuch_mod_xyz:fn", *FAKE[1:]],
        "hydra.sweeper.trial_fn='nosuch_mod_xyz:fn': no module 'nosuch_mod_xyz' can be imported",
    ),
    (
        "trial-fn-no-function",
        ["-m", "adapter.r=8,16", "hydra.sweeper.trial_fn=fakes:no_such_fn", *FAKE[1:]],
        "fakes.py defines no 'no_such_fn'",
    ),
]


def _surrogates(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sur.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')
    doc = {
        "id": "d0",
        "title": "t",
        "sections": [{"heading": "h", "text": "a"}, {"heading": "b", "text": "c"}],
    }
    bad = {**doc, "id": "d1", "sections": [*doc["sections"], {"heading": "x", "text": "y \ud800"}]}
    (root / "surdoc.jsonl").write_text(json.dumps(doc) + "\n" + json.dumps(bad) + "\n")


@pytest.mark.parametrize(("case_id", "argv", "needle"), OTHER, ids=[c[0] for c in OTHER])
def test_refused_before_the_trial_naming_the_key(tmp_path, capsys, monkeypatch, case_id, argv, needle):
    _surrogates(tmp_path / "models")
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, "train", argv, {}, needle)


def test_the_default_skip_list_and_a_valid_trial_fn_still_pass():
    from vramsweep.config import compose
    from vramsweep.sweeper.settings import check_conf

    compose(["quant=int8"], rules="config")
    compose(["quant=int8", "quant.skip_modules=[lm_head,model.layers.0.mlp.down_proj]"], rules="config")
    compose(["adapter=dora", "quant=nf4", "train.seed=4294967295"], rules="config")
    check_conf({"trial_fn": "fakes:fake_trial"})
    check_conf({"trial_fn": "vramsweep.trial:run_trial_overrides"})
