"""Exact vocabulary slicing (``vocab=sliced``): keep only the token ids a corpus needs.

Slicing removes rows from the input embedding and the lm_head (one matrix when they are tied), which saves
``(V - V') * hidden * bytes`` of parameters per matrix and shrinks every logits tensor from ``V`` to ``V'``
columns. It is *exact*: kept rows are copied bit for bit, so on text made of kept tokens the sliced model's
logits equal the original's restricted to the kept ids, and its softmax is the original's renormalised over
them.

Pieces:

* :func:`kept_ids` chooses the ids (``corpus``: every id the training texts use, plus specials, plus a
  ``reserve``; ``top_k``: the K most frequent, plus specials, plus a ``reserve``).
* :class:`IdMap` maps old ids <-> new ids (``-1`` = dropped) and refuses, by default, to encode an id
  outside the kept set (``fallback="unk"`` maps it to the kept UNK token instead). Never silent.
* :func:`slice_model_and_tokenizer` slices the model in place and wraps the tokenizer.
* :class:`SlicedTokenizer` is the tokenizer that emits *new* ids.
* :func:`save_sliced` / :func:`load_sliced` export and reload model + tokenizer + id map.

Why wrap the tokenizer instead of rebuilding the BPE vocabulary: a BPE tokenizer reaches a kept token
through a chain of merges whose intermediate tokens may have been dropped, so a rebuilt vocab/merges pair is
either not closed (the tokenizer emits ids the model no longer has) or segments text differently from the
original (and the logits are no longer comparable). Wrapping keeps the original segmentation exactly, maps
ids through one lookup table, and makes tokens outside the kept set an explicit error (or an explicit UNK
fallback). The cost: :class:`SlicedTokenizer` is not a ``PreTrainedTokenizerBase`` subclass, so HF tools
that type-check the tokenizer need the wrapped ``base`` plus :class:`IdMap` instead. The exported folder puts
the original tokenizer under ``base_tokenizer/`` and a ``tokenizer_config.json`` naming a class that does not
exist, so ``AutoTokenizer.from_pretrained(<export>)`` fails loudly instead of returning a tokenizer with the
wrong ids; use :func:`load_sliced` / :meth:`SlicedTokenizer.from_pretrained`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.record.atomic import atomic_write_text

__all__ = [
    "IdMap",
    "SlicedTokenizer",
    "embedding_bytes_saved",
    "kept_ids",
    "load_sliced",
    "parameter_bytes",
    "remap_examples",
    "save_sliced",
    "slice_model_and_tokenizer",
]

ID_MAP_FILE = "id_map.json"
SLICED_TOKENIZER_FILE = "sliced_tokenizer.json"
BASE_TOKENIZER_DIR = "base_tokenizer"
FALLBACKS = ("error", "unk")
_CONFIG_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


# ------------------------------------------------------------------------------------------------ kept ids
def special_ids(tokenizer: Any) -> set[int]:
    """Ids that slicing always keeps: the tokenizer's special tokens and its added special tokens."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def kept_ids(
    tokenizer: Any,
    texts_or_token_lists: Iterable[str | Sequence[int]],
    *,
    mode: str = "corpus",
    top_k: int = 0,
    reserve: int = 0,
) -> list[int]:
    """The sorted token ids to keep when slicing ``tokenizer``'s vocabulary.

    Ids are ranked by (frequency in ``texts_or_token_lists`` descending, id ascending); for byte-level BPE the
    id order is the merge order, i.e. roughly the tokenizer's own training frequency, so unused ids are
    ranked by how common they were when the tokenizer was built.

    Args:
        tokenizer: the original tokenizer (``len(tokenizer)`` ids, special tokens from it).
        texts_or_token_lists: training texts (tokenised without special tokens) or token id lists.
        mode: ``corpus`` = every id used + specials + ``reserve`` more by rank; ``top_k`` = the ``top_k``
            highest-ranked non-special ids + specials + ``reserve`` more; ``full`` = every id.
        top_k: K for ``mode="top_k"`` (> 0).
        reserve: extra ids kept beyond the above, by rank (>= 0).

    Raises:
        ValueError: unknown mode, bad ``top_k``/``reserve``, or a token id outside ``[0, len(tokenizer))``.
    """
    if mode not in ("corpus", "top_k", "full"):
        raise ValueError(f"vocab.mode must be one of corpus, top_k, full; got {mode!r}")
    if reserve < 0:
        raise ValueError(f"vocab.reserve must be >= 0, got {reserve}")
    if mode == "top_k" and top_k <= 0:
        raise ValueError(f"vocab.mode=top_k needs vocab.top_k > 0, got {top_k}")
    vocab = len(tokenizer)
    if mode == "full":
        return list(range(vocab))
    counts: Counter[int] = Counter()
    batch: list[str] = []

    def flush() -> None:
        if batch:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                counts.update(int(t) for t in ids)
            batch.clear()

    for item in texts_or_token_lists:
        if isinstance(item, str):
            batch.append(item)
            if len(batch) >= 256:
                flush()
        else:
            ids = item.tolist() if isinstance(item, torch.Tensor) else item
            counts.update(int(t) for t in ids)
    flush()
    bad = sorted(t for t in counts if not 0 <= t < vocab)
    if bad:
        raise ValueError(f"token ids outside the tokenizer's vocabulary [0, {vocab}): {bad[:10]}")
    specials = {i for i in special_ids(tokenizer) if 0 <= i < vocab}
    ranking = sorted(range(vocab), key=lambda i: (-counts.get(i, 0), i))
    keep = set(counts) | specials if mode == "corpus" else set(specials)
    if mode == "top_k":
        _add_by_rank(keep, ranking, top_k)
    _add_by_rank(keep, ranking, reserve)
    return sorted(keep)


