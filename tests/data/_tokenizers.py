"""Tokenizers of the three families real models use, for the mask tests (built once per test session):

* ``embedded``: the embedded tiny model's byte-level BPE (its own vocabulary keeps a space apart from the
  next word), with the specials of the three templates added;
* ``bpe``: a byte-level BPE trained here with the ``tokenizers`` library, Qwen2's pre-tokenizer (GPT-2's
  regex family: ``' yes'`` and ``'\\n\\n'`` are single tokens, so a prompt's trailing space or newline
  merges into the answer's first token);
* ``metaspace``: a SentencePiece-style BPE (``Metaspace`` pre-tokenizer, ``'▁'`` for a space, prepended
  to the first word), trained likewise.

Each carries the specials of ChatML / Qwen3 (``<|im_start|>``, ``<|im_end|>``), Llama 3
(``<|begin_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``) and an EOS.
"""

from __future__ import annotations

import functools
from pathlib import Path

TEMPLATES_DIR = Path(__file__).parents[1] / "fixtures" / "chat_templates"
#: the chat templates shipped as test data: name -> Jinja text
TEMPLATES = {n: (TEMPLATES_DIR / f"{n}.jinja").read_text() for n in ("chatml", "qwen3", "llama3")}
#: the end-of-turn token each template writes after an assistant turn
END_OF_TURN = {"chatml": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
#: the non-ASCII characters the generated records use (in every trained vocabulary's alphabet)
UNICODE = "äöüéñçß€—“”中文日本語한국어😀🚀"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _corpus() -> list[str]:
    words = (
        "the answer is yes no four six two plus what and it think about question reply tool result "
        "call weather Paris capital of France be brief system user assistant add again"
    ).split()
    lines = []
    for i in range(400):
        w = [words[(i * 7 + j * 3) % len(words)] for j in range(8)]
        lines.append(
            " ".join(w) + (".\n\n" if i % 2 == 0 else ". ") + "Answer: yes\n" + UNICODE[i % len(UNICODE)]
        )
    return lines + ["\n\n".join(words), "\n".join(words), UNICODE] * 5


def _wrap(tk, eos: str):
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=eos, pad_token=eos, bos_token="<|begin_of_text|>"
    )
    t.add_special_tokens({"additional_special_tokens": [s for s in SPECIALS if s != eos]})
    return t


@functools.cache
def byte_level_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_corpus(), trainer)
    return _wrap(tk, "<|endoftext|>")


@functools.cache
def metaspace_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(_corpus())) | set("\n\t \r") | {chr(c) for c in range(32, 127)})
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", *SPECIALS], initial_alphabet=alphabet, limit_alphabet=1000
    )
    tk.train_from_iterator(_corpus(), trainer)
    return _wrap(tk, "<|endoftext|>")


@functools.cache
def embedded():
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    t = load_tokenizer(ASSET_DIR)
    t.add_special_tokens({"additional_special_tokens": SPECIALS})
    return t


TOKENIZERS = {"embedded": embedded, "bpe": byte_level_bpe, "metaspace": metaspace_bpe}
