"""Turn the data config into train/eval examples (documents -> sections -> truncation -> tokens)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig

from vramsweep.data.cache import cached, tokenizer_fingerprint
from vramsweep.data.chatset import generate_chats
from vramsweep.data.formats import normalize_records
from vramsweep.data.load import load_user_data
from vramsweep.data.reference import not_comparable_reason, reference_of, sweep_reference
from vramsweep.data.sources import Record, source_sha256
from vramsweep.data.synthetic import generate_documents

EVAL_SEED_OFFSET = 100_003  # eval documents come from a disjoint seed stream
EVAL_BATCH = 4  # held-out batch size (fixed, so eval does not depend on train.micro_batch)


@dataclass
class TrialData:
    train: list
    eval: list
    pad_id: int
    stats: dict = field(default_factory=dict)


#: ``data.source`` values that read the user's files (``data.path`` / ``data.eval_path``).
USER_SOURCES = ("jsonl", "file")


def load_user(cfg: DictConfig) -> Any:
    """The user's records (:func:`vramsweep.data.load.load_user_data`) for ``data.source=file|jsonl``."""

    d = cfg.data
    return load_user_data(str(d.path), str(d.eval_path) if d.eval_path else None, str(d.format))


def load_documents(cfg: DictConfig) -> tuple[list[dict], list[dict]]:
    """Sectioned documents for training and held-out eval: the embedded synthetic reports, or the user's
    documents file (ValueError when ``data.path`` holds another format)."""
    d = cfg.data
    if d.source == "embedded":
        return (
            generate_documents(int(d.num_docs), int(d.seed)),
            generate_documents(int(d.num_eval_docs), int(d.seed) + EVAL_SEED_OFFSET),
        )
    ud = load_user(cfg)
    if ud.format != "documents":
        raise ValueError(
            f"data.path={d.path}: the records are in format {ud.format!r}, not sectioned documents"
        )
    return [it.doc for it in ud.train], [it.doc for it in ud.eval]


def data_format(cfg: DictConfig) -> str:
    """The format the trial's records are in (reads the user's file for ``data.format=auto``)."""
    d = cfg.data
    if d.source == "embedded":
        return "documents"
    if d.source == "embedded_chat":
        return "messages"
    if str(d.format) != "auto":
        return str(d.format)
    return str(load_user(cfg).format)


def render_settings(cfg: DictConfig, tokenizer: Any, fmt: str) -> Any:
    """:class:`vramsweep.data.render.RenderSettings` from the config; ``data.train_on`` is checked against
    the format (ValueError naming the values that apply)."""
    from vramsweep.data.render import RenderSettings, default_train_on, resolve_template, train_on_choices

    d, c = cfg.data, cfg.context
    train_on = str(d.train_on)
    choices = train_on_choices(fmt)
    if train_on == "auto":
        train_on = default_train_on(fmt)
    elif train_on not in choices:
        raise ValueError(
            f"data.train_on={train_on} does not apply to format {fmt!r}; use auto or one of "
            f"{', '.join(choices)}"
        )
    return RenderSettings(
        train_on=train_on,
        template=resolve_template(d.chat_template, tokenizer),
        enable_thinking=bool(d.enable_thinking),
        max_tokens=int(c.max_tokens),
        truncation=str(c.truncation),
        decay=float(c.decay),
        min_tokens_per_section=int(c.min_tokens_per_section),
        too_long=str(d.get("too_long", "truncate")),
    )


def eval_reference(s: Any, fmt: str, reference: dict | None = None, tokenizer: Any = None) -> Any:
    """The settings the held-out records are rendered and masked under: the trial's, with the format's
    default ``train_on`` and, in a sweep, the baseline's chat template, thinking switch and context length
    (``reference``: :mod:`vramsweep.data.reference`), so every trial of a sweep scores the same held-out
    tokens (docs/DATA.md, "Held-out loss")."""
    from dataclasses import replace

    from vramsweep.data.render import default_train_on, resolve_template

    out = replace(s, train_on=default_train_on(fmt))
    if reference is None:
        return out
    return replace(
        out,
        template=resolve_template(reference["data.chat_template"], tokenizer),
        enable_thinking=bool(reference["data.enable_thinking"]),
        max_tokens=int(reference["context.max_tokens"]),
    )


