"""One error style for every verb: ``vramsweep <verb>: error: <one line>``.

Library noise (Hydra's config search path, its ``HYDRA_FULL_ERROR`` hint, links to its docs) is cut, and
the message is folded onto one line, so a bad input reads the same whichever layer caught it.
"""

from __future__ import annotations

import re

_NOISE = (
    re.compile(r"\s*Config search path:.*", re.S),
    re.compile(r"\s*Set the environment variable HYDRA_FULL_ERROR=1.*", re.S),
    re.compile(r"\s*See https://hydra\.cc/\S*( for details)?"),
    re.compile(r"\s*Available options in '[\w/]+':.*?(?=$|\s\(allowed:)", re.S),
)


def one_line(msg: str) -> str:
    """``msg`` without library noise, folded onto one line."""
    text = str(msg)
    for pat in _NOISE[:3]:
        text = pat.sub("", text)
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return re.sub(r"\s{2,}", " ", text).strip()


#: Hydra's override lexer (ANTLR) failing on an unquoted value: a space, ``( ) [ ] { } , = ' "`` in a path.
_LEXER = re.compile(
    r"mismatched input|no viable alternative|LexerNoViableAlt|token recognition error|extraneous "
    r"input|missing '.*' at"
)
QUOTE_HINT = (
    "a value with spaces or any of ( ) [ ] { } , = ' \" must be quoted for Hydra: key='my value' "
    "(on the shell: \"key='my value'\")"
)


def error_line(verb: str, msg: str) -> str:
    """``vramsweep <verb>: error: <msg on one line>`` (an ``error:`` prefix already in ``msg`` is dropped).
    A Hydra lexer failure gets the quoting hint (:data:`QUOTE_HINT`)."""
    text = one_line(msg)
    text = re.sub(r"^(vramsweep( \w+)?: )?(error: )?", "", text)
    if _LEXER.search(text) and "must be quoted" not in text:
        text += f"; {QUOTE_HINT}"
    return f"vramsweep {verb}: error: {text}" if verb else f"vramsweep: error: {text}"


class ConfigError(ValueError):
    """A bad override or incompatible combination. ``str()`` names the override and allowed values."""

    def __init__(self, message: str, key: str | None = None, allowed: list | tuple | None = None):
        self.key = key
        self.allowed = list(allowed) if allowed is not None else None
        full = message
        if allowed is not None:
            full += f" (allowed: {', '.join(str(a) for a in allowed)})"
        super().__init__(full)
