"""``vocab``: the vocabulary-slicing provider (:mod:`vramsweep.knobs.registry`); the implementation is
:mod:`vramsweep.knobs.vocab_slice` (which imports torch, so the provider lives here for the estimator).

Build (``vocab.mode != full``): the embedding and lm_head keep only ``keep_ids`` (chosen from the trial's
examples, ``b.corpus``: every train and eval example as built, after truncation), the tokenizer is wrapped
to emit the new ids and ``b.id_map`` maps old <-> new (``meta.build.vocab``: rows before and after).
Data: the examples re-expressed in the kept ids (``vocab.fallback`` for ids outside them) and the pad id
with them. Estimate: the rows the memory terms count.
"""

from __future__ import annotations

from typing import Any

from vramsweep.knobs.registry import KnobHooks, register


def _build(cfg: Any, b: Any) -> dict[str, Any]:
    if cfg.vocab.mode == "full":
        return {}
    from vramsweep.knobs.vocab_slice import kept_ids, slice_model_and_tokenizer

    if b.keep_ids is None and b.corpus is not None:
        v, seen = cfg.vocab, [e.input_ids for e in b.corpus]
        b.keep_ids = kept_ids(b.tokenizer, seen, mode=str(v.mode), top_k=int(v.top_k), reserve=int(v.reserve))
    if b.keep_ids is None:
        raise ValueError("vocab slicing needs keep_ids from the training corpus")
    old_v = b.model.get_input_embeddings().weight.shape[0]
    b.model, b.tokenizer, b.id_map = slice_model_and_tokenizer(b.model, b.tokenizer, b.keep_ids)
    return {"vocab": {"original": int(old_v), "kept": int(b.model.get_input_embeddings().weight.shape[0])}}


def _data(cfg: Any, d: Any) -> None:
    if d.id_map is None:  # the build kept the full vocabulary
        return
    from vramsweep.knobs.vocab_slice import remap_examples

    fallback, names = str(cfg.vocab.fallback), d.tokenizer.convert_ids_to_tokens
    d.train = remap_examples(d.train, d.id_map, fallback=fallback, id_to_token=names)
    d.eval = remap_examples(d.eval, d.id_map, fallback=fallback, id_to_token=names)
    d.pad_id = int(d.id_map.encode([d.pad_id])[0])


def _estimate(cfg: Any, e: Any) -> dict[str, Any]:
    v, full = cfg.vocab, e.dims.vocab_size
    if v.mode == "full":
        return {"vocab": full}
    rows = int(v.get("rows", 0) or 0)
    if rows > 0:
        e.note(
            f"vocab=sliced vocab.rows={rows}: V'={rows} embedding and lm_head rows (and logits columns) as "
            "given, without a corpus; the special tokens the chat template needs are counted in it"
        )
        return {"vocab": min(full, rows)}
    if v.mode == "top_k" and int(v.top_k) > 0:
        kept = min(full, int(v.top_k) + int(v.reserve))
        e.note(f"vocab=sliced (top_k): V'={kept} = top_k + reserve (special tokens not added)")
        return {"vocab": kept}
    e.note(
        f"vocab=sliced (mode={v.mode}): the kept vocabulary depends on the corpus; V={full} used "
        "(an upper bound for embeddings, lm_head and logits)"
    )
    return {"vocab": full}


register(
    KnobHooks(
        name="vocab",
        build=_build,
        data=_data,
        estimate=_estimate,
        groups=("vocab",),
        notes_in="build",
    )
)
