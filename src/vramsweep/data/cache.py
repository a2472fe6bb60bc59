"""Tokenise once per sweep: a content-addressed cache of built train/eval examples.

The key is the sha256 of everything the examples depend on: the source files' sha256, the tokenizer (its
``tokenizer.json`` serialisation, special tokens and chat template), the data and context settings and
:data:`CACHE_VERSION`. Entries live in ``<cache>/data/<key>.pkl`` (``$VRAMSWEEP_CACHE``). A file lock
per key makes concurrent trials (sweep workers, the fork server's children) wait for the one that builds;
the entry is written through the one atomic writer (``record/atomic.py``: temp file, fsync, rename), so a
reader never sees half a file, and a corrupt or unreadable entry is rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vramsweep.record.atomic import atomic_write_bytes

__all__ = [
    "CACHE_ENV",
    "CACHE_VERSION",
    "cache_path",
    "cache_root",
    "cached",
    "data_cache_dir",
    "tokenizer_fingerprint",
]

#: Bump when rendering, masking or truncation changes what a key's examples are, or when a pickled class
#: moves (2: ``TrialData`` moved from ``vramsweep.data_prep`` to ``vramsweep.data.prep``; an entry of
#: version 1 names the old module, so a new key keeps the two versions' entries apart in a shared cache;
#: 3: spans end through the end-of-turn token after trailing whitespace, straddling tokens are trained).
CACHE_VERSION = 3
T = TypeVar("T")


CACHE_ENV = "VRAMSWEEP_CACHE"


def cache_path() -> Path:
    """Where the cache is (``$VRAMSWEEP_CACHE`` or ``~/.cache/vramsweep``), without creating it."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vramsweep"


def cache_root() -> Path:
    """Local cache for built artefacts (embedded model, arch weights): ``VRAMSWEEP_CACHE`` or ~/.cache."""
    root = cache_path()
    root.mkdir(parents=True, exist_ok=True)
    return root


def data_cache_dir() -> Path:
    """``<cache>/data`` (created)."""
    d = cache_root() / "data"
    d.mkdir(parents=True, exist_ok=True)
    return d


def tokenizer_fingerprint(tok: Any) -> str:
    """sha256 of what a tokenizer's ids depend on: vocabulary/merges/normaliser, specials, chat template."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    specials = {k: str(v) for k, v in (getattr(tok, "special_tokens_map", {}) or {}).items()}
    h.update(json.dumps(specials, sort_keys=True).encode())
    h.update(str(getattr(tok, "chat_template", None)).encode())
    return h.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    """sha256 of ``parts`` (JSON, sorted keys) and :data:`CACHE_VERSION`."""
    blob = json.dumps({"v": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached(
    parts: dict[str, Any], build: Callable[[], T], *, folder: Path | None = None
) -> tuple[T, str, str]:
    """``build()``'s value, from the cache when an entry for ``parts`` exists.

    Returns:
        (value, ``"hit"`` or ``"miss"``, key).
    """
    key = cache_key(parts)
    d = folder if folder is not None else cache_path() / "data"
    created = [q for q in (d, *d.parents) if not q.exists()]
    path = d / f"{key}.pkl"

    def load() -> Any:
        try:
            with open(path, "rb") as fh:
                return pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError):
            return None

    if path.exists():
        got = load()
        if got is not None:
            return got, "hit", key
    d.mkdir(parents=True, exist_ok=True)
    lock_path = d / f".{key}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():  # another worker built it while this one waited
                got = load()
                if got is not None:
                    return got, "hit", key
            try:
                value = build()
            except BaseException:  # bad input: leave nothing behind (the pre-flight writes nothing)
                lock_path.unlink(missing_ok=True)
                for q in created:  # innermost first
                    try:
                        q.rmdir()
                    except OSError:
                        break
                raise
            atomic_write_bytes(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            return value, "miss", key
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