def _reference_info(ref: Any, names: dict | None, why: str | None) -> dict:
    """``stats["eval_reference"]``: what the held-out records were rendered under (``names``: the
    reference's :data:`~vramsweep.data.reference.REFERENCE_KEYS` values, None for documents, which have no
    template), and whether this trial could score the reference (``comparable``; ``not_comparable``: why
    not)."""
    out: dict[str, Any] = {"train_on": ref.train_on, "max_tokens": ref.max_tokens, "comparable": why is None}
    if names is not None:
        out["chat_template"] = names["data.chat_template"] or "tokenizer"
        out["enable_thinking"] = bool(names["data.enable_thinking"])
    if why is not None:
        out["not_comparable"] = why
    return out


def _scoreable(ev: list, s_max: int, ref_max: int) -> str | None:
    """Why a trial with context ``s_max`` cannot score held-out examples built at ``ref_max``."""
    if ref_max <= s_max or not ev:
        return None
    return not_comparable_reason(max(len(e.input_ids) for e in ev), s_max, ref_max)


def _build_slots(train_items: list, eval_items: list, tokenizer: Any, s: Any, ref: Any) -> dict[str, list]:
    """Each split's example slots (None where ``data.too_long=drop`` left a record out): the held-out records
    under the eval reference ``ref``; one pass over both splits when ``ref`` is the trial's own settings
    (one tokenizer call, and ``truncation=none`` names the longest of all records)."""
    from vramsweep.data.render import build_item_slots

    if ref == s:
        both = build_item_slots([*train_items, *eval_items], tokenizer, s)
        return {"train": both[: len(train_items)], "eval": both[len(train_items) :]}
    return {
        "train": build_item_slots(train_items, tokenizer, s),
        "eval": build_item_slots(eval_items, tokenizer, ref),
    }


def _record_examples(
    cfg: DictConfig, tokenizer: Any, ud: Any = None, reference: dict | None = None
) -> tuple[list, list, dict]:
    """Examples of chat / prompt-completion / alpaca / text records (the user's or the shipped chat set);
    the held-out records under the eval reference (:func:`eval_reference`)."""
    from dataclasses import replace

    from vramsweep.data.render import build_item_slots

    d = cfg.data
    if d.source == "embedded_chat":

        def recs(n: int, seed: int, tag: str) -> list:
            return [Record(f"{tag}:{i + 1}", r) for i, r in enumerate(generate_chats(n, seed))]

        train_items = normalize_records(recs(int(d.num_docs), int(d.seed), "grant_chat"), "messages")
        eval_items = normalize_records(
            recs(int(d.num_eval_docs), int(d.seed) + EVAL_SEED_OFFSET, "grant_chat-eval"), "messages"
        )
        fmt, info = "messages", {"eval_from": "embedded (disjoint seed)"}
    else:
        ud = ud if ud is not None else load_user(cfg)
        train_items, eval_items, fmt = ud.train, ud.eval, ud.format
        info = {"eval_from": ud.eval_from, "source_sha256": ud.sha256}
    s = render_settings(cfg, tokenizer, fmt)
    ref = eval_reference(s, fmt, reference, tokenizer)
    slots = _build_slots(train_items, eval_items, tokenizer, s, ref)
    why = _scoreable([e for e in slots["eval"] if e is not None], s.max_tokens, ref.max_tokens)
    if why is not None:  # this trial cannot score the reference: its own context, marked not comparable
        ref = replace(ref, max_tokens=s.max_tokens)
        slots["eval"] = build_item_slots(eval_items, tokenizer, ref)
    train, ev = ([e for e in v if e is not None] for v in slots.values())
    dropped = {k: sum(1 for e in v if e is None) for k, v in slots.items()}
    for split, n in (("train", len(train_items)), ("eval", len(eval_items))):
        if n and dropped[split] == n:
            raise ValueError(
                f"data.too_long=drop: all {n} {'training' if split == 'train' else 'held-out'} records are "
                f"longer than context.max_tokens={s.max_tokens}, so none is left; use data.too_long=truncate "
                "or a larger context.max_tokens"
            )
    info |= {
        "too_long": s.too_long,
        "dropped": dropped,
        "format": fmt,
        "train_on": s.train_on,
        "eval_train_on": ref.train_on,
        "chat_template": str(d.chat_template) if d.chat_template else "tokenizer",
        "enable_thinking": s.enable_thinking,
        "eval_reference": _reference_info(ref, reference or reference_of(cfg), why),
    }
    return train, ev, info


