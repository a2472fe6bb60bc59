"""Record formats: detected from a record's keys (or set with ``data.format``) and normalised into an
:class:`Item`.

=====================  ===============================================================  ======================
format                 a record                                                         rendered as
=====================  ===============================================================  ======================
``messages``           ``{"messages": [{"role": "user", "content": "..."}, ...]}``      the chat template
``sharegpt``           ``{"conversations": [{"from": "human", "value": "..."}, ...]}``  mapped onto
                                                                                        ``messages``
``prompt_completion``  ``{"prompt": "...", "completion": "..."}`` (strings: plain        plain text, or the
                       text) or both message lists (TRL's conversational form)           chat template for
                                                                                        lists
``alpaca``             ``{"instruction": "...", "input": "...", "output": "..."}``       user / assistant
                                                                                        turns
``text``               ``{"text": "..."}``                                              plain text + EOS
``documents``          ``{"sections": [{"heading": "...", "text": "..."}], ...}``        sectioned documents
=====================  ===============================================================  ======================

Roles are ``system``, ``user``, ``assistant`` and ``tool`` (sharegpt's ``human``/``gpt``/``observation``/
``function_call`` are mapped onto them). One file holds one format: a record of another format is an error
naming both lines. Any record may carry ``"facts"`` (strings, or objects with a ``"value"``): each whole-word
occurrence of a value inside a trained span is a fact span for the task score. Every problem raises
``ValueError("<file>:<line>: <problem>")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramsweep.data.documents import normalize_document
from vramsweep.data.sources import Record

__all__ = [
    "FORMAT_TABLE",
    "FORMATS",
    "ROLES",
    "Format",
    "Item",
    "accepted",
    "detect_format",
    "format_row",
    "formats",
    "normalize_records",
]

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}


@dataclass
class Item:
    """One normalised record.

    ``kind``: ``chat`` (``messages``; the first ``n_prompt`` are the prompt of a prompt/completion record),
    ``plain`` (``prompt`` + ``completion`` strings), ``text`` or ``document`` (``doc``, as
    :func:`vramsweep.data.documents.normalize_document` returns it).
    """

    where: str
    id: str
    format: str
    kind: str
    messages: list[dict[str, str]] = field(default_factory=list)
    n_prompt: int = 0
    prompt: str = ""
    completion: str = ""
    text: str = ""
    doc: dict[str, Any] | None = None
    facts: list[str] = field(default_factory=list)


def detect_format(obj: Any) -> str | None:
    """The format whose keys ``obj`` has (first match in :data:`_KEYS`), or None."""
    if not isinstance(obj, dict):
        return None
    for f in FORMAT_TABLE:
        if all(k in obj for k in f.keys):
            return f.name
    return None


def _str(obj: dict, key: str, *, empty_ok: bool = False) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise ValueError(f"'{key}' must be a string, got {type(v).__name__}")
    if not empty_ok and not v.strip():
        raise ValueError(f"'{key}' is empty")
    return v


def _messages(raw: Any, what: str, *, sharegpt: bool = False) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"'{what}' must be a non-empty list of messages")
    rk, ck = ("from", "value") if sharegpt else ("role", "content")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ValueError(f"{what}[{i}] must be an object, got {type(m).__name__}")
        role = m.get(rk)
        if sharegpt:
            if role not in _SHAREGPT_ROLES:
                raise ValueError(
                    f"{what}[{i}]: unknown role {role!r}; sharegpt roles are {', '.join(_SHAREGPT_ROLES)}"
                )
            role = _SHAREGPT_ROLES[role]
        elif role not in ROLES:
            raise ValueError(f"{what}[{i}]: unknown role {role!r}; roles are {', '.join(ROLES)}")
        calls = None if sharegpt or role != "assistant" else _tool_calls(m.get("tool_calls"), f"{what}[{i}]")
        content = m.get(ck)
        if content is None and calls:
            content = ""  # OpenAI's tool-call turn: the template renders the calls
        if not isinstance(content, str):
            raise ValueError(f"{what}[{i}] ({role}): '{ck}' must be a string, got {type(content).__name__}")
        if not content.strip() and role != "system" and not calls:  # an empty system prompt is rendered
            raise ValueError(f"{what}[{i}] ({role}) has empty content")
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if not sharegpt and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def _tool_calls(raw: Any, what: str) -> list[dict] | None:
    """An assistant message's OpenAI ``tool_calls`` (``[{"type": "function", "function": {"name": ...,
    "arguments": ...}}]``), checked; None when absent or empty."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"{what}: 'tool_calls' must be a list, got {type(raw).__name__}")
    for j, call in enumerate(raw):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise ValueError(
                f"{what}: tool_calls[{j}] must be an object with a 'function' holding a 'name' (OpenAI's "
                'form: {"type": "function", "function": {"name": "...", "arguments": {...}}})'
            )
    return raw


