"""Records -> text through the model's chat template -> token ids + the mask of what is trained -> examples.

Rendering. A chat record (``messages``, sharegpt, conversational prompt/completion, alpaca) is rendered with
``tokenizer.apply_chat_template(messages, tokenize=False)`` (the tokenizer's own template, or
``data.chat_template``: a built-in name from :data:`BUILTIN_TEMPLATES` or a Jinja file); plain
prompt/completion strings render as ``prompt + completion + eos``, ``text`` as ``text + eos``. The ids are
the tokenization of exactly that text (``add_special_tokens=False``: templates write their own specials).

What is trained (``data.train_on``). Spans are found by rendering prefixes, so any template works without
``{% generation %}`` markers: an assistant turn ``k`` starts where the rendering of ``messages[:k]`` with
``add_generation_prompt=True`` stops agreeing with the full rendering, and ends after the turn's content
plus the end-of-turn special token that follows it (``<|im_end|>`` in ChatML). ``assistant``: every
assistant turn; ``last_assistant``: the last one; ``completion``: the assistant turns of the completion
(prompt/completion, alpaca; plain strings: the completion and its EOS); ``all``: every token. A token is
trained when it starts inside a trained span.

Length (``context.max_tokens``). A conversation that does not fit keeps its leading system messages and
the newest exchanges (a user turn and what follows it) that fit; ``context.truncation=exp_decay`` instead
shares the room left beside the newest exchange among older ones with the weights ``decay**k`` of
:mod:`vramsweep.data.truncation` (``k`` exchanges back): an older exchange keeps its assistant turns whole
and its user/tool content cut to its last tokens, or is dropped when less than
``context.min_tokens_per_section`` tokens of that content would remain: never a cut inside a trained span.
``none`` raises :class:`~vramsweep.data.truncation.ContextOverflowError` naming the record and its length.
Only when the newest exchange alone is too long is the sequence cut at ``max_tokens``. Plain and text
records keep their first ``max_tokens`` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.data.documents import value_pattern
from vramsweep.data.examples import IGNORE_INDEX, Example
from vramsweep.data.formats import Item
from vramsweep.data.templates import BUILTIN_TEMPLATES, CHATML, EMBEDDED_CHAT_TEMPLATE
from vramsweep.data.truncation import ContextOverflowError, kept_lengths, longest_first

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHATML",
    "EMBEDDED_CHAT_TEMPLATE",
    "TRAIN_ON",
    "RenderSettings",
    "build_item_examples",
    "default_train_on",
    "render_item",
    "resolve_template",
]

TRAIN_ON: tuple[str, ...] = ("assistant", "last_assistant", "completion", "all")
#: ``data.train_on`` values each format accepts (the first is its default).
_TRAIN_ON_BY_FORMAT = {
    "messages": ("assistant", "last_assistant", "all"),
    "sharegpt": ("assistant", "last_assistant", "all"),
    "prompt_completion": ("completion", "all"),
    "alpaca": ("completion", "all"),
    "text": ("all",),
}


def default_train_on(fmt: str) -> str:
    """``data.train_on=auto`` for a format: assistant turns for chats, the completion for prompt/completion
    and alpaca, everything for text."""
    return _TRAIN_ON_BY_FORMAT[fmt][0]


def train_on_choices(fmt: str) -> tuple[str, ...]:
    """The ``data.train_on`` values that apply to ``fmt`` (documents: none, the target section is trained)."""
    return _TRAIN_ON_BY_FORMAT.get(fmt, ())


def resolve_template(setting: str | None, tokenizer: Any) -> str | None:
    """The Jinja text ``data.chat_template`` names (a built-in or a file), else the tokenizer's own (or None).

    Raises:
        ValueError: the setting is neither a built-in name nor a readable file.
    """
    if setting in (None, "", "auto"):
        return getattr(tokenizer, "chat_template", None) or None
    if setting in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[setting]
    p = Path(os.path.expanduser(str(setting)))
    if not p.is_file():
        raise ValueError(
            f"data.chat_template={setting!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor a readable Jinja file"
        )
    return p.read_text(encoding="utf-8")


@dataclass(frozen=True)
class RenderSettings:
    """What rendering and truncation depend on (part of the tokenisation cache key)."""

    train_on: str
    template: str | None
    enable_thinking: bool
    max_tokens: int
    truncation: str
    decay: float
    min_tokens_per_section: int


def _apply(tok: Any, messages: list[dict], s: RenderSettings, *, gen: bool = False) -> str:
    return tok.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=gen,
        chat_template=s.template,
        enable_thinking=s.enable_thinking,
    )


def _end_markers(tok: Any) -> list[str]:
    names = {str(t) for t in getattr(tok, "all_special_tokens", []) or []}
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    names |= {str(t.content) for t in added.values() if getattr(t, "special", False)}
    eos = getattr(tok, "eos_token", None)
    return sorted((n for n in names if n), key=lambda n: (n != eos, -len(n)))


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix (bisected with C string compares: a character loop took most
    of the rendering of a large file)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _visible(content: str) -> str:
    """The part of an assistant content a template shows (Qwen3 moves ``<think>`` blocks out of it)."""
    if "</think>" in content:
        content = content.split("</think>")[-1]
    return content.strip()


def _chat_spans(
    item: Item, messages: list[dict], tok: Any, s: RenderSettings
) -> tuple[str, list[tuple[int, int]]]:
    full = _apply(tok, messages, s)
    if s.train_on == "all":
        return full, [(0, len(full))]
    idx = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if s.train_on == "last_assistant":
        idx = idx[-1:]
    elif s.train_on == "completion":  # the completion's messages are the record's last ones (kept by fitting)
        n_completion = len(item.messages) - item.n_prompt
        idx = [k for k in idx if k >= len(messages) - n_completion]
    markers = _end_markers(tok)
    spans = []
    for k in idx:
        start = _common_prefix(_apply(tok, messages[:k], s, gen=True), full)
        c = _visible(messages[k]["content"])
        at = full.find(c, start)
        if not c or at < 0:
            raise ValueError(
                f"the chat template does not show assistant turn {k}'s content verbatim, so its tokens "
                "cannot be found; use a template that does (data.chat_template=<file>)"
            )
        end = at + len(c)
        for mk in markers:
            if full.startswith(mk, end):
                end += len(mk)
                break
        spans.append((start, end))
    return full, spans


def render_item(
    item: Item, tok: Any, s: RenderSettings, messages: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, trained character spans) of a chat, plain or text record (see the module docstring).

    Raises:
        ValueError: no chat template for a chat record, or the template fails to render it.
    """
    eos = getattr(tok, "eos_token", None) or ""
    if item.kind == "text":
        text = item.text + eos
        return text, [(0, len(text))]
    if item.kind == "plain":
        text = item.prompt + item.completion + eos
        return text, [(0 if s.train_on == "all" else len(item.prompt), len(text))]
    if s.template is None:
        raise ValueError(
            "the tokenizer has no chat template; set data.chat_template= one of "
            f"{', '.join(BUILTIN_TEMPLATES)} or a path to a Jinja file"
        )
    try:
        return _chat_spans(item, messages if messages is not None else item.messages, tok, s)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, TypeError, ...
        raise ValueError(
            f"the chat template failed to render this record: {type(exc).__name__}: {exc}"
        ) from None


