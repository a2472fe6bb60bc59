"""Bad input caught before any time is spent, every verb: exit code 2 within
seconds, one line ``vramsweep <verb>: error: ...`` naming the key and what would work, nothing written.

* module names: ``adapter.targets`` / ``quant.skip_modules`` that match no module, or a module LoRA cannot
  adapt (refused before the model is loaded);
* data: ``context.truncation=none`` with examples longer than the context, documents with a single
  section, too few documents, instructions that leave no room (refused before the data step);
* impossible models: a ``config.json`` with a zero, negative, fractional or boolean size (refused before
  the estimate);
* environment: ``VRAMSWEEP_CACHE`` a file, under a file, unwritable or on a full disk (refused before the
  trial).

Same harness as tests/_bad_inputs.py (in-process through ``vramsweep.cli.main``; sweeps with the fake
trial function), plus the time each case took before its exit 2.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from _bad_inputs import FAKE, Usage, _fill, _tree  # the fake-trial overrides, filling and tree snapshot
from vramsweep.cli import main

#: Seconds a bad input may spend before exit 2 (the issue's bound; in-process, after the first imports).
BOUND_S = 10.0
DIMS = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}


def _doc(i: int, n_sections: int, words: int = 20) -> dict:
    return {
        "id": f"d{i}",
        "title": "t",
        "sections": [{"heading": f"h{j}", "text": "some text " * words} for j in range(n_sections)],
    }


def _jsonl(docs: list[dict]) -> bytes:
    return ("\n".join(json.dumps(d) for d in docs) + "\n").encode()


def _inputs(root: Path) -> dict[str, Path]:
    d = root / "in"
    d.mkdir()
    long_doc = {
        "id": "big",
        "sections": [{"heading": "a", "text": "word " * 3000}, {"heading": "b", "text": "x"}],
    }
    files = {
        "good.jsonl": _jsonl([_doc(i, 3) for i in range(5)]),
        "single.jsonl": _jsonl([_doc(i, 1) for i in range(5)]),
        "tail1.jsonl": _jsonl([*(_doc(i, 3) for i in range(5)), _doc(9, 1)]),
        "one.jsonl": _jsonl([_doc(0, 3)]),
        "long.jsonl": _jsonl([*(_doc(i, 3) for i in range(5)), long_doc]),
        "not_a_dir": b"x",
    }
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    models = {
        "m_zero": DIMS | {"hidden_size": 0},
        "m_neg_layers": DIMS | {"num_hidden_layers": -2},
        "m_zero_heads": DIMS | {"num_attention_heads": 0},
        "m_neg_vocab": DIMS | {"vocab_size": -1},
        "m_neg_inter": DIMS | {"intermediate_size": -128},
        "m_float": DIMS | {"hidden_size": 64.5},
        "m_bool": DIMS | {"num_hidden_layers": True},
        "m_kv": DIMS | {"num_key_value_heads": 3},
        "m_neg_kv": DIMS | {"num_key_value_heads": -2},
        "m_zero_head_dim": DIMS | {"head_dim": 0},
        "m_wrapped_zero": {"model_type": "llava", "text_config": DIMS | {"hidden_size": 0}},
        "m_huge": DIMS | {"vocab_size": 10**9},
        "m_llama": DIMS,
        "m_noeos": DIMS,
    }
    for name, conf in models.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(conf))
        out[name] = d / name
    # a tokenizer without an EOS token (the data step needs one to end every target)
    from vramsweep.embedded import ASSET_DIR

    shutil.copy(ASSET_DIR / "tokenizer.json", d / "m_noeos" / "tokenizer.json")
    (d / "m_noeos" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|pad|>"})
    )
    return out


LONG_INSTRUCTIONS = "data.instructions='" + " ".join(f"word{i}" for i in range(60)) + "'"

# (id, verb, argv with {placeholders}, env, substring the one-line message must contain)
CASES: list[tuple[str, str, list[str], dict[str, str], str]] = [
    # --- 1a. values that name a model module
    (
        "targets-nonexistent",
        "train",
        ["adapter.targets=[nonexistent_proj]"],
        {},
        "'nonexistent_proj' matches no module",
    ),
    ("targets-one-typo", "train", ["adapter.targets=[q_proj,v_prj]"], {}, "'v_prj' matches no module"),
    ("targets-string", "train", ["adapter.targets=q_proj"], {}, "adapter.targets=[q_proj]"),
    ("targets-bad-regex", "train", ["adapter.targets='(q_proj'"], {}, "not a valid regular expression"),
    ("targets-norm", "train", ["adapter.targets=[input_layernorm]"], {}, "LoRA adapts Linear and Embedding"),
    ("targets-qk-norm", "train", ["adapter.targets=[q_norm]"], {}, "a RMSNorm module"),
    ("targets-container", "train", ["adapter.targets=[mlp]"], {}, "a container of modules"),
    ("targets-model", "train", ["adapter.targets=[model]"], {}, "a container of modules"),
    ("targets-act", "train", ["adapter.targets=[act_fn]"], {}, "LoRA adapts Linear and Embedding"),
    ("targets-regex-norm", "train", ["adapter.targets='.*layernorm'"], {}, "LoRA adapts Linear"),
    (
        "targets-rslora",
        "train",
        ["adapter=rslora", "adapter.targets=[qproj]"],
        {},
        "'qproj' matches no module",
    ),
    (
        "targets-dora",
        "train",
        ["adapter=dora", "adapter.targets=[lm-head]"],
        {},
        "allowed: all-linear, embed_tokens",
    ),
    (
        "targets-arch",
        "train",
        ["model=llama3_1_8b", "adapter.targets=[c_attn]"],
        {},
        "of model=llama3_1_8b (llama)",
    ),
    (
        "targets-local",
        "train",
        ["model=local", "model.path={m_llama}", "adapter.targets=[c_attn]"],
        {},
        "(llama)",
    ),
    ("skip-typo", "train", ["quant=nf4", "quant.skip_modules=[lm_hed]"], {}, "quant.skip_modules: 'lm_hed'"),
    (
        "skip-empty",
        "train",
        ["quant=int8", "quant.skip_modules=['']"],
        {},
        "an empty entry matches every module",
    ),
    (
        "skip-regex",
        "train",
        ["quant=nf4_dq", "quant.skip_modules=['(x']"],
        {},
        "not a valid regular expression",
    ),
    ("estimate-targets", "estimate", ["adapter.targets=[nonexistent_proj]"], {}, "matches no module"),
    ("estimate-targets-string", "estimate", ["adapter.targets=v_proj"], {}, "adapter.targets=[v_proj]"),
    ("estimate-skip", "estimate", ["quant=nf4", "quant.skip_modules=[lm_hed]"], {}, "'lm_hed'"),
    ("estimate-targets-arch", "estimate", ["model=qwen3_8b", "adapter.targets=[k_norm]"], {}, "RMSNorm"),
    (
        "m-targets-fixed",
        "train",
        ["-m", "adapter.targets=[nonexistent_proj]", "adapter.r=8,16", *FAKE],
        {},
        "matches no module",
    ),
    (
        "m-targets-space",
        "train",
        ["-m", "adapter.targets=[q_proj],[nonexistent_proj]", *FAKE],
        {},
        "search space: 'adapter.targets=[nonexistent_proj]'",
    ),
    (
        "m-skip-space",
        "train",
        ["-m", "quant=nf4", "quant.skip_modules=[lm_head],[lm_hed]", *FAKE],
        {},
        "'lm_hed'",
    ),
    # --- 1b. what the data step would fail on
    (
        "trunc-none-synthetic",
        "train",
        ["context.truncation=none"],
        {},
        "context.truncation=none: 567 of 623 examples",
    ),
    (
        "trunc-none-suggests",
        "train",
        ["context.truncation=none", "context.max_tokens=1024"],
        {},
        "context.max_tokens>=3533",
    ),
    (
        "trunc-none-jsonl",
        "train",
        ["data=jsonl", "data.path={long.jsonl}", "context.truncation=none"],
        {},
        "document 'big' section 1",
    ),
    (
        "jsonl-single-section",
        "train",
        ["data=jsonl", "data.path={single.jsonl}"],
        {},
        "no document has 2 or more sections",
    ),
    (
        "jsonl-eval-single",
        "train",
        ["data=jsonl", "data.path={good.jsonl}", "data.eval_path={single.jsonl}"],
        {},
        "data.eval_path=",
    ),
    (
        "jsonl-heldout-single",
        "train",
        ["data=jsonl", "data.path={tail1.jsonl}"],
        {},
        "held out for eval (data.eval_path is unset)",
    ),
    ("jsonl-one-doc", "train", ["data=jsonl", "data.path={one.jsonl}"], {}, "need at least 2 documents"),
    (
        "instructions-fill-context",
        "train",
        [LONG_INSTRUCTIONS, "context.max_tokens=32"],
        {},
        "leaves no room for a target",
    ),
    (
        "tokenizer-no-eos",
        "train",
        ["model=local", "model.path={m_noeos}", "data=jsonl", "data.path={good.jsonl}"],
        {},
        "has no eos_token",
    ),
    (
        "m-trunc-none-fixed",
        "train",
        ["-m", "context.truncation=none", "adapter.r=8,16", *FAKE],
        {},
        "context.truncation=none",
    ),
    (
        "m-trunc-none-space",
        "train",
        ["-m", "context.truncation=tail,none", *FAKE],
        {},
        "in the sweep's trials with context.truncation=none",
    ),
    (
        "m-max-tokens-space",
        "train",
        ["-m", "context.truncation=none", "context.max_tokens=256,4096", *FAKE],
        {},
        "context.max_tokens=256",
    ),
    (
        "m-jsonl-single-space",
        "train",
        ["-m", "data=jsonl", "data.path={good.jsonl},{single.jsonl}", *FAKE],
        {},
        "no document has 2 or more sections",
    ),
    # --- 5. impossible models (config.json sizes)
    (
        "model-zero-hidden",
        "train",
        ["model=local", "model.path={m_zero}"],
        {},
        "hidden_size=0 is out of range [1, 10000000]",
    ),
    (
        "model-negative-layers",
        "train",
        ["model=local", "model.path={m_neg_layers}"],
        {},
        "num_hidden_layers=-2",
    ),
    ("model-zero-heads", "train", ["model=local", "model.path={m_zero_heads}"], {}, "num_attention_heads=0"),
    ("model-negative-vocab", "train", ["model=local", "model.path={m_neg_vocab}"], {}, "vocab_size=-1"),
    (
        "model-negative-inter",
        "train",
        ["model=local", "model.path={m_neg_inter}"],
        {},
        "intermediate_size=-128",
    ),
    (
        "model-fractional",
        "train",
        ["model=local", "model.path={m_float}"],
        {},
        "hidden_size=64.5 (must be a whole number)",
    ),
    ("model-bool", "train", ["model=local", "model.path={m_bool}"], {}, "num_hidden_layers=True"),
    (
        "model-kv-divide",
        "train",
        ["model=local", "model.path={m_kv}"],
        {},
        "num_key_value_heads=3 must divide",
    ),
    ("model-negative-kv", "train", ["model=local", "model.path={m_neg_kv}"], {}, "num_key_value_heads=-2"),
    ("model-zero-head-dim", "train", ["model=local", "model.path={m_zero_head_dim}"], {}, "head_dim=0"),
    (
        "model-wrapped-zero",
        "train",
        ["model=local", "model.path={m_wrapped_zero}"],
        {},
        "text_config: hidden_size=0",
    ),
    ("model-huge-vocab", "train", ["model=local", "model.path={m_huge}"], {}, "vocab_size=1000000000"),
    ("estimate-model-zero", "estimate", ["model=local", "model.path={m_zero}"], {}, "hidden_size=0"),
    (
        "estimate-model-negative",
        "estimate",
        ["model=local", "model.path={m_neg_layers}"],
        {},
        "num_hidden_layers=-2",
    ),
    ("estimate-model-kv", "estimate", ["model=local", "model.path={m_kv}"], {}, "must divide"),
    (
        "m-model-negative",
        "train",
        ["-m", "model=local", "model.path={m_neg_vocab}", "adapter.r=8,16", *FAKE],
        {},
        "vocab_size=-1",
    ),
    (
        "m-model-zero-space",
        "train",
        ["-m", "model=local", "model.path={m_llama},{m_zero}", *FAKE],
        {},
        "hidden_size=0",
    ),
    # --- 6. the cache location
    (
        "cache-is-file",
        "train",
        [],
        {"VRAMSWEEP_CACHE": "{not_a_dir}"},
        "VRAMSWEEP_CACHE={not_a_dir}: {not_a_dir} is a file",
    ),
    ("cache-under-file", "train", [], {"VRAMSWEEP_CACHE": "{not_a_dir}/sub"}, "is a file, not a folder"),
    (
        "cache-unwritable",
        "train",
        [],
        {"VRAMSWEEP_CACHE": "/proc/vramsweep-cache"},
        "VRAMSWEEP_CACHE=/proc/vramsweep-cache is not writable",
    ),
    (
        "cache-full",
        "train",
        [],
        {"VRAMSWEEP_CACHE": "{root}/disk/cache", "_CACHE_FULL": "1"},
        "the model cache needs",
    ),
    (
        "m-cache-is-file",
        "train",
        ["-m", "adapter.r=8,16", *FAKE],
        {"VRAMSWEEP_CACHE": "{not_a_dir}"},
        "VRAMSWEEP_CACHE=",
    ),
    (
        "m-cache-full",
        "train",
        ["-m", "adapter.r=8,16", *FAKE],
        {"VRAMSWEEP_CACHE": "{root}/disk/cache", "_CACHE_FULL": "1"},
        "MiB free",
    ),
]


def test_enough_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case_id", "verb", "argv", "env", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_before_spending(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMSWEEP_FAULT", raising=False)
    monkeypatch.setenv("VRAMSWEEP_FORCE_NO_CUDA", "1")
    files = _inputs(tmp_path)
    for k, v in sorted(env.items(), key=lambda kv: kv[0] != "_CACHE_FULL"):
        if k == "_CACHE_FULL":
            disk, real = tmp_path / "disk", shutil.disk_usage  # the cache's own (full) disk
            disk.mkdir()

            def usage(p, disk=str(disk), real=real):
                return Usage(2**30, 2**30 - 2**20, 2**20) if str(p).startswith(disk) else real(p)

            monkeypatch.setattr("vramsweep.preflight.shutil.disk_usage", usage)
        else:
            monkeypatch.setenv(k, _fill(v, files, tmp_path))
    needle = _fill(needle, files, tmp_path)
    args = [_fill(a, files, tmp_path) for a in argv]
    if verb == "train" and not any(a.startswith("results_dir=") for a in args):
        args.append(f"results_dir={tmp_path / 'res'}")
    before = _tree(tmp_path)
    capsys.readouterr()
    t0 = time.perf_counter()
    code = main([verb, *args])
    spent = time.perf_counter() - t0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit {code}\nstdout: {out}\nstderr: {err}"
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith(f"vramsweep {verb}: error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert "(allowed: " in lines[0] or case_id.startswith(("m-", "model-", "estimate-model")), lines[0]
    assert _tree(tmp_path) == before, f"written: {sorted(map(str, _tree(tmp_path) - before))}"
    assert spent < BOUND_S, f"{case_id}: {spent:.1f} s before exit 2"


@pytest.mark.parametrize("max_tokens", [256, 1024, 3532, 3533])
def test_truncation_none_check_agrees_with_the_data_step(max_tokens):
    """The pre-flight's count and the data step's own ContextOverflowError agree at every length,
    including the boundary it names (3533 tokens for the longest synthetic example)."""
    from transformers import AutoTokenizer

    from vramsweep.config import ConfigError, compose
    from vramsweep.data.prep import build_trial_data
    from vramsweep.data.truncation import ContextOverflowError
    from vramsweep.preflight import _trial_tokenizer_dir, check_data

    cfg = compose(["context.truncation=none", f"context.max_tokens={max_tokens}"], rules="none")
    try:
        check_data(cfg)
        refused = False
    except ConfigError:
        refused = True
    tok = AutoTokenizer.from_pretrained(str(_trial_tokenizer_dir(cfg)))
    try:
        build_trial_data(cfg, tok)
        fails = False
    except ContextOverflowError:
        fails = True
    assert refused == fails == (max_tokens < 3533)


def test_the_default_config_passes_quickly():
    from vramsweep.config import compose
    from vramsweep.preflight import check_cache, check_data

    cfg = compose([], rules="none")
    t0 = time.perf_counter()
    check_cache(cfg)
    check_data(cfg)
    assert time.perf_counter() - t0 < 2.0
