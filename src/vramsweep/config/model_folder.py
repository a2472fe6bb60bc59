"""A local model folder (``model.path``) checked before anything is built, without loading a weight (issue
40.2, 40.4): torch-free, reading only ``config.json``, the tokenizer's file names and the safetensors headers.

Refused in one line naming the file and the problem (:class:`~vramsweep.config.errors.ConfigError`):

* no weights (``model.safetensors``, a sharded ``model.safetensors.index.json``, ``pytorch_model*.bin``), or
  GGUF files only (transformers loads GGUF only by name, and dequantises it);
* a safetensors file that is truncated or not safetensors (its 8-byte header length, its JSON header, and the
  data it describes must cover the file exactly), or a shard the index names that is not there;
* ``config.json``'s ``dtype`` / ``torch_dtype`` that is no floating dtype;
* a ``model_type`` transformers does not know, or one without a causal-LM class (encoder-only: BERT, T5's
  encoder ...): the table is read from transformers' ``modeling_auto.py`` source, not imported (that
  imports torch);
* weights that do not fit the config: the embedding's shape against ``vocab_size`` x ``hidden_size``, the
  decoder layers the weights hold against ``num_hidden_layers`` (missing layers would train from random
  values, extra ones be dropped), a tensor some layer lacks, no ``lm_head.weight`` with untied embeddings;
* no tokenizer (``tokenizer.json`` / ``tokenizer_config.json``), unless ``data=random`` asks for random token
  ids (memory and speed only): the trial would otherwise train on random tokens without a word.
"""

from __future__ import annotations

import ast
import json
import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