def _length_distribution(examples: list) -> dict:
    lengths = sorted(len(e.input_ids) for e in examples)
    if not lengths:
        return {}

    def q(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * (len(lengths) - 1) + 0.5))]

    return {"min": lengths[0], "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": lengths[-1]}


def _document_examples(cfg: DictConfig, tokenizer: Any, ud: Any, reference: dict | None) -> tuple:
    """Examples of sectioned documents (the user's or the embedded reports); the held-out documents at the
    reference's context length where this trial can score them (:func:`eval_reference`)."""
    from vramsweep.data.examples import build_examples

    if ud is not None:
        train_docs, eval_docs = [it.doc for it in ud.train], [it.doc for it in ud.eval]
    else:
        train_docs, eval_docs = load_documents(cfg)
    c = cfg.context
    kw = dict(
        max_tokens=int(c.max_tokens),
        truncation=str(c.truncation),
        decay=float(c.decay),
        min_tokens_per_section=int(c.min_tokens_per_section),
        instructions=str(cfg.data.instructions),
    )
    train = build_examples(train_docs, tokenizer, **kw)
    ref_max = int(reference["context.max_tokens"]) if reference is not None else kw["max_tokens"]
    ev = build_examples(eval_docs, tokenizer, **{**kw, "max_tokens": ref_max})
    why = _scoreable(ev, kw["max_tokens"], ref_max)
    if why is not None:
        ev, ref_max = build_examples(eval_docs, tokenizer, **kw), kw["max_tokens"]
    ref = SimpleNamespace(train_on="target section", max_tokens=ref_max)
    info: dict = {"format": "documents", "train_on": "target section", "eval_train_on": "target section"}
    info["eval_from"] = ud.eval_from if ud is not None else "embedded (disjoint seed)"
    info["eval_reference"] = _reference_info(ref, None, why)
    if ud is not None:
        info["source_sha256"] = ud.sha256
    return train, ev, info


def _build(cfg: DictConfig, tokenizer: Any, reference: dict | None = None) -> TrialData:
    from vramsweep.data.examples import TARGET_TOKENS, examples_stats

    ud = load_user(cfg) if cfg.data.source in USER_SOURCES else None  # read the file once
    fmt = ud.format if ud is not None else data_format(cfg)
    if fmt == "documents":
        train, ev, info = _document_examples(cfg, tokenizer, ud, reference)
    else:
        train, ev, info = _record_examples(cfg, tokenizer, ud, reference)
    if not train:
        raise ValueError("the training documents produced no examples (need documents with >= 2 sections)")
    if not ev:
        raise ValueError("the eval documents produced no examples (need documents with >= 2 sections)")
    stats = {"train": examples_stats(train), "eval": examples_stats(ev), **info}
    for split, ex in (("train", train), ("eval", ev)):
        trained = stats[split][TARGET_TOKENS]
        stats[split]["trained_tokens"] = trained
        stats[split]["prompt_tokens"] = stats[split]["total_tokens"] - trained
        stats[split]["length_distribution"] = _length_distribution(ex)
        stats[split]["truncated"] = sum(1 for e in ex if e.truncated)
        stats[split]["dropped"] = int((info.get("dropped") or {}).get(split, 0))
        stats[split]["boundary_merged"] = sum(1 for e in ex if e.boundary_merged)
    stats.pop("dropped", None)
    return TrialData(train=train, eval=ev, pad_id=int(tokenizer.pad_token_id), stats=stats)


