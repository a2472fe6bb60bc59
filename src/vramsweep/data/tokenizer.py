"""Byte-level BPE tokenizer for the embedded model, trained locally with the ``tokenizers`` library.

Byte-level means every string can be encoded (no unknown characters), so ``<|unk|>`` is never produced by
encoding; it exists so that vocabulary slicing can map dropped tokens to it (``vocab.fallback=unk``).
Encoding never adds special tokens on its own (no post-processor template): the data layer places
``<|bos|>``, ``<|sep|>`` and ``<|eos|>`` explicitly (see :mod:`vramsweep.data.examples`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from vramsweep.data.templates import EMBEDDED_CHAT_TEMPLATE

__all__ = ["SPECIAL_TOKENS", "load_tokenizer", "train_tokenizer"]

# Fixed ids 0..4, in this order.
SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|eos|>", "<|bos|>", "<|unk|>", "<|sep|>")


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``texts``.

    The same texts (in the same order) always give the same vocabulary and merges: the BPE trainer picks
    the most frequent pair and breaks ties by the pair itself, and the texts are consumed in one
    sequential batch.

    Args:
        texts: training texts (consumed once).
        vocab_size: the vocabulary size to aim for, special tokens and the 256 byte tokens included; the
            result is smaller when the texts run out of pairs occurring ``min_frequency`` times.
        min_frequency: a pair must occur at least this often to be merged.

    Returns:
        A fast tokenizer with ``<|pad|>``, ``<|eos|>``, ``<|bos|>``, ``<|unk|>``, ``<|sep|>`` at ids 0..4
        (``pad_token``, ``eos_token``, ``bos_token``, ``unk_token``, ``sep_token`` set). It saves with
        ``save_pretrained`` and reloads with ``AutoTokenizer.from_pretrained(local_dir)``.
    """
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (specials + 256 byte tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False: a token's offsets include its leading space (used to locate fact values).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text_list = [t for t in texts if t]
    if not text_list:
        raise ValueError("train_tokenizer needs at least one non-empty text")
    tok.train_from_iterator(text_list, trainer=trainer, length=len(text_list))
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:  # pragma: no cover - guaranteed by the trainer's special_tokens order
            raise AssertionError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|eos|>",
        bos_token="<|bos|>",
        unk_token="<|unk|>",
        sep_token="<|sep|>",
        model_max_length=1_000_000_000,
        clean_up_tokenization_spaces=False,
    )


#: ``tokenizer_class`` values that name the plain fast tokenizer (``TokenizersBackend`` in transformers 5).
_PLAIN_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(folder: str | os.PathLike[str]) -> str:
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as fh:
            return str(json.load(fh).get("tokenizer_class") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def load_tokenizer(folder: str | os.PathLike[str], *, embedded: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``; for the embedded model, its chat template when the folder
    predates ``chat_template.jinja`` (a cache copied from an older asset).

    A folder whose ``tokenizer_config.json`` names the plain fast tokenizer (the embedded model's) loads
    through that class directly: the same tokenizer ``AutoTokenizer`` builds, without importing the auto
    model registry (about half the time the pre-flight spends before a bad chat record exits 2)."""
    if _tokenizer_class(folder) in _PLAIN_FAST and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
    if embedded and not tok.chat_template:
        tok.chat_template = EMBEDDED_CHAT_TEMPLATE
    return tok
