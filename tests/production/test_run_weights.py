"""``model=<named architecture> model.path=<folder>`` loads that folder (after checking its config.json);
without a path the run says once that the weights are random."""

from __future__ import annotations

import pytest
import torch

from vramsweep.cli import main
from vramsweep.config import compose, weights


def test_a_named_architecture_with_a_path_loads_its_weights(embedded_model_dir):
    """The path used to be ignored (random weights trained): the built model must be the folder's."""
    from transformers import AutoModelForCausalLM

    from vramsweep.knobs import build_model
    from vramsweep.knobs.build import model_source

    cfg = compose(["model.source=arch", f"model.path={embedded_model_dir}"])
    path, tokenizer = model_source(cfg)
    assert path == embedded_model_dir and tokenizer is not None
    built = build_model(cfg, source=(path, tokenizer))
    ref = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir), dtype=torch.bfloat16)
    got = built.model.get_base_model().model.embed_tokens.weight
    assert torch.equal(got, ref.model.embed_tokens.weight)


def test_a_path_of_another_architecture_exits_2_naming_the_keys(embedded_model_dir, tmp_path, capsys):
    code = main(["train", "model=qwen3_0_6b", f"model.path={embedded_model_dir}", f"results_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("vramsweep train: error: model.path=")
    assert "model.hidden_size=" in err[0] and "model.num_layers=" in err[0]
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_folder_without_config_json_is_refused(tmp_path):
    cfg = compose(["model=qwen3_0_6b", f"model.path={tmp_path}"])
    with pytest.raises(Exception, match="no config.json"):
        weights.arch_path(cfg.model)


def test_random_weights_are_said_once(capsys, monkeypatch):
    monkeypatch.setattr(weights, "_said_random", False)
    cfg = compose(["model=qwen3_0_6b"])
    weights.say_random_weights(cfg.model)
    weights.say_random_weights(cfg.model)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights are random" in err[0] and "model.path" in err[0]
    assert weights.random_weights({"model": {"source": "arch", "path": None}})
    assert not weights.random_weights({"model": {"source": "arch", "path": "/m"}})