def summary_line(stats: dict) -> str:
    """One line of what the records became (the pre-flight prints it): records, tokens, trained tokens,
    truncated, dropped and boundary-merged records, per split."""
    parts = []
    for split in ("train", "eval"):
        st = stats.get(split) or {}
        parts.append(
            f"{split} {st.get('count', 0)} records, {st.get('total_tokens', 0)} tokens "
            f"({st.get('trained_tokens', 0)} trained), truncated {st.get('truncated', 0)}, "
            f"dropped {st.get('dropped', 0)}, boundary-merged {st.get('boundary_merged', 0)}"
        )
    head = f"data: {stats.get('format')}, train_on={stats.get('train_on')}"
    if stats.get("too_long"):
        head += f", too_long={stats['too_long']}"
    return f"{head}: " + "; ".join(parts)


def cache_parts(cfg: DictConfig, tokenizer: Any, reference: dict | None = None) -> dict:
    """What the built examples depend on (:func:`vramsweep.data.cache.cached`'s key); ``reference`` only
    where it differs from the trial's own settings."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(cfg.data, resolve=True)
    parts = {"data": d, "context": OmegaConf.to_container(cfg.context, resolve=True)}
    if cfg.data.source in USER_SOURCES:
        parts["files"] = [source_sha256(str(p)) for p in (cfg.data.path, cfg.data.eval_path) if p]
    templates = [cfg.data.chat_template, (reference or {}).get("data.chat_template")]
    for i, t in enumerate(dict.fromkeys(t for t in templates if t)):
        if os.path.isfile(os.path.expanduser(str(t))):
            parts["template_sha256" if i == 0 else "reference_template_sha256"] = source_sha256(str(t))
    if reference is not None:
        parts["eval_reference"] = reference
    parts["tokenizer"] = tokenizer_fingerprint(tokenizer)
    return parts


def build_trial_data(cfg: DictConfig, tokenizer: Any, reference: dict | None = None) -> TrialData:
    """Examples for training and held-out eval, truncated to ``context.max_tokens`` as configured, the
    held-out records under the eval reference (``reference``: a sweep baseline's
    :data:`~vramsweep.data.reference.REFERENCE_KEYS`; None: this run's own); built once per data +
    tokenizer + settings and then read from the tokenisation cache (:mod:`vramsweep.data.cache`).
    ``stats["cache"]`` says ``hit`` or ``miss``."""
    where = "sweep baseline" if reference is not None else "this run's settings"
    if reference is not None and reference == reference_of(cfg):
        reference = None  # the baseline's own settings: the same examples, the same cache entry
    data, status, key = cached(
        cache_parts(cfg, tokenizer, reference), lambda: _build(cfg, tokenizer, reference)
    )
    data.stats = {**data.stats, "cache": status, "cache_key": key[:16]}
    if isinstance(data.stats.get("eval_reference"), dict):
        data.stats["eval_reference"] = {**data.stats["eval_reference"], "from": where}
    return data


def trial_data(cfg: DictConfig, tokenizer: Any, reference: dict | None = None) -> TrialData:
    """Documents -> examples, or exact-length random tokens (``data=random``, or a model without
    tokenizer). The held-out records are rendered under ``reference``, by default the reference of the
    sweep this process is a trial of (:func:`vramsweep.data.reference.sweep_reference`)."""
    if tokenizer is None or cfg.data.source == "random":
        return random_token_data(cfg)
    return build_trial_data(cfg, tokenizer, reference if reference is not None else sweep_reference())


def random_token_data(cfg: DictConfig):
    """Random token sequences of exactly ``context.max_tokens`` (architecture-only models have no tokenizer;
    ``data=random`` asks for them: memory/speed at an exact length, e.g. max-context searches)."""
    import torch

    from vramsweep.data.examples import Example

    g = torch.Generator().manual_seed(int(cfg.data.seed))
    n = max(8, int(cfg.train.micro_batch) * 2)
    L = int(cfg.context.max_tokens)
    V = int(cfg.model.vocab_size)

    def mk(i: int) -> Example:
        ids = torch.randint(3, V, (L,), generator=g).tolist()
        return Example(
            input_ids=ids,
            labels=list(ids),
            doc_id=f"random-{i}",
            target_section=0,
            n_context_tokens=0,
            fact_spans=[],
        )

    return TrialData(
        train=[mk(i) for i in range(n)],
        eval=[mk(n + i) for i in range(4)],
        pad_id=0,
        stats={"random_tokens": True},
    )


def micro_batches(examples: list, micro_batch: int, grad_accum: int, steps: int, seed: int) -> list[list]:
    """``steps * grad_accum`` micro-batches of ``micro_batch`` examples, grouped by optimizer step.

    Step ``k`` takes the next ``micro_batch * grad_accum`` examples of a seeded shuffle (reshuffled at
    each pass over the data), so a step holds the same examples whatever the ``micro_batch x grad_accum``
    split: with token-weighted accumulation (:func:`vramsweep.loop.token_weights`) the split changes
    memory and speed, not the maths. Whole steps are then reordered, never micro-batches across steps:
    the two steps holding the longest examples go first (fail fast: an OOM shows on step 0, and the
    tracked warm-up steps see the worst case), and inside a step the examples go longest first (its first
    micro-batch is its widest; rows of like length share a micro-batch, so less padding)."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    per_step = micro_batch * grad_accum
    grouped: list[list] = []
    pos = 0
    for _ in range(steps):
        step = []
        for _ in range(per_step):
            if pos % len(order) == 0 and pos:
                rng.shuffle(order)
            step.append(examples[order[pos % len(order)]])
            pos += 1
        grouped.append(sorted(step, key=lambda e: -len(e.input_ids)))  # stable: ties keep their order
    longest = [len(s[0].input_ids) for s in grouped]
    ranked = sorted(range(len(grouped)), key=lambda i: (-longest[i], i))
    first = ranked[: min(2, len(grouped))]
    ordered = [grouped[i] for i in first + [i for i in range(len(grouped)) if i not in first]]
    return [s[k : k + micro_batch] for s in ordered for k in range(0, per_step, micro_batch)]


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def eval_subset(examples: list, n: int) -> list:
    """A fixed held-out subset: up to half of it examples whose target repeats facts (so the task score
    has spans to check), the rest spread evenly over the other examples; original order kept."""
    if len(examples) <= n:
        return list(examples)
    with_facts = [i for i, e in enumerate(examples) if e.fact_spans]
    picked = set(_spread(with_facts, n // 2))
    rest = [i for i in range(len(examples)) if i not in picked]
    picked |= set(_spread(rest, n - len(picked)))
    return [examples[i] for i in sorted(picked)]


def collate_batch(examples: list, pad_id: int, width: int | None = None) -> dict:
    """A collated micro-batch with the host-side counts the loop and the timing read (no device reads).

    Packed rows (``data.packing``) get ``position_ids`` and ``packed: True``: the loop then passes no
    attention mask; the model splits each row at the positions' restarts (segment-wise attention under
    eager/sdpa: knobs/packed_attention.py; varlen FlashAttention-2)."""
    from vramsweep.data.examples import collate

    b = collate(examples, pad_id, width)
    b["fact_spans"] = [list(e.fact_spans) for e in examples]
    # Counted once here, on the host, so the loop never reads device tensors for bookkeeping.
    b["n_tokens"] = int(b["attention_mask"].sum())
    b["n_targets"] = int((b["labels"] != -100).sum())
    # The tokens the causal-LM loss averages over (labels shift by one: position 0 predicts nothing):
    # each micro-batch's weight in its optimizer step (vramsweep.loop.token_weights).
    b["n_loss_tokens"] = int((b["labels"][:, 1:] != -100).sum())
    b["packed"] = "position_ids" in b
    if b["packed"]:  # the segments, from the host tensor: the forward never reads the positions back
        from vramsweep.data.packing import bounds_of  # packing -> examples imports torch

        b["segment_bounds"] = bounds_of(b["position_ids"])
    b["no_padding"] = b["n_tokens"] == int(b["attention_mask"].numel())
    return b


def eval_batches(examples: list, n_batches: int, pad_id: int) -> list[dict]:
    """The held-out batches (:data:`EVAL_BATCH` rows each) of the fixed eval subset."""
    ex = eval_subset(examples, n_batches * EVAL_BATCH)
    return [collate_batch(ex[i : i + EVAL_BATCH], pad_id) for i in range(0, len(ex), EVAL_BATCH)]