def _facts(obj: dict) -> list[str]:
    raw = obj.get("facts")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"'facts' must be a list, got {type(raw).__name__}")
    out = []
    for j, f in enumerate(raw):
        v = f.get("value") if isinstance(f, dict) else f
        if not isinstance(v, str) or not v:
            raise ValueError(f"facts[{j}] must be a non-empty string or an object with a 'value' string")
        out.append(v)
    return out


def _need_assistant(msgs: list[dict[str, str]], what: str) -> None:
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"'{what}' has no assistant turn: nothing to train on")


def _need_prompt_first(msgs: list[dict[str, str]], what: str) -> None:
    if msgs[0]["role"] == "assistant":
        raise ValueError(
            f"'{what}' starts with an assistant turn: nothing before it prompts it (a chat template renders "
            "no prompt for it); start the conversation with a system or user turn, or drop that turn"
        )


def _chat(key: str, sharegpt: bool) -> Callable[[dict, dict], Item]:
    def normalise(obj: dict, base: dict) -> Item:
        msgs = _messages(obj[key], key, sharegpt=sharegpt)
        _need_assistant(msgs, key)
        _need_prompt_first(msgs, key)
        return Item(**base, kind="chat", messages=msgs, facts=_facts(obj))

    return normalise


def _prompt_completion(obj: dict, base: dict) -> Item:
    p, c = obj["prompt"], obj["completion"]
    facts = _facts(obj)
    if isinstance(p, str) and isinstance(c, str):
        return Item(
            **base,
            kind="plain",
            prompt=_str(obj, "prompt", empty_ok=True),
            completion=_str(obj, "completion"),
            facts=facts,
        )
    if isinstance(p, list) and isinstance(c, list):
        pm, cm = _messages(p, "prompt"), _messages(c, "completion")
        _need_assistant(cm, "completion")
        _need_prompt_first(pm, "prompt")
        return Item(**base, kind="chat", messages=pm + cm, n_prompt=len(pm), facts=facts)
    raise ValueError(
        "'prompt' and 'completion' must both be strings or both be message lists, got "
        f"{type(p).__name__} and {type(c).__name__}"
    )


def _alpaca(obj: dict, base: dict) -> Item:
    facts = _facts(obj)
    user = _str(obj, "instruction")
    extra = obj.get("input") or ""
    if not isinstance(extra, str):
        raise ValueError(f"'input' must be a string, got {type(extra).__name__}")
    if extra.strip():
        user = f"{user}\n\n{extra}"
    msgs: list[dict[str, str]] = []
    if obj.get("system"):
        msgs.append({"role": "system", "content": _str(obj, "system")})
    for j, turn in enumerate(obj.get("history") or []):
        if not (
            isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) and t.strip() for t in turn)
        ):
            raise ValueError(f"history[{j}] must be a [question, answer] pair of non-empty strings")
        msgs += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    n_prompt = len(msgs) + 1
    msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": _str(obj, "output")}]
    return Item(**base, kind="chat", messages=msgs, n_prompt=n_prompt, facts=facts)


def _text(obj: dict, base: dict) -> Item:
    return Item(**base, kind="text", text=_str(obj, "text"), facts=_facts(obj))


def _document(obj: dict, base: dict) -> Item:
    return Item(**base, kind="document", doc=normalize_document(obj, default_id=base["id"]))


@dataclass(frozen=True)
class Format:
    """One row of the format table: everything the pipeline knows about a record format.

    ``keys``: the fields that identify it (all present; rows are tried in table order); ``normalise``:
    ``(record, base) -> Item`` (``base``: ``where``, ``id``, ``format``), raising ``ValueError`` naming the
    field; ``train_on``: the ``data.train_on`` values that apply, the first its default (``()``: the target
    section of a document is trained); ``kinds``: the builders its items go to (``chat``: the chat template,
    ``plain``: prompt + completion strings, ``text``: text + EOS, all :mod:`vramsweep.data.render`;
    ``document``: sections, :mod:`vramsweep.data.examples`); ``example``: one record, for the docs."""

    name: str
    keys: tuple[str, ...]
    normalise: Callable[[dict, dict], Item]
    train_on: tuple[str, ...]
    kinds: tuple[str, ...]
    example: str


