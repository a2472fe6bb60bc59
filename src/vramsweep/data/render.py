"""Records -> text through the model's chat template -> token ids + the mask of what is trained -> examples.

Rendering. A chat record (``messages``, sharegpt, conversational prompt/completion, alpaca) is rendered with
``tokenizer.apply_chat_template(messages, tokenize=False)`` (the tokenizer's own template, or
``data.chat_template``: a built-in name from :data:`BUILTIN_TEMPLATES` or a Jinja file); plain
prompt/completion strings render as ``prompt + completion + eos``, ``text`` as ``text + eos``. The ids are
the tokenization of exactly that text (``add_special_tokens=False``: templates write their own specials).

What is trained (``data.train_on``). Spans are found without ``{% generation %}`` markers, so any template
works: an assistant turn ``k`` starts after its opener (:func:`turn_layout`: ``<|im_start|>assistant\n``;
the ``j``-th opener in the text is the ``j``-th assistant turn's; after the generation prompt's pre-fill,
or the record's copy of its ending when the turn replaces it: Qwen3's think block with
``enable_thinking=false`` is prompt) or, where openers cannot be counted, where the rendering of
``messages[:k]`` with ``add_generation_prompt=True`` stops agreeing with the full rendering; it ends through
the first end-of-turn special token after it (``<|im_end|>`` in ChatML), whitespace between the content and
that token included. ``assistant``: every
assistant turn; ``last_assistant``: the last one; ``completion``: the assistant turns of the completion
(prompt/completion, alpaca; plain strings: from the first token that differs from the tokenised prompt,
TRL's split, through EOS); ``all``: every token. A token is trained when its characters overlap a trained
span, so a token straddling a span's start is trained (and counted in :attr:`Example.boundary_merged`).

Length (``context.max_tokens``). A conversation that does not fit keeps its leading system messages and
the newest exchanges (a user turn and what follows it) that fit; ``context.truncation=exp_decay`` instead
shares the room left beside the newest exchange among older ones with the weights ``decay**k`` of
:mod:`vramsweep.data.truncation` (``k`` exchanges back): an older exchange keeps its assistant turns whole
and its user/tool content cut to its last tokens, or is dropped when less than
``context.min_tokens_per_section`` tokens of that content would remain: never a cut inside a trained span.
``none`` raises :class:`~vramsweep.data.truncation.ContextOverflowError` naming the record and its length.
When the newest exchange alone is too long its user / tool contents are cut (:func:`_cut_exchange`) and
only what is still over is cut at ``max_tokens``. Plain prompt/completion strings keep the completion and
cut the prompt from its start (``truncation=head``: their first ``max_tokens`` tokens); text records keep
their first ``max_tokens`` tokens. ``data.too_long`` (:data:`TOO_LONG`): ``truncate`` as above, ``drop``
leaves the record out (:func:`build_item_slots` returns None in its place), ``error`` refuses like
``none``.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.data.documents import value_pattern
from vramsweep.data.examples import IGNORE_INDEX, Example
from vramsweep.data.formats import Item, format_row
from vramsweep.data.templates import BUILTIN_TEMPLATES, CHATML, EMBEDDED_CHAT_TEMPLATE
from vramsweep.data.truncation import ContextOverflowError, kept_lengths, longest_first

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHATML",
    "EMBEDDED_CHAT_TEMPLATE",
    "TRAIN_ON",
    "RenderSettings",
    "build_item_examples",
    "build_item_slots",
    "default_train_on",
    "render_item",
    "resolve_template",
]

TRAIN_ON: tuple[str, ...] = ("assistant", "last_assistant", "completion", "all")


def default_train_on(fmt: str) -> str:
    """``data.train_on=auto`` for a format: assistant turns for chats, the completion for prompt/completion
    and alpaca, everything for text."""
    return format_row(fmt).train_on[0]


def train_on_choices(fmt: str) -> tuple[str, ...]:
    """The ``data.train_on`` values that apply to ``fmt`` (documents: none, the target section is trained)."""
    try:
        return format_row(fmt).train_on  # the format table's column (:data:`~.formats.FORMAT_TABLE`)
    except KeyError:
        return ()


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
    too_long: str = "truncate"  # data.too_long: truncate | drop | error (a record over max_tokens)


#: ``data.too_long`` values: what becomes of a record longer than ``context.max_tokens``.
TOO_LONG: tuple[str, ...] = ("truncate", "drop", "error")


def _apply(tok: Any, messages: list[dict], s: RenderSettings, *, gen: bool = False) -> str:
    return tok.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=gen,
        chat_template=s.template,
        enable_thinking=s.enable_thinking,
    )


def _specials(tok: Any) -> set[str]:
    """The text of every special token of ``tok`` (what a template writes as a turn marker)."""
    names = {str(t) for t in getattr(tok, "all_special_tokens", []) or []}
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    names |= {str(t.content) for t in added.values() if getattr(t, "special", False)}
    return {n for n in names if n}


#: Two stand-in answers rendered once per (tokenizer, template, thinking) to see how the template lays out an
#: assistant turn (:func:`turn_layout`).
_PROBE = ("vramsweep-probe-answer-one", "vramsweep-probe-answer-two")
_LAYOUTS: dict[tuple[int, str | None, bool], tuple[Any, TurnLayout]] = {}


@dataclass(frozen=True)
class TurnLayout:
    """How a template lays out an assistant turn (:func:`turn_layout`).

    ``markers``: the special tokens that end it (ChatML ``<|im_end|>``). ``opener``: what it writes before
    the answer (``<|im_start|>assistant\n``; empty when that is not one fixed text holding a special token).
    ``prefill``: what the generation prompt adds after the opener and a rendered turn replaces (Qwen3 with
    ``enable_thinking=false``: ``<think>\n\n</think>\n\n``)."""

    markers: tuple[str, ...]
    opener: str
    prefill: str


def _probe_markers(text: str, specials: set[str]) -> tuple[tuple[str, ...], str]:
    """(the first special token after each probe answer, what follows the last answer)."""
    found: list[str] = []
    after = ""
    for probe in _PROBE:
        at = text.find(probe)
        if at < 0:
            continue
        after = text[at + len(probe) :]
        hits = [(after.find(m), -len(m), m) for m in specials if m in after]
        if hits:
            found.append(min(hits)[2])
        elif probe == _PROBE[-1]:
            found = []
    return tuple(dict.fromkeys(found)), after


def turn_layout(tok: Any, s: RenderSettings) -> TurnLayout:
    """The :class:`TurnLayout` of ``s.template``, found once per tokenizer and template by rendering two
    probe answers: the end-of-turn markers are the first special token written after each; the opener is
    what the generation prompt and a rendered assistant turn have in common.

    Raises:
        ValueError: the template writes no special token of the tokenizer after an assistant turn (the
            model would never be taught to stop), naming what it writes there instead.
    """
    key = (id(tok), s.template, s.enable_thinking)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is tok:
        return hit[1]
    msgs = [
        {"role": "user", "content": "probe question one"},
        {"role": "assistant", "content": _PROBE[0]},
        {"role": "user", "content": "probe question two"},
        {"role": "assistant", "content": _PROBE[1]},
    ]
    text = _apply(tok, msgs, s)
    specials = _specials(tok)
    markers, after = _probe_markers(text, specials)
    if not markers:
        raise ValueError(
            "the chat template writes no special token of the tokenizer after an assistant turn "
            f"(it writes {after[:40]!r}), so no end-of-turn token would be trained and the model would "
            "never learn to stop; use a template whose turn end is a special token of this tokenizer "
            "(data.chat_template=<file>), or add that token to the tokenizer"
        )
    head, gen = _apply(tok, msgs[:1], s), _apply(tok, msgs[:1], s, gen=True)
    opener = prefill = ""
    if gen.startswith(head) and text.startswith(head):
        suffix, turn = gen[len(head) :], text[len(head) :]
        n = _common_prefix(suffix, turn)
        if any(m in suffix[:n] for m in specials) and turn[n:].startswith(_PROBE[0]):
            opener, prefill = suffix[:n], suffix[n:]
    layout = TurnLayout(markers, opener, prefill)
    _LAYOUTS[key] = (tok, layout)
    return layout


_TOOL_PROBE = "vramsweep_probe_tool"
_TOOLS: dict[tuple[int, str | None, bool], tuple[Any, bool]] = {}


def _renders_tool_calls(tok: Any, s: RenderSettings) -> bool:
    """Whether ``s.template`` writes an assistant turn's ``tool_calls`` (a probe call's name shows up)."""
    key = (id(tok), s.template, s.enable_thinking)
    hit = _TOOLS.get(key)
    if hit is not None and hit[0] is tok:
        return hit[1]
    call = {"type": "function", "function": {"name": _TOOL_PROBE, "arguments": {"x": 1}}}
    msgs = [
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "probe result"},
        {"role": "assistant", "content": "probe answer"},
    ]
    try:
        ok = _TOOL_PROBE in _apply(tok, msgs, s)
    except Exception:  # noqa: BLE001 - a template that raises on tool calls does not render them
        ok = False
    _TOOLS[key] = (tok, ok)
    return ok


def _template_name(tok: Any, s: RenderSettings) -> str:
    for name, text in BUILTIN_TEMPLATES.items():
        if s.template == text:
            return f"data.chat_template={name}"
    if s.template == getattr(tok, "chat_template", None):
        return "the tokenizer's own"
    return "data.chat_template=<file>"


def end_of_turn_markers(tok: Any, s: RenderSettings) -> tuple[str, ...]:
    """The special tokens that end an assistant turn under ``s.template`` (:func:`turn_layout`)."""
    return turn_layout(tok, s).markers


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


def _turn_end(full: str, start: int, k: int, markers: Sequence[str]) -> tuple[int, int]:
    """(where the first end-of-turn marker after ``start`` is, its length).

    Raises:
        ValueError: no end-of-turn marker follows the turn.
    """
    ends = [(at, len(m)) for m in markers for at in (full.find(m, start),) if at >= 0]
    if not ends:
        raise ValueError(
            f"assistant turn {k}: no end-of-turn token ({', '.join(markers)}) follows it in the rendered "
            "text, so the model would not be taught to stop after it"
        )
    return min(ends)


def _after_prefill(full: str, start: int, end: int, prefill: str) -> int:
    """Where the answer starts when the generation prompt pre-fills ``prefill`` after the opener at
    ``start``: after the pre-fill when the turn renders it as is; when the turn replaces it (Qwen3 with
    ``enable_thinking=false`` pre-fills an empty think block and a turn with reasoning writes its own), after
    the turn's copy of the pre-fill's ending (``\n</think>\n\n``): that block is prompt, the answer starts
    where it starts at inference; else (a turn rendered without it) at ``start``."""
    n = _common_prefix(prefill, full[start : start + len(prefill)])
    tail = prefill[n:]
    if not tail:
        return start + n
    if tail.strip() and n:
        found = full.find(tail, start + n, end)
        if found >= 0:
            return found + len(tail)
    return start


def _turn_span(
    full: str, k: int, messages: list[dict], tok: Any, s: RenderSettings, layout: TurnLayout
) -> tuple[int, int]:
    """The characters of ``full`` that assistant turn ``k`` trains when its opener cannot be counted: from
    where the rendering of ``messages[:k]`` with the generation prompt stops agreeing with ``full`` through
    the first end-of-turn marker after it (a template whose earlier turns render the same whatever
    follows)."""
    gen = _apply(tok, messages[:k], s, gen=True)
    start = _common_prefix(gen, full)
    at, n = _turn_end(full, start, k, layout.markers)
    tail = gen[start:]
    if tail.strip():
        found = full.find(tail, start, at)
        if found >= 0:
            start = found + len(tail)
    return start, at + n


def _openers(full: str, opener: str) -> list[int]:
    out, at = [], full.find(opener)
    while at >= 0:
        out.append(at + len(opener))
        at = full.find(opener, at + len(opener))
    return out


def _chat_spans(
    item: Item, messages: list[dict], tok: Any, s: RenderSettings
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the trained spans of a conversation. Each assistant turn starts after its
    opener (the ``j``-th opener in the text is the ``j``-th assistant turn's, when they are as many) and the
    pre-fill (:func:`_after_prefill`), and ends through the first end-of-turn marker after it; a template
    without a countable opener is read by rendering prefixes (:func:`_turn_span`)."""
    full = _apply(tok, messages, s)
    if s.train_on == "all":
        return full, [(0, len(full))]
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    idx = assistant
    if s.train_on == "last_assistant":
        idx = idx[-1:]
    elif s.train_on == "completion":  # the completion's messages are the record's last ones (kept by fitting)
        n_completion = len(item.messages) - item.n_prompt
        idx = [k for k in idx if k >= len(messages) - n_completion]
    layout = turn_layout(tok, s)
    starts = _openers(full, layout.opener) if layout.opener else []
    if len(starts) != len(assistant):
        return full, [_turn_span(full, k, messages, tok, s, layout) for k in idx]
    spans = []
    for k in idx:
        start = starts[assistant.index(k)]
        at, n = _turn_end(full, start, k, layout.markers)
        spans.append((_after_prefill(full, start, at, layout.prefill), at + n))
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
    msgs = messages if messages is not None else item.messages
    if any(m.get("tool_calls") for m in msgs) and not _renders_tool_calls(tok, s):
        raise ValueError(
            f"the chat template ({_template_name(tok, s)}) does not render tool calls (an assistant turn "
            "with 'tool_calls'): they would be dropped from what is trained; use a template that renders"
            " them (data.chat_template=<file>, e.g. the model's own) or leave those records out"
        )
    try:
        return _chat_spans(item, msgs, tok, s)
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
            why = (
                "data.too_long=error refuses it"
                if s.too_long == "error"
                else "context.truncation=none cuts nothing"
            )
            raise ContextOverflowError(f"{where}: {n} tokens, {among} ({why})")
    return rendered, encoded