from vramsweep.config.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: dtype names transformers maps to a torch floating dtype (``config.json``'s ``dtype`` / ``torch_dtype``).
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double", "auto")
#: A safetensors header above this is garbage (the format's own reader refuses headers over 100 MB).
MAX_HEADER = 100_000_000
#: Encoders that transformers can run as a causal LM only with ``is_decoder=true`` (``BertLMHeadModel``...).
ENCODER_TYPES = frozenset(
    "bert bert-generation big_bird camembert data2vec-text electra ernie megatron-bert rembert roberta "
    "roberta-prelayernorm xlm-roberta xlm-roberta-xl xmod".split()
)
_LAYER = re.compile(r"^(.*?\.layers)\.(\d+)\.(.+)$")


def _err(key: str, msg: str, allowed: list[str] | None = None) -> ConfigError:
    return ConfigError(f"{key}: {msg}", key=key, allowed=allowed)


def safetensors_header(file: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` from a safetensors file's header; ValueError says what is wrong with it."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"not a safetensors file (header length {n} in a {size}-byte file)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    shapes: dict[str, list[int]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = [int(d) for d in info["shape"]]
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"not a safetensors file (tensor {name!r} has no shape/data_offsets)") from None
    if end != size - 8 - n:
        raise ValueError(
            f"truncated or padded: its header describes {end} bytes of data, the file holds {size - 8 - n}"
        )
    return shapes


def _weight_files(folder: Path, key: str) -> list[Path] | None:
    """The safetensors files of the folder (None when it has ``pytorch_model*.bin`` weights only)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _err(key, f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise _err(key, f"{index} names the shard {f.name}, which is not in {folder}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if any(folder.glob("pytorch_model*.bin")):
        return None
    gguf = sorted(p.name for p in folder.glob("*.gguf"))
    if gguf:
        raise _err(
            key,
            f"{folder} holds GGUF weights only ({', '.join(gguf[:3])}): vramsweep loads Hugging Face weights",
            ["a folder with model.safetensors (or a sharded model.safetensors.index.json)"],
        )
    raise _err(
        key,
        f"{folder} has no weights (no model.safetensors, model.safetensors.index.json or pytorch_model.bin)",
        ["a Hugging Face folder with config.json, weights and tokenizer files"],
    )


def _shapes(folder: Path, key: str) -> dict[str, list[int]] | None:
    files = _weight_files(folder, key)
    if files is None:
        return None
    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            shapes.update(safetensors_header(f))
        except (OSError, ValueError) as exc:
            raise _err(key, f"{f}: {exc}") from None
    return shapes


@lru_cache(maxsize=1)
def causal_lm_types() -> tuple[frozenset[str], frozenset[str], frozenset[str]] | None:
    """(every model_type transformers knows, the decoders among those with a causal-LM class, the causal-LM
    class names), from its source; None when
    transformers is not installed here (the check is then left to the trial)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("transformers")
    except metadata.PackageNotFoundError:
        return None
    known: set[str] = set()
    for module in ("auto_mappings", "configuration_auto"):  # the table moved to auto_mappings.py in v5
        try:
            src = Path(str(dist.locate_file(f"transformers/models/auto/{module}.py"))).read_text()
        except OSError:
            continue
        known |= set(_mapping_keys(src, "CONFIG_MAPPING_NAMES"))
    try:
        src = Path(str(dist.locate_file("transformers/models/auto/modeling_auto.py"))).read_text()
    except OSError:
        return None
    causal = _mapping_keys(src, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if not known or not causal:
        return None
    classes = {c for c in causal.values() if isinstance(c, str)}
    return frozenset(known | set(causal)), frozenset(set(causal) - ENCODER_TYPES), frozenset(classes)


def _mapping_keys(src: str, name: str) -> dict[str, Any]:
    for node in ast.parse(src).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == name:
            pairs: dict[Any, Any] = {}
            for e in ast.walk(node.value):
                if isinstance(e, ast.Tuple) and len(e.elts) == 2 and isinstance(e.elts[0], ast.Constant):
                    pairs[e.elts[0].value] = e.elts[1]
                elif isinstance(e, ast.Dict):
                    pairs.update(
                        (k.value, v) for k, v in zip(e.keys, e.values) if isinstance(k, ast.Constant)
                    )
            return {
                k: v.value if isinstance(v, ast.Constant) else None
                for k, v in pairs.items()
                if isinstance(k, str)
            }
    return {}


def _check_type_and_dtype(hf: dict[str, Any], cfg_file: Path, key: str) -> None:
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype is not None and str(dtype).removeprefix("torch.") not in FLOAT_DTYPES:
        raise _err(key, f"{cfg_file}: dtype={dtype!r} is no floating dtype", list(FLOAT_DTYPES))
    mtype = hf.get("model_type")
    types = causal_lm_types()
    if types is None:
        return
    known, causal, classes = types
    archs = hf.get("architectures")
    if not isinstance(mtype, str) or mtype not in known:
        raise _err(
            key,
            f"{cfg_file}: model_type={mtype!r} is not a model type transformers knows",
            ["a decoder model type, e.g. llama, mistral, qwen2, qwen3"],
        )
    not_causal = isinstance(archs, list) and archs and not any(a in classes for a in archs)
    if mtype not in causal or not_causal:
        raise _err(
            key,
            f"{cfg_file}: model_type={mtype!r}"
            + (f" (architectures={archs})" if not_causal else "")
            + " is no decoder (an encoder-only model cannot be "
            "fine-tuned as a language model here)",
            ["a decoder model type, e.g. llama, mistral, qwen2, qwen3"],
        )


def _layer_problem(shapes: dict[str, list[int]], n_layers: int) -> str | None:
    layers: dict[int, set[str]] = {}
    for name in shapes:
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(2)), set()).add(m.group(3))
    if not layers:
        return None
    have = set(layers)
    missing, extra = sorted(set(range(n_layers)) - have), sorted(have - set(range(n_layers)))
    if missing:
        return (
            f"config.json has num_hidden_layers={n_layers} but the weights hold {len(have)} decoder layers "
            f"(layers {_span(missing)} missing: they would train from random values)"
        )
    if extra:
        return (
            f"config.json has num_hidden_layers={n_layers} but the weights hold {len(have)} decoder layers "
            f"(layers {_span(extra)} would be dropped)"
        )
    every = set().union(*layers.values())
    for i in sorted(layers):
        if layers[i] != every:
            return f"decoder layer {i} has no {', '.join(sorted(every - layers[i])[:3])} (it would be random)"
    return None


def _span(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if len(ids) > 2 else ", ".join(map(str, ids))


def _check_shapes(hf: dict[str, Any], shapes: dict[str, list[int]], folder: Path, key: str) -> None:
    allowed = [
        "a config.json that matches its weights",
        "model=<architecture> without model.path (random weights)",
    ]
    vocab, hidden = hf.get("vocab_size"), hf.get("hidden_size")
    for name, shape in shapes.items():
        if name.endswith("embed_tokens.weight") and shape != [vocab, hidden]:
            raise _err(
                key,
                f"{folder}: {name} is {shape[0] if shape else '?'} x {shape[1] if len(shape) > 1 else '?'} "
                f"but config.json has vocab_size={vocab}, hidden_size={hidden}",
                allowed,
            )
    n_layers = hf.get("num_hidden_layers")
    problem = _layer_problem(shapes, int(n_layers)) if isinstance(n_layers, int) else None
    if problem:
        raise _err(key, f"{folder}: {problem}", allowed)
    if not hf.get("tie_word_embeddings", True) and shapes and "lm_head.weight" not in shapes:
        if any(n.endswith("embed_tokens.weight") for n in shapes):
            raise _err(
                key,
                f"{folder}: tie_word_embeddings=false but the weights hold no lm_head.weight (it "
                "would be random)",
                allowed,
            )


def check_model_folder(path: str | Path, *, key: str = "model.path", data_source: str | None = None) -> None:
    """Raise :class:`ConfigError` for a local model folder the trial could not load, or would load wrong
    (module docstring). ``data_source``: the config's ``data.source`` (``random`` needs no tokenizer)."""
    folder = Path(str(path))
    cfg_file = folder / "config.json"
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # vramsweep.estimate.dims.check_model_config says what is wrong with config.json
    if not isinstance(hf, dict):
        return
    _check_type_and_dtype(hf, cfg_file, key)
    shapes = _shapes(folder, key)
    if shapes is not None:
        _check_shapes(hf, shapes, folder, key)
    check_tokenizer(folder, key=key, data_source=data_source)


def check_tokenizer(folder: Path, *, key: str = "model.path", data_source: str | None = None) -> None:
    """A model folder without tokenizer files trains on random token ids: refused unless ``data=random``."""
    if data_source != "random" and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise _err(
            key,
            f"{folder} has no tokenizer (no {' or '.join(TOKENIZER_FILES)}): the trial would train on random "
            "token ids",
            [
                "a folder with the model's tokenizer files",
                "data=random (random token ids: memory and speed only)",
            ],
        )
