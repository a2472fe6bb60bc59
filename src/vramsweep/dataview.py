"""``vramsweep data <overrides>``: the records as the trial sees them, with what is trained marked.

The examples are the trial's own (:func:`vramsweep.data.prep.trial_data`: the same tokenisation cache
entry, so ``cache: hit`` after a pre-flight or a trial of the same settings). Each shown record gets its
token count, trained tokens (labels that are not ``-100``), whether it was truncated (its rendering without
the context limit is longer) and its text with the trained tokens marked: colour on a terminal (unless
``NO_COLOR`` is set), ``[[``…``]]`` otherwise. Then the totals per split (records, tokens, trained,
truncated, dropped: records that gave no example), the length distribution and where the held-out records
came from and the mask they are scored under (docs/DATA.md). ``--json`` prints JSON Lines instead: one
``{"kind": "record", ..., "trained": [decoded text of each trained span]}`` per shown record, then one
``{"kind": "summary", ...}``.

Truncation is found by building the records once more without the context limit (``context.max_tokens``
raised, truncation ``tail``; not cached), so the command costs one more tokenisation pass.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from omegaconf import DictConfig, OmegaConf

from vramsweep.config import ConfigError, compose
from vramsweep.config.errors import error_line
from vramsweep.data.examples import IGNORE_INDEX, trained_spans
from vramsweep.data.prep import _build, trial_data
from vramsweep.data.truncation import ContextOverflowError
from vramsweep.knobs.build import model_source
from vramsweep.preflight import check_inputs, check_named_options

#: ``context.max_tokens`` of the untruncated build (truncation is counted against it).
UNLIMITED = 1 << 40
OPEN, CLOSE = "[[", "]]"
COLOUR_ON, COLOUR_OFF = "\x1b[1;32m", "\x1b[0m"


def marked(example: Any, tok: Any, colour: bool) -> str:
    """The example's text, each trained run decoded and wrapped in colour or ``[[``…``]]``."""
    ids, parts, pos = example.input_ids, [], 0
    on, off = (COLOUR_ON, COLOUR_OFF) if colour else (OPEN, CLOSE)
    for a, b in trained_spans(example.labels):
        parts.append(tok.decode(ids[pos:a]))
        parts.append(on + tok.decode(ids[a:b]) + off)
        pos = b
    parts.append(tok.decode(ids[pos:]))
    return "".join(parts)


def _merged(e: Any) -> int:
    """Trained spans whose first token straddles the prompt/answer boundary (``Example.boundary_merged``
    where the data step counts them; 0 otherwise)."""
    return int(getattr(e, "boundary_merged", 0) or 0)


def _key(e: Any) -> tuple:
    return (e.where or e.doc_id, e.target_section)


@dataclass
class Split:
    """One split's examples and what their untruncated build says about them."""

    name: str
    examples: list
    full: dict  # _key -> untruncated length
    sources: int  # records (or documents) the split read

    def full_len(self, e: Any) -> int:
        return int(self.full.get(_key(e), len(e.input_ids)))

    def totals(self) -> dict[str, Any]:
        ex = self.examples
        kept = {_key(e)[0] for e in ex}
        return {
            "records": self.sources,
            "examples": len(ex),
            "tokens": sum(len(e.input_ids) for e in ex),
            "trained": sum(sum(1 for t in e.labels if t != IGNORE_INDEX) for e in ex),
            "truncated": sum(1 for e in ex if self.full_len(e) > len(e.input_ids)),
            "dropped": len({k[0] for k in self.full} - kept),
            "boundary_merged": sum(_merged(e) for e in ex),
        }


def record(split: Split, i: int, e: Any, tok: Any) -> dict[str, Any]:
    """One record as ``--json`` prints it."""
    full = split.full_len(e)
    return {
        "kind": "record",
        "split": split.name,
        "index": i,
        "where": e.where or e.doc_id,
        "tokens": len(e.input_ids),
        "trained_tokens": sum(1 for t in e.labels if t != IGNORE_INDEX),
        "truncated": full > len(e.input_ids),
        "untruncated_tokens": full,
        "boundary_merged": _merged(e),
        "trained": [tok.decode(e.input_ids[a:b]) for a, b in trained_spans(e.labels)],
    }


def _untruncated(cfg: DictConfig, tok: Any) -> Any:
    """The same records built without the context limit (not cached)."""
    full = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    full.context.max_tokens, full.context.truncation = UNLIMITED, "tail"
    return _build(full, tok)


def _source_counts(full: Any) -> tuple[int, int]:
    def n(examples: list) -> int:
        return len({_key(e)[0] for e in examples})

    return n(full.train), n(full.eval)


def splits(cfg: DictConfig, tok: Any) -> tuple[Any, list[Split]]:
    """The trial's data and its train / held-out :class:`Split` views."""
    data = trial_data(cfg, tok)
    full = _untruncated(cfg, tok)
    n_train, n_eval = _source_counts(full)
    out = []
    for name, ex, fx, n in (
        ("train", data.train, full.train, n_train),
        ("eval", data.eval, full.eval, n_eval),
    ):
        out.append(Split(name, ex, {_key(e): len(e.input_ids) for e in fx}, n))
    return data, out


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f} %" if whole else "-"