def _encode(tok: Any, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids and character offsets of each text, without special tokens. A fast tokenizer's Rust backend
    is called directly: the same ids and offsets as ``tok(..., return_offsets_mapping=True)``, without its
    per-token Python conversions (55 MB of chat records: 70 s -> 40 s on one core)."""
    backend = getattr(tok, "backend_tokenizer", None)
    plain = backend is not None and backend.truncation is None and backend.padding is None
    if plain and getattr(tok, "is_fast", False):
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [
        ([int(t) for t in ids], [(int(a), int(b)) for a, b in offs])
        for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])
    ]


def _chars(it: Item) -> int:
    """A record's length in characters before rendering (its contents): the order of the ``none`` check."""
    if it.kind == "chat":
        return sum(len(str(m.get("content") or "")) for m in it.messages)
    return len(it.text) + len(it.prompt) + len(it.completion)


def _render(it: Item, tok: Any, s: RenderSettings) -> tuple[str, list[tuple[int, int]]]:
    try:
        return render_item(it, tok, s)
    except ValueError as e:
        raise ValueError(f"{it.where}: {e}") from None


def _render_fitting(items: Sequence[Item], tok: Any, s: RenderSettings) -> tuple[list[Any], list[Any]]:
    """Rendered texts and their :func:`_encode` for ``truncation=none``: the records longest (in characters)
    first, in batches (:func:`~vramsweep.data.truncation.longest_first`), file order within a batch, and a
    refusal at the first batch that holds a record over ``max_tokens``, naming the longest of them. Texts
    and ids are those of one pass in file order.

    Raises:
        ContextOverflowError: a record is longer than ``max_tokens`` (its ``file:line`` and length).
    """
    rendered: list[Any] = [None] * len(items)
    encoded: list[Any] = [None] * len(items)
    read = 0
    for batch in longest_first([_chars(it) for it in items]):
        batch = sorted(batch)
        for i in batch:
            rendered[i] = _render(items[i], tok, s)
        for i, enc in zip(batch, _encode(tok, [rendered[i][0] for i in batch])):
            encoded[i] = enc
        read += len(batch)
        over = [(len(encoded[i][0]), items[i].where) for i in batch if len(encoded[i][0]) > s.max_tokens]
        if over:
            n, where = max(over, key=lambda x: x[0])
            limit = f"context.max_tokens={s.max_tokens}"
            among = (
                f"the longest of {len(over)} of {len(items)} records longer than {limit}"
                if read == len(items)
                else f"the longest of {len(over)} longer than {limit} among the {read} of {len(items)} "
                "records tokenised, longest first"
            )
            raise ContextOverflowError(f"{where}: {n} tokens, {among} (context.truncation=none cuts nothing)")
    return rendered, encoded


def _labels(ids: list[int], offs: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    out = []
    for t, (a, _b) in zip(ids, offs):
        out.append(t if any(s0 <= a < s1 for s0, s1 in spans) else IGNORE_INDEX)
    return out


def _fact_spans(
    text: str, offs: list[tuple[int, int]], spans: list[tuple[int, int]], facts: Sequence[str], n: int
) -> list[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for v in facts:
        for m in value_pattern(v).finditer(text):
            a, b = m.span()
            if not any(s0 <= a and b <= s1 for s0, s1 in spans):
                continue
            toks = [t for t, (x, y) in enumerate(offs) if x < b and y > a]
            if toks and toks[0] >= 1 and toks[-1] < n:
                found.add((toks[0], toks[-1] + 1))
    return sorted(found)


def _groups(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, exchanges: each a user turn and the messages up to the next user turn)."""
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        i += 1
    groups: list[list[dict]] = []
    for m in messages[i:]:
        if m["role"] == "user" or not groups:
            groups.append([])
        groups[-1].append(m)
    return messages[:i], groups


def _cut_content(tok: Any, content: str, keep: int) -> str:
    ids = tok(content, add_special_tokens=False)["input_ids"]
    return tok.decode(ids[len(ids) - keep :]) if keep < len(ids) else content


def _length(tok: Any, item: Item, messages: list[dict], s: RenderSettings) -> int:
    return len(tok(render_item(item, tok, s, messages)[0], add_special_tokens=False)["input_ids"])


def _fit_messages(item: Item, tok: Any, s: RenderSettings) -> list[dict]:
    """The messages of a too-long conversation that fit (module docstring); may still be over when the newest
    exchange alone is too long."""
    system, groups = _groups(item.messages)
    trained_roles = {"assistant"}

    def flat(gs: Sequence[list[dict]]) -> list[dict]:
        return [*system, *(m for g in gs for m in g)]

    # the newest exchanges that fit whole: the smallest j with groups[j:] fitting (length falls as j grows)
    lo, hi = 0, len(groups) - 1
    if _length(tok, item, flat(groups[hi:]), s) > s.max_tokens:
        last = [dict(m) for m in groups[-1]]
        for m in last:  # cut the newest exchange's prompt side until it fits, then give up
            if m["role"] not in trained_roles:
                fixed = _length(tok, item, flat([[x for x in last if x is not m]]), s)
                room = s.max_tokens - fixed - 8
                m["content"] = _cut_content(tok, m["content"], max(1, room))
        return flat([last])
    while lo < hi:
        mid = (lo + hi) // 2
        if _length(tok, item, flat(groups[mid:]), s) <= s.max_tokens:
            hi = mid
        else:
            lo = mid + 1
    if s.truncation != "exp_decay" or lo == 0:
        return flat(groups[lo:])
    # exp_decay: older exchanges (oldest first) share the room left beside the newest one
    base = _length(tok, item, flat(groups[-1:]), s)
    older = groups[:-1]
    user_len = [
        sum(
            len(tok(m["content"], add_special_tokens=False)["input_ids"])
            for m in g
            if m["role"] not in trained_roles
        )
        for g in older
    ]
    whole = [
        _length(tok, item, [*system, *g], s) - _length(tok, item, system, s)
        if system
        else _length(tok, item, g, s)
        for g in older
    ]
    room = max(0, s.max_tokens - base)
    fixed = [w - u for w, u in zip(whole, user_len)]  # markers + assistant turns: never cut
    chosen: list[list[dict]] = []
    for m in range(len(older), 0, -1):  # the most older exchanges whose user content still gets a share
        budget = room - sum(fixed[-m:])
        if budget < m * max(1, s.min_tokens_per_section):
            continue
        # the newest exchange is already whole (base): a 0-token stand-in takes its place, so the older ones
        # share the budget with the weights decay**k, k = exchanges back
        keep = kept_lengths([*user_len[-m:], 0], budget, "exp_decay", s.decay, s.min_tokens_per_section)[:-1]
        if any(k == 0 and u > 0 for k, u in zip(keep, user_len[-m:])):
            continue
        chosen = [
            [
                x if x["role"] in trained_roles else {**x, "content": _cut_content(tok, x["content"], k)}
                for x in g
            ]
            if k < u
            else g
            for g, k, u in zip(older[-m:], keep, user_len[-m:])
        ]
        break
    while chosen and _length(tok, item, flat([*chosen, groups[-1]]), s) > s.max_tokens:
        chosen.pop(0)
    return flat([*chosen, groups[-1]])


def build_item_examples(items: Sequence[Item], tok: Any, s: RenderSettings) -> list[Example]:
    """Examples of chat / plain / text records (module docstring).

    Raises:
        ContextOverflowError: ``truncation="none"`` and a record is longer than ``max_tokens`` (names it).
        ValueError: ``"<where>: <problem>"``: a template that does not render a record, or a record with no
            trained token.
    """
    if s.truncation == "none":
        rendered, encoded = _render_fitting(items, tok, s)
    else:
        rendered = [_render(it, tok, s) for it in items]
        encoded = _encode(tok, [t for t, _ in rendered]) if rendered else []
    out: list[Example] = []
    for it, (text, spans), (ids, offs) in zip(items, rendered, encoded):
        if len(ids) > s.max_tokens:
            if it.kind == "chat":
                try:
                    text, spans = render_item(it, tok, s, _fit_messages(it, tok, s))
                except ValueError as e:
                    raise ValueError(f"{it.where}: {e}") from None
                ids, offs = _encode(tok, [text])[0]
            ids, offs = ids[: s.max_tokens], offs[: s.max_tokens]
        labels = _labels(ids, offs, spans)
        n_trained = sum(1 for t in labels if t != IGNORE_INDEX)
        if n_trained == 0:
            raise ValueError(
                f"{it.where}: no trained token after masking (data.train_on={s.train_on}"
                + (f", cut to context.max_tokens={s.max_tokens}" if len(ids) >= s.max_tokens else "")
                + ")"
            )
        out.append(
            Example(
                input_ids=ids,
                labels=labels,
                doc_id=it.id,
                target_section=0,
                n_context_tokens=len(ids) - n_trained,
                fact_spans=_fact_spans(text, offs, spans, it.facts, len(ids)),
                where=it.where,
            )
        )
    return out
