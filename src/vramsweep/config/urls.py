"""Storage URLs in messages and for SQLAlchemy: a password masked whole, a bare ``postgresql://`` given the
installed driver. Below both the sweeper (which writes studies) and the report (which reads them)."""

from __future__ import annotations

import re

#: ``scheme://user:`` then the password, up to the *last* ``@``: an unencoded ``@`` in a password is not
#: where it ends (SQLAlchemy's parser stops there and takes the rest for the host).
_URL_SECRET = re.compile(r"(://[^:/@]*:)(.*)@")


def mask_url(url: str) -> str:
    """``postgresql://u:secret@h/db`` -> ``postgresql://u:***@h/db`` (``u:se@cret@h`` too: nothing of it
    shown)."""
    return _URL_SECRET.sub(r"\1***@", url, count=1)


def mask_secret(text: str, url: str) -> str:
    """``text`` (a driver's error about ``url``) without any piece of the URL's password: the whole password,
    and for one with an unencoded ``@`` what a parser took for the host (``could not translate host name
    "cret@h"``) or the password (``se``)."""
    m = _URL_SECRET.search(url)
    secret = m.group(2) if m else ""
    if not secret:
        return text
    text = text.replace(secret, "***")
    parts = secret.split("@")
    for piece in parts[1:]:
        if piece:
            text = text.replace(f"{piece}@", "***@")
    for piece in parts[:-1]:
        if piece:
            text = text.replace(f":{piece}@", ":***@")
    return text


def normalise_storage_url(url: str) -> str:
    """``postgresql://`` -> ``postgresql+psycopg2://`` when only psycopg2 is installed.

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to the psycopg 3 driver; our pinned environment ships
    ``psycopg2-binary``. An explicit driver (``postgresql+psycopg://``) is kept as given.
    """
    import importlib.util

    if (
        url.startswith("postgresql://")
        and importlib.util.find_spec("psycopg") is None
        and importlib.util.find_spec("psycopg2") is not None
    ):
        return "postgresql+psycopg2://" + url[len("postgresql://") :]
    return url