def _labels(ids: list[int], offs: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """A token is trained when its characters overlap a trained span: a token that straddles the span's
    start (a byte-level BPE merging the prompt's last characters with the answer's first) is trained."""
    out = []
    for t, (a, b) in zip(ids, offs):
        hit = any((a < s1 and b > s0) or (a == b and s0 <= a < s1) for s0, s1 in spans)
        out.append(t if hit else IGNORE_INDEX)
    return out


def _merged(offs: list[tuple[int, int]], spans: list[tuple[int, int]]) -> int:
    """How many spans start inside a token (that token is trained and holds prompt characters)."""
    return sum(1 for s0, _ in spans if any(a < s0 < b for a, b in offs))


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _plain_labels(
    ids: list[int], offs: list[tuple[int, int]], prompt_ids: list[int], n_text: int
) -> tuple[list[int], list[tuple[int, int]], int]:
    """(labels, trained character span, boundary-merged) of a prompt/completion string record: trained from
    the first token that differs from the tokenised prompt (TRL's split), so a token merging the prompt's
    trailing space with the completion's first word is trained; merged when that token holds prompt
    characters (the prompt's ids do not all survive)."""
    n = _common_len(prompt_ids, ids)
    start = offs[n][0] if n < len(offs) else n_text
    labels = [IGNORE_INDEX] * n + list(ids[n:])
    return labels, [(start, n_text)], int(n < len(prompt_ids))


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
    """Tokens of ``messages`` rendered (the text only: its spans are found once the messages are chosen)."""
    try:
        text = _apply(tok, messages, s)
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, TypeError, ...
        raise ValueError(
            f"the chat template failed to render this record cut to fit context.max_tokens={s.max_tokens}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _cut_exchange(
    item: Item, tok: Any, s: RenderSettings, system: list[dict], group: list[dict]
) -> list[dict]:
    """The newest exchange alone is too long: its user / tool contents (never an assistant turn) are cut to
    their last tokens, the longest first, re-measured until the rendering fits (at most 4 rounds: cutting
    re-tokenises at the cut); what is still over is cut at ``max_tokens`` by the caller."""
    last = [dict(m) for m in group]
    for _ in range(4):
        over = _length(tok, item, [*system, *last], s) - s.max_tokens
        if over <= 0:
            break
        prompt = [m for m in last if m["role"] != "assistant" and m.get("content")]
        sizes = {id(m): len(tok(m["content"], add_special_tokens=False)["input_ids"]) for m in prompt}
        for m in sorted(prompt, key=lambda m: -sizes[id(m)]):
            cut = min(sizes[id(m)] - 1, over + 2)
            if cut > 0:
                m["content"] = _cut_content(tok, m["content"], sizes[id(m)] - cut)
                over -= cut
            if over <= 0:
                break
    return last


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
        return flat([_cut_exchange(item, tok, s, system, groups[-1])])
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
    """Examples of chat / plain / text records (module docstring); the records ``data.too_long=drop``
    drops are left out (:func:`build_item_slots` keeps their places)."""
    return [e for e in build_item_slots(items, tok, s) if e is not None]


def build_item_slots(items: Sequence[Item], tok: Any, s: RenderSettings) -> list[Example | None]:
    """One example per record, in order, None where ``data.too_long=drop`` dropped a record longer than
    ``context.max_tokens``.

    Raises:
        ContextOverflowError: ``truncation="none"`` or ``too_long="error"`` and a record is longer than
            ``max_tokens`` (names the longest).
        ValueError: ``"<where>: <problem>"``: a template that does not render a record, a record with no
            trained token, a trained turn without its end-of-turn token.
    """
    if s.truncation == "none" or s.too_long == "error":
        rendered, encoded = _render_fitting(items, tok, s)
    else:
        rendered = [_render(it, tok, s) for it in items]
        encoded = _encode(tok, [t for t, _ in rendered]) if rendered else []
    plain = [i for i, it in enumerate(items) if it.kind == "plain"]
    prompt_ids = (
        dict(zip(plain, (p for p, _ in _encode(tok, [items[i].prompt for i in plain])))) if plain else {}
    )
    stops = _stop_ids(tok, s, items)
    return [
        None
        if len(ids) > s.max_tokens and s.too_long == "drop"
        else _example(it, text, spans, ids, offs, tok, s, prompt_ids.get(i), stops)
        for i, (it, (text, spans), (ids, offs)) in enumerate(zip(items, rendered, encoded))
    ]


def _stop_ids(tok: Any, s: RenderSettings, items: Sequence[Item]) -> tuple[set[int], list[str]]:
    """(ids, texts) of the tokens that end a trained turn: the template's end-of-turn tokens (chat records)
    and EOS (prompt/completion strings)."""
    names = [str(getattr(tok, "eos_token", None) or "")]
    if any(it.kind == "chat" for it in items) and s.train_on != "all" and s.template is not None:
        names += end_of_turn_markers(tok, s)
    vocab = tok.get_vocab()
    names = sorted({n for n in names if n})
    return {vocab[n] for n in names if n in vocab}, names


def _check_stops(
    it: Item, text: str, ids: list[int], offs: list[tuple[int, int]], labels: list[int], spans, stops
) -> None:
    """The stop-token guard: every trained span that was not cut at ``max_tokens`` ends with a trained
    end-of-turn token (one special token), else the record is refused saying why."""
    ends = [b for _, b in offs]
    for _, s1 in spans:
        if not ends or s1 > ends[-1]:
            continue  # the turn was cut at context.max_tokens (counted as truncated)
        j = bisect.bisect_right(ends, s1) - 1
        if j >= 0 and ends[j] == s1 and ids[j] in stops[0] and labels[j] != IGNORE_INDEX:
            continue
        got = repr(text[max(0, s1 - 24) : s1])
        raise ValueError(
            f"{it.where}: a trained turn does not end with a trained end-of-turn token (one of "
            f"{', '.join(stops[1])}): it ends with {got}, not tokenised as that special "
            "token, so the model would not learn to stop; check that the tokenizer has the template's "
            "end-of-turn token as a special token"
        )


def _example(
    it: Item,
    text: str,
    spans: list[tuple[int, int]],
    ids: list[int],
    offs: list[tuple[int, int]],
    tok: Any,
    s: RenderSettings,
    prompt_ids: list[int] | None,
    stops: tuple[set[int], list[str]],
) -> Example:
    """One record's example: cut to ``max_tokens`` (conversations: :func:`_fit_messages` first), labelled,
    its stop tokens checked (:func:`_check_stops`)."""
    cut = len(ids) > s.max_tokens
    if cut:
        if it.kind == "chat":
            try:
                text, spans = render_item(it, tok, s, _fit_messages(it, tok, s))
            except ValueError as e:
                raise ValueError(f"{it.where}: {e}") from None
            ids, offs = _encode(tok, [text])[0]
        elif prompt_ids is not None and s.truncation != "head":  # keep the completion: cut the prompt's start
            drop = min(len(ids) - s.max_tokens, _common_len(prompt_ids, ids))
            ids, offs, prompt_ids = ids[drop:], offs[drop:], prompt_ids[drop:]
        ids, offs = ids[: s.max_tokens], offs[: s.max_tokens]
    if prompt_ids is not None and s.train_on != "all":
        labels, spans, merged = _plain_labels(ids, offs, prompt_ids, len(text))
    else:
        labels, merged = _labels(ids, offs, spans), _merged(offs, spans)
    n_trained = sum(1 for t in labels if t != IGNORE_INDEX)
    if n_trained == 0:
        raise ValueError(
            f"{it.where}: no trained token after masking (data.train_on={s.train_on}"
            + (f", cut to context.max_tokens={s.max_tokens}" if len(ids) >= s.max_tokens else "")
            + ")"
        )
    if s.train_on != "all" and it.kind in ("chat", "plain"):
        _check_stops(it, text, ids, offs, labels, spans, stops)
    return Example(
        input_ids=ids,
        labels=labels,
        doc_id=it.id,
        target_section=0,
        n_context_tokens=len(ids) - n_trained,
        fact_spans=_fact_spans(text, offs, spans, it.facts, len(ids)),
        where=it.where,
        boundary_merged=merged,
        truncated=cut,
    )