def _add_by_rank(keep: set[int], ranking: Iterable[int], count: int) -> None:
    """Add the first ``count`` ids of ``ranking`` not already in ``keep`` to ``keep``."""
    for i in ranking:
        if count == 0:
            break
        if i not in keep:
            keep.add(i)
            count -= 1


# ------------------------------------------------------------------------------------------------ id map
class IdMap:
    """Old <-> new token ids after slicing.

    Attributes:
        new_to_old: ``LongTensor [V']``, the old id of each new id (sorted ascending).
        old_to_new: ``LongTensor [V]``, the new id of each old id, ``-1`` when dropped.
        unk_id: the *new* id used by ``fallback="unk"`` (None when UNK was not kept).
    """

    def __init__(self, new_to_old: Sequence[int], old_vocab_size: int, unk_id: int | None = None) -> None:
        keep = [int(i) for i in new_to_old]
        if not keep:
            raise ValueError("an IdMap needs at least one kept id")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError("kept ids must be sorted ascending without duplicates")
        if keep[0] < 0 or keep[-1] >= old_vocab_size:
            raise ValueError(f"kept ids must lie in [0, {old_vocab_size}), got {keep[0]}..{keep[-1]}")
        if unk_id is not None and not 0 <= unk_id < len(keep):
            raise ValueError(f"unk_id {unk_id} is not a new id (0..{len(keep) - 1})")
        self.new_to_old = torch.tensor(keep, dtype=torch.long)
        self.old_to_new = torch.full((int(old_vocab_size),), -1, dtype=torch.long)
        self.old_to_new[self.new_to_old] = torch.arange(len(keep), dtype=torch.long)
        self.unk_id = unk_id

    @property
    def old_vocab_size(self) -> int:
        return int(self.old_to_new.numel())

    @property
    def new_vocab_size(self) -> int:
        return int(self.new_to_old.numel())

    def __len__(self) -> int:
        return self.new_vocab_size

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, IdMap)
            and torch.equal(self.new_to_old, other.new_to_old)
            and self.old_vocab_size == other.old_vocab_size
            and self.unk_id == other.unk_id
        )

    def __repr__(self) -> str:
        return f"IdMap(old={self.old_vocab_size}, new={self.new_vocab_size}, unk_id={self.unk_id})"

    def encode(
        self,
        old_ids: Sequence[int] | torch.Tensor,
        fallback: str = "error",
        id_to_token: Callable[[int], str] | None = None,
    ) -> list[int] | torch.Tensor:
        """Map old ids to new ids (a list gives a list, a tensor a tensor of the same shape).

        Args:
            old_ids: ids of the original vocabulary.
            fallback: ``error`` raises on an id outside the kept set; ``unk`` maps it to :attr:`unk_id`.
            id_to_token: names ids in the error message (e.g. ``tokenizer.convert_ids_to_tokens``).

        Raises:
            ValueError: an id is outside the kept set (``fallback="error"``) or outside the old vocabulary,
                naming the offending token(s); ``fallback="unk"`` without a kept UNK token.
        """
        if fallback not in FALLBACKS:
            raise ValueError(f"vocab.fallback must be one of {FALLBACKS}, got {fallback!r}")
        is_tensor = isinstance(old_ids, torch.Tensor)
        t = old_ids.to("cpu", torch.long) if is_tensor else torch.as_tensor(list(old_ids), dtype=torch.long)
        out_of_range = (t < 0) | (t >= self.old_vocab_size)
        if bool(out_of_range.any()):
            bad = sorted({int(i) for i in t[out_of_range].tolist()})
            raise ValueError(
                f"token id(s) {bad[:10]} are outside the original vocabulary [0, {self.old_vocab_size})"
            )
        new = self.old_to_new[t] if t.numel() else t.clone()
        dropped = new < 0
        if bool(dropped.any()):
            if fallback == "unk":
                if self.unk_id is None:
                    raise ValueError(
                        "vocab.fallback=unk needs the UNK token among the kept ids; it was dropped"
                    )
                new = torch.where(dropped, torch.full_like(new, self.unk_id), new)
            else:
                bad = sorted({int(i) for i in t[dropped].tolist()})
                names = ", ".join(
                    f"{id_to_token(i)!r} (id {i})" if id_to_token is not None else f"id {i}" for i in bad[:10]
                )
                more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
                raise ValueError(
                    f"{len(bad)} token(s) outside the sliced vocabulary: {names}{more}. Keep them with "
                    f"vocab.reserve / vocab.top_k / vocab.mode=corpus on this text, or set vocab.fallback=unk"
                )
        if is_tensor:
            return new.to(old_ids.device)
        return [int(i) for i in new.tolist()]

    def decode(self, new_ids: Sequence[int] | torch.Tensor) -> list[int] | torch.Tensor:
        """Map new ids back to old ids (raises ``ValueError`` on an id outside ``[0, V')``)."""
        is_tensor = isinstance(new_ids, torch.Tensor)
        t = new_ids.to("cpu", torch.long) if is_tensor else torch.as_tensor(list(new_ids), dtype=torch.long)
        bad = (t < 0) | (t >= self.new_vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"new token id(s) {sorted(set(t[bad].tolist()))[:10]} outside [0, {self.new_vocab_size})"
            )
        old = self.new_to_old[t] if t.numel() else t.clone()
        return old.to(new_ids.device) if is_tensor else [int(i) for i in old.tolist()]

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``<directory>/id_map.json``; returns its path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / ID_MAP_FILE
        payload = {
            "format": "vramsweep.id_map",
            "version": 1,
            "old_vocab_size": self.old_vocab_size,
            "unk_id": self.unk_id,
            "new_to_old": self.new_to_old.tolist(),
        }
        return atomic_write_text(path, json.dumps(payload, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> IdMap:
        """Read ``<directory>/id_map.json`` written by :meth:`save`."""
        path = Path(directory) / ID_MAP_FILE
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != "vramsweep.id_map":
            raise ValueError(f"{path} is not a vramsweep id map")
        return cls(data["new_to_old"], int(data["old_vocab_size"]), data.get("unk_id"))


# ------------------------------------------------------------------------------------------------ tokenizer
class SlicedTokenizer:
    """A tokenizer that emits the sliced model's ids: the original tokenizer followed by :class:`IdMap`.

    Segmentation is exactly the original's. Tokens outside the kept set raise ``ValueError`` naming them
    (``fallback="error"``) or become UNK (``fallback="unk"``).
    """

    def __init__(self, base: Any, id_map: IdMap, fallback: str = "error") -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"vocab.fallback must be one of {FALLBACKS}, got {fallback!r}")
        if fallback == "unk" and id_map.unk_id is None:
            raise ValueError(
                "vocab.fallback=unk needs a kept UNK token; the tokenizer has none (or it was dropped)"
            )
        if len(base) > id_map.old_vocab_size:
            raise ValueError(
                f"the id map covers {id_map.old_vocab_size} ids but the tokenizer has {len(base)}"
            )
        self.base = base
        self.id_map = id_map
        self.fallback = fallback

    # -- sizes and special tokens (strings from the base, ids in the new numbering)
    def __len__(self) -> int:
        return self.id_map.new_vocab_size

    @property
    def vocab_size(self) -> int:
        return self.id_map.new_vocab_size

    def _new_id(self, old: int | None) -> int | None:
        if old is None:
            return None
        new = int(self.id_map.old_to_new[int(old)])
        return new if new >= 0 else None

    pad_token_id = property(lambda self: self._new_id(self.base.pad_token_id))
    eos_token_id = property(lambda self: self._new_id(self.base.eos_token_id))
    bos_token_id = property(lambda self: self._new_id(self.base.bos_token_id))
    unk_token_id = property(lambda self: self._new_id(self.base.unk_token_id))
    sep_token_id = property(lambda self: self._new_id(getattr(self.base, "sep_token_id", None)))
    pad_token = property(lambda self: self.base.pad_token)
    eos_token = property(lambda self: self.base.eos_token)
    bos_token = property(lambda self: self.base.bos_token)
    unk_token = property(lambda self: self.base.unk_token)
    sep_token = property(lambda self: getattr(self.base, "sep_token", None))
    padding_side = property(lambda self: self.base.padding_side)
    model_max_length = property(lambda self: self.base.model_max_length)

    @property
    def all_special_ids(self) -> list[int]:
        return [n for n in (self._new_id(i) for i in self.base.all_special_ids) if n is not None]

    # -- encoding / decoding
    def _to_new(self, ids: Any) -> Any:
        return self.id_map.encode(ids, self.fallback, id_to_token=self.base.convert_ids_to_tokens)

    def __call__(
        self, text: str | list[str], *args: Any, return_tensors: str | None = None, **kwargs: Any
    ) -> Any:
        """Like the base tokenizer's ``__call__`` (same arguments), with ``input_ids`` in new ids."""
        from transformers import BatchEncoding

        enc = self.base(text, *args, **kwargs)
        data = dict(enc)
        ids = data["input_ids"]
        batched = bool(ids) and isinstance(ids[0], (list, tuple))
        data["input_ids"] = [self._to_new(row) for row in ids] if batched else self._to_new(ids)
        # A single text with return_tensors gets a batch axis, as with HF tokenizers.
        return BatchEncoding(
            data, tensor_type=return_tensors, prepend_batch_axis=not batched and return_tensors is not None
        )

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """New ids of ``text`` (see the base tokenizer's ``encode``)."""
        return self._to_new(self.base.encode(text, add_special_tokens=add_special_tokens, **kwargs))

    def decode(self, ids: Sequence[int] | torch.Tensor, **kwargs: Any) -> str:
        """Text of new ids (keyword arguments as the base tokenizer's ``decode``)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return self.base.decode(self.id_map.decode(ids), **kwargs)

    def batch_decode(self, sequences: Sequence[Sequence[int]] | torch.Tensor, **kwargs: Any) -> list[str]:
        return [self.decode(s, **kwargs) for s in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.base.convert_ids_to_tokens(int(self.id_map.new_to_old[ids]))
        return self.base.convert_ids_to_tokens(self.id_map.decode(ids))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._to_new([self.base.convert_tokens_to_ids(tokens)])[0]
        return self._to_new(self.base.convert_tokens_to_ids(list(tokens)))

    # -- persistence
    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``base_tokenizer/``, ``id_map.json``, ``sliced_tokenizer.json`` and a guard
        ``tokenizer_config.json`` (see the module docstring) under ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.base.save_pretrained(str(d / BASE_TOKENIZER_DIR))
        self.id_map.save(d)
        # Without this, AutoTokenizer.from_pretrained(d) builds an *empty* tokenizer from config.json's model
        # type (silently wrong ids); an unknown class makes it fail instead.
        (d / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "VramsweepSlicedTokenizer",
                    "vramsweep_note": "sliced vocabulary: load with "
                    "vramsweep.knobs.vocab_slice.SlicedTokenizer.from_pretrained(<this folder>)",
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        (d / SLICED_TOKENIZER_FILE).write_text(
            json.dumps(
                {
                    "format": "vramsweep.sliced_tokenizer",
                    "version": 1,
                    "base": BASE_TOKENIZER_DIR,
                    "id_map": ID_MAP_FILE,
                    "fallback": self.fallback,
                    "vocab_size": self.vocab_size,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        return d

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike[str], fallback: str | None = None
    ) -> SlicedTokenizer:
        """Load what :meth:`save_pretrained` wrote (``fallback`` overrides the saved one)."""
        from transformers import AutoTokenizer

        d = Path(directory)
        meta_path = d / SLICED_TOKENIZER_FILE
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} not found: {d} is not a sliced tokenizer folder")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        base = AutoTokenizer.from_pretrained(str(d / meta.get("base", BASE_TOKENIZER_DIR)))
        id_map = IdMap.load(d)
        return cls(base, id_map, fallback=fallback or meta.get("fallback", "error"))


# ------------------------------------------------------------------------------------------------ model
def _remap_token_field(value: Any, id_map: IdMap, name: str) -> Any:
    if value is None:
        return None
    many = isinstance(value, (list, tuple))
    olds = list(value) if many else [value]
    news = []
    for old in olds:
        old = int(old)
        new = int(id_map.old_to_new[old]) if 0 <= old < id_map.old_vocab_size else -1
        if new < 0:
            raise ValueError(
                f"{name}={old} is not among the kept ids; keep every special token the config uses"
            )
        news.append(new)
    return news if many else news[0]


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each shared tensor counted once (tied weights count once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def embedding_bytes_saved(
    old_vocab: int, new_vocab: int, hidden: int, bytes_per_param: int, tied: bool
) -> int:
    """Parameter bytes slicing saves: ``(V - V') * h * bytes``, twice when embedding and lm_head are
    untied."""
    return (old_vocab - new_vocab) * hidden * bytes_per_param * (1 if tied else 2)


def slice_model_and_tokenizer(
    model: nn.Module, tokenizer: Any, keep: Sequence[int]
) -> tuple[nn.Module, Any, IdMap]:
    """Keep only the rows ``keep`` of the input embedding and the lm_head, in place.

    Tied weights stay tied (one sliced matrix shared by both); untied ones are both sliced; an lm_head bias
    is sliced too. ``config.vocab_size`` (also of the text sub-config), the config's and generation config's
    bos/eos/pad/decoder-start ids, the embedding's ``padding_idx`` and modules' ``vocab_size`` attributes
    are updated. Everything is validated before anything changes.

    Args:
        model: a causal LM (``get_input_embeddings``/``get_output_embeddings``), before adapters are added.
        tokenizer: the original tokenizer (None allowed: then None is returned for it).
        keep: sorted unique old ids, e.g. from :func:`kept_ids`.

    Returns:
        ``(model, SlicedTokenizer | None, IdMap)``; the model is the same object, sliced.

    Raises:
        ValueError: ``keep`` not sorted/unique/in range, or a special id used by the config is not kept.
        TypeError: the embedding or lm_head is not a plain ``nn.Embedding`` / ``nn.Linear``.
    """
    emb, head, old_vocab = _sliceable(model, tokenizer)
    unk_new = None
    id_map = IdMap(keep, old_vocab)
    if tokenizer is not None and getattr(tokenizer, "unk_token_id", None) is not None:
        u = int(id_map.old_to_new[int(tokenizer.unk_token_id)])
        unk_new = u if u >= 0 else None
    id_map.unk_id = unk_new
    configs = list({id(c): c for c in _configs(model)}.values())
    updates: list[tuple[Any, str, Any]] = []
    for cfg in configs:
        for name in _CONFIG_TOKEN_FIELDS:
            if hasattr(cfg, name) and getattr(cfg, name) is not None:
                updates.append((cfg, name, _remap_token_field(getattr(cfg, name), id_map, name)))
    tied = head is not None and (head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr())

    new_vocab = id_map.new_vocab_size
    _slice_rows(emb, head, id_map, tied)
    for cfg, name, value in updates:
        setattr(cfg, name, value)
    for cfg in configs:
        if hasattr(cfg, "vocab_size") and getattr(cfg, "vocab_size", None) == old_vocab:
            cfg.vocab_size = new_vocab
    for mod in model.modules():
        if isinstance(getattr(mod, "vocab_size", None), int) and mod.vocab_size == old_vocab:
            mod.vocab_size = new_vocab
    sliced_tok = SlicedTokenizer(tokenizer, id_map) if tokenizer is not None else None
    return model, sliced_tok, id_map


def _sliceable(model: nn.Module, tokenizer: Any) -> tuple[nn.Embedding, nn.Linear | None, int]:
    """The model's input embedding, its lm_head (or None) and its vocabulary size, checked for slicing: an
    ``nn.Embedding``, an ``nn.Linear`` with as many rows, and no more tokenizer ids than rows."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise TypeError(f"vocab slicing needs an nn.Embedding input embedding, got {type(emb).__name__}")
    if head is not None and not isinstance(head, nn.Linear):
        raise TypeError(f"vocab slicing needs an nn.Linear lm_head, got {type(head).__name__}")
    old_vocab = int(emb.weight.shape[0])
    if head is not None and int(head.weight.shape[0]) != old_vocab:
        raise ValueError(f"embedding has {old_vocab} rows but lm_head has {head.weight.shape[0]}")
    if tokenizer is not None and len(tokenizer) > old_vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids but the model only {old_vocab} embedding rows")
    return emb, head, old_vocab


def _slice_rows(emb: nn.Embedding, head: nn.Linear | None, id_map: IdMap, tied: bool) -> None:
    """Keep ``id_map``'s rows of the embedding (and its ``padding_idx``, None when not kept) and of the
    lm_head's weight (the embedding's when ``tied``) and bias, in place."""
    new_vocab = id_map.new_vocab_size
    with torch.no_grad():
        idx = id_map.new_to_old.to(emb.weight.device)
        emb.weight = nn.Parameter(
            emb.weight.detach().index_select(0, idx).clone(), requires_grad=emb.weight.requires_grad
        )
        emb.num_embeddings = new_vocab
        if emb.padding_idx is not None:
            p = int(id_map.old_to_new[emb.padding_idx])
            emb.padding_idx = p if p >= 0 else None
        if head is not None:
            if tied:
                head.weight = emb.weight
            else:
                hidx = id_map.new_to_old.to(head.weight.device)
                head.weight = nn.Parameter(
                    head.weight.detach().index_select(0, hidx).clone(),
                    requires_grad=head.weight.requires_grad,
                )
            if head.bias is not None:
                bidx = id_map.new_to_old.to(head.bias.device)
                head.bias = nn.Parameter(
                    head.bias.detach().index_select(0, bidx).clone(), requires_grad=head.bias.requires_grad
                )
            head.out_features = new_vocab


def _configs(model: nn.Module) -> list[Any]:
    """The model's config, its text sub-config and its generation config (those that exist)."""
    out = []
    cfg = getattr(model, "config", None)
    if cfg is not None:
        out.append(cfg)
        get_text = getattr(cfg, "get_text_config", None)
        if callable(get_text):
            out.append(get_text())
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        out.append(gen)
    return out


def remap_examples(
    examples: Sequence[Any],
    id_map: IdMap,
    *,
    fallback: str = "error",
    id_to_token: Callable[[int], str] | None = None,
) -> list[Any]:
    """Training examples (:class:`vramsweep.data.examples.Example`) re-expressed in the sliced ids.

    ``input_ids`` and ``labels`` are mapped through ``id_map`` (labels keep their -100 positions); lengths,
    ``fact_spans`` and the other fields are unchanged. Tokens outside the kept set raise ``ValueError``
    naming them (``fallback="error"``, with the example's document and section) or become UNK (``"unk"``).
    """
    from dataclasses import replace

    out = []
    for e in examples:
        try:
            ids = id_map.encode(e.input_ids, fallback, id_to_token)
        except ValueError as err:
            raise ValueError(f"document {e.doc_id!r} section {e.target_section}: {err}") from None
        labels = [IGNORE_INDEX if lab == IGNORE_INDEX else new for lab, new in zip(e.labels, ids)]
        if any(lab != IGNORE_INDEX and lab != old for lab, old in zip(e.labels, e.input_ids)):
            raise ValueError(
                f"document {e.doc_id!r}: labels must be -100 or equal to input_ids to be remapped"
            )
        out.append(replace(e, input_ids=ids, labels=labels))
    return out


# ------------------------------------------------------------------------------------------------ export
def save_sliced(model: nn.Module, tokenizer: SlicedTokenizer, directory: str | os.PathLike[str]) -> Path:
    """Export a sliced model and its tokenizer + id map to ``directory`` (reload with :func:`load_sliced`).

    Layout: the HF model files (``config.json`` with the sliced ``vocab_size``, weights), ``id_map.json``,
    ``sliced_tokenizer.json`` and the original tokenizer under ``base_tokenizer/``.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    n_rows = int(model.get_input_embeddings().weight.shape[0])
    if n_rows != tokenizer.vocab_size:
        raise ValueError(
            f"model has {n_rows} embedding rows but the sliced tokenizer {tokenizer.vocab_size} ids"
        )
    model.save_pretrained(str(d))
    tokenizer.save_pretrained(d)
    return d


def load_sliced(
    directory: str | os.PathLike[str], *, fallback: str | None = None, **model_kwargs: Any
) -> tuple[nn.Module, SlicedTokenizer]:
    """Reload what :func:`save_sliced` wrote: ``(AutoModelForCausalLM, SlicedTokenizer)``.

    ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``dtype``).
    """
    from transformers import AutoModelForCausalLM

    tok = SlicedTokenizer.from_pretrained(directory, fallback=fallback)
    model = AutoModelForCausalLM.from_pretrained(str(directory), **model_kwargs)
    n_rows = int(model.get_input_embeddings().weight.shape[0])
    if n_rows != tok.vocab_size:
        raise ValueError(
            f"{directory}: model has {n_rows} embedding rows but the id map keeps {tok.vocab_size}"
        )
    return model, tok