def _totals_line(s: Split) -> str:
    t = s.totals()
    what = "train" if s.name == "train" else "held-out"
    return (
        f"{what}: {t['records']:,} records -> {t['examples']:,} examples, {t['tokens']:,} tokens, "
        f"{t['trained']:,} trained ({_pct(t['trained'], t['tokens'])}), {t['truncated']:,} truncated, "
        f"{t['dropped']:,} dropped, {t['boundary_merged']:,} boundary-merged"
    )


def _lengths_line(stats: dict, cfg: DictConfig) -> str:
    ld = (stats.get("train") or {}).get("length_distribution") or {}
    dist = ", ".join(f"{k} {v:,}" for k, v in ld.items())
    return f"lengths (train, tokens): {dist or '-'} (context.max_tokens={int(cfg.context.max_tokens):,})"


def _header(stats: dict, cfg: DictConfig) -> str:
    d = cfg.data
    src = f"data.path={d.path}" if str(d.source) in ("file", "jsonl") else f"data={d.name}"
    return (
        f"{src}: format {stats.get('format')}, train_on {stats.get('train_on')}, template "
        f"{stats.get('chat_template', 'tokenizer')}, enable_thinking "
        f"{str(bool(stats.get('enable_thinking', False))).lower()}, cache {stats.get('cache')}"
    )


def _eval_line(stats: dict, ev: Split) -> str:
    return (
        f"held-out records: {stats.get('eval_from')} ({ev.totals()['records']:,}), scored under train_on "
        f"{stats.get('eval_train_on')} whatever data.train_on says (docs/DATA.md, Held-out loss)"
    )


def show(
    cfg: DictConfig, tok: Any, n: int | None, *, as_json: bool = False, out: TextIO | None = None
) -> None:
    """Print ``n`` training records (None: all) marked, then the totals (module docstring)."""
    out = out or sys.stdout
    data, (tr, ev) = splits(cfg, tok)
    shown = tr.examples if n is None else tr.examples[:n]
    summary = {
        "kind": "summary",
        **{k: data.stats.get(k) for k in ("format", "train_on", "eval_train_on", "eval_from", "cache")},
        "train": tr.totals(),
        "eval": ev.totals(),
        "length_distribution": (data.stats.get("train") or {}).get("length_distribution"),
        "max_tokens": int(cfg.context.max_tokens),
    }
    if as_json:
        for i, e in enumerate(shown):
            print(json.dumps(record(tr, i, e, tok), ensure_ascii=False), file=out)
        print(json.dumps(summary, ensure_ascii=False), file=out)
        return
    colour = out.isatty() and not os.environ.get("NO_COLOR")
    print(_header(data.stats, cfg), file=out)
    for i, e in enumerate(shown):
        r = record(tr, i, e, tok)
        cut = f", truncated from {r['untruncated_tokens']:,}" if r["truncated"] else ""
        print(
            f"\n--- example {i + 1} of {len(tr.examples):,} ({r['where']}): {r['tokens']:,} tokens, "
            f"{r['trained_tokens']:,} trained{cut}",
            file=out,
        )
        print(marked(e, tok, colour), file=out)
    if shown:
        print(file=out)
    marks = "trained tokens in colour" if colour else f"trained tokens in {OPEN}…{CLOSE}"
    print(f"{marks}; totals:", file=out)
    for line in (
        _totals_line(tr),
        _totals_line(ev),
        _lengths_line(data.stats, cfg),
        _eval_line(data.stats, ev),
    ):
        print(line, file=out)


def _tokenizer(cfg: DictConfig) -> Any:
    """The trial's tokenizer (:func:`vramsweep.knobs.build.model_source`; no weights are loaded)."""
    tok = model_source(cfg)[1]
    if tok is None:
        raise ValueError(
            f"model={cfg.model.name} has no tokenizer here (an architecture without model.path): the records "
            "cannot be tokenised; set model.path=<Hugging Face folder>"
        )
    return tok


def run_data(overrides: list[str], *, records: int | None = 3, as_json: bool = False) -> int:
    """``vramsweep data``: 0 shown; 2 bad input (one line ``vramsweep data: error: ...``, nothing written
    but the tokenisation cache entry a trial would write too)."""
    try:
        check_named_options(overrides)
        cfg = compose(overrides, rules="all")
        if str(cfg.data.source) == "random":
            raise ValueError("data=random: random tokens, no records to show; choose data=file data.path=...")
        check_inputs(cfg)  # the data files parse (file:line), model.path has a config
        show(cfg, _tokenizer(cfg), records, as_json=as_json)
    except (ConfigError, ContextOverflowError, ValueError, OSError) as exc:
        print(error_line("data", str(exc)), file=sys.stderr)
        return 2
    return 0