_CHAT_TRAIN_ON = ("assistant", "last_assistant", "all")
#: The format table, in detection order: adding a format is one row here (and its tests).
FORMAT_TABLE: tuple[Format, ...] = (
    Format(
        "messages",
        ("messages",),
        _chat("messages", False),
        _CHAT_TRAIN_ON,
        ("chat",),
        '{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}',
    ),
    Format(
        "sharegpt",
        ("conversations",),
        _chat("conversations", True),
        _CHAT_TRAIN_ON,
        ("chat",),
        '{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."}]}',
    ),
    Format(
        "prompt_completion",
        ("prompt", "completion"),
        _prompt_completion,
        ("completion", "all"),
        ("plain", "chat"),
        '{"prompt": "2+2=", "completion": "4"}',
    ),
    Format(
        "alpaca",
        ("instruction", "output"),
        _alpaca,
        ("completion", "all"),
        ("chat",),
        '{"instruction": "Add.", "input": "2+2", "output": "4"}',
    ),
    Format(
        "documents",
        ("sections",),
        _document,
        (),
        ("document",),
        '{"id": "d1", "sections": [{"heading": "Aim", "text": "..."}, {"text": "..."}]}',
    ),
    Format("text", ("text",), _text, ("all",), ("text",), '{"text": "Two and two make four."}'),
)


def format_row(name: str) -> Format:
    """The table's row of format ``name`` (KeyError when there is none)."""
    for f in FORMAT_TABLE:
        if f.name == name:
            return f
    raise KeyError(name)


def formats() -> tuple[str, ...]:
    """The format names, in table order (``data.format`` takes these or ``auto``)."""
    return tuple(f.name for f in FORMAT_TABLE)


def accepted() -> str:
    """``messages ('messages'), ..., prompt_completion ('prompt' + 'completion'), ...`` for errors."""
    return ", ".join(f"{f.name} ({' + '.join(repr(k) for k in f.keys)})" for f in FORMAT_TABLE)


def _item(rec: Record, fmt: str) -> Item:
    obj = rec.obj
    rid = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else rec.where
    return format_row(fmt).normalise(obj, dict(where=rec.where, id=rid, format=fmt))


def normalize_records(records: Sequence[Record], fmt: str = "auto") -> list[Item]:
    """Detect (``fmt="auto"``) or check the format of every record and normalise it.

    Raises:
        ValueError: ``"<where>: <problem>"``: an unknown format (naming the keys found and the formats
            accepted), a record of another format than the first one, or a field problem.
    """
    if fmt != "auto" and fmt not in formats():
        raise ValueError(f"data.format={fmt!r} is unknown; use auto or one of {', '.join(formats())}")
    out: list[Item] = []
    first: tuple[str, str] | None = None
    for rec in records:
        if not isinstance(rec.obj, dict):
            raise ValueError(f"{rec.where}: expected a JSON object, got {type(rec.obj).__name__}")
        found = detect_format(rec.obj)
        if fmt != "auto":
            keys = format_row(fmt).keys
            missing = [k for k in keys if k not in rec.obj]
            if missing:
                what = "column(s)" if ":row " in rec.where else "field(s)"
                raise ValueError(
                    f"{rec.where}: data.format={fmt} needs the {what} {missing}, missing here; the record "
                    f"has {sorted(rec.obj)}"
                )
            found = fmt
        if found is None:
            raise ValueError(
                f"{rec.where}: unknown format: keys found {sorted(rec.obj)}; accepted formats: {accepted()}"
            )
        if first is None:
            first = (found, rec.where)
        elif found != first[0]:
            raise ValueError(
                f"{rec.where}: this record is in format {found!r} but {first[1]} is {first[0]!r}: one file "
                "holds one format (set data.format to check it)"
            )
        try:
            out.append(_item(rec, found))
        except ValueError as e:
            raise ValueError(f"{rec.where}: {e}") from None
    return out


#: The format names (:func:`formats` at import; ``data.format`` takes these or ``auto``).
FORMATS: tuple[str, ...] = formats()
