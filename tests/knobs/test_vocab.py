"""Exact vocabulary slicing: kept ids, id map, exactness, memory, export, adapters."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from vramsweep.data.documents import document_text, format_section
from vramsweep.data.examples import build_examples
from vramsweep.data.synthetic import generate_documents, pretrain_texts
from vramsweep.data.tokenizer import train_tokenizer
from vramsweep.knobs.vocab_slice import (
    IdMap,
    SlicedTokenizer,
    embedding_bytes_saved,
    kept_ids,
    load_sliced,
    parameter_bytes,
    remap_examples,
    save_sliced,
    slice_model_and_tokenizer,
)

HIDDEN = 64
# Exactness tolerance: kept rows are copied, so fp32 logits should match bit for bit; 1e-6 absorbs any
# shape-dependent matmul blocking of the smaller lm_head on other BLAS builds.
ATOL = 1e-6


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(pretrain_texts(10, seed=0), vocab_size=1200)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return [document_text(d) for d in generate_documents(2, seed=3)]


def tiny_model(vocab: int, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------------------- kept ids
def test_kept_ids_corpus_mode(tok, corpus):
    keep = kept_ids(tok, corpus, mode="corpus")
    used = {t for text in corpus for t in tok(text, add_special_tokens=False)["input_ids"]}
    assert keep == sorted(used | {0, 1, 2, 3, 4})
    assert len(keep) < len(tok)
    # reserve: the next unused ids in rank order (count 0 -> by id)
    more = kept_ids(tok, corpus, mode="corpus", reserve=7)
    extra = sorted(set(more) - set(keep))
    assert extra == sorted(i for i in range(len(tok)) if i not in set(keep))[:7]
    # token lists give the same answer as the texts
    lists = [tok(text, add_special_tokens=False)["input_ids"] for text in corpus]
    assert kept_ids(tok, lists, mode="corpus") == keep
    assert kept_ids(tok, [torch.tensor(x) for x in lists], mode="corpus") == keep


def test_kept_ids_top_k_mode(tok, corpus):
    counts: dict[int, int] = {}
    for text in corpus:
        for t in tok(text, add_special_tokens=False)["input_ids"]:
            counts[t] = counts.get(t, 0) + 1
    keep = kept_ids(tok, corpus, mode="top_k", top_k=50)
    assert set(range(5)) <= set(keep) and len(keep) == 55
    expected = sorted(counts, key=lambda i: (-counts[i], i))[:50]
    assert set(keep) - set(range(5)) == set(expected)
    assert min(counts[i] for i in expected) >= max(counts.get(i, 0) for i in set(counts) - set(expected))
    assert len(kept_ids(tok, corpus, mode="top_k", top_k=50, reserve=10)) == 65


def test_kept_ids_errors(tok, corpus):
    with pytest.raises(ValueError, match="vocab.mode"):
        kept_ids(tok, corpus, mode="bogus")
    with pytest.raises(ValueError, match="top_k > 0"):
        kept_ids(tok, corpus, mode="top_k")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        kept_ids(tok, [[1, 2, len(tok)]], mode="corpus")
    assert kept_ids(tok, corpus, mode="full") == list(range(len(tok)))


# ----------------------------------------------------------------------------------------------- id map
def test_id_map_roundtrip_and_errors(tmp_path):
    m = IdMap([0, 3, 5, 9], old_vocab_size=12, unk_id=1)
    assert m.old_to_new.tolist() == [0, -1, -1, 1, -1, 2, -1, -1, -1, 3, -1, -1]
    assert m.encode([9, 3, 0]) == [3, 1, 0]
    assert m.decode([3, 1, 0]) == [9, 3, 0]
    t = torch.tensor([[5, 9], [0, 3]])
    assert torch.equal(m.encode(t), torch.tensor([[2, 3], [0, 1]]))
    with pytest.raises(
        ValueError, match=r"2 token\(s\) outside the sliced vocabulary: 'tok4' \(id 4\), 'tok7'"
    ):
        m.encode([3, 4, 7, 4], id_to_token=lambda i: f"tok{i}")
    assert m.encode([3, 4, 7], fallback="unk") == [1, 1, 1]
    with pytest.raises(ValueError, match="outside the original vocabulary"):
        m.encode([12])
    with pytest.raises(ValueError, match="vocab.fallback"):
        m.encode([3], fallback="skip")
    m.save(tmp_path)
    assert IdMap.load(tmp_path) == m
    with pytest.raises(ValueError, match="sorted"):
        IdMap([3, 1], old_vocab_size=5)
    with pytest.raises(ValueError, match="UNK"):
        IdMap([0, 1], old_vocab_size=5).encode([4], fallback="unk")


# ----------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("tied", [True, False])
def test_sliced_logits_and_loss_are_exact(tok, corpus, tied):
    keep = kept_ids(tok, corpus, mode="corpus")
    model = tiny_model(len(tok), tied)
    text = corpus[0][:1500]  # made only of kept tokens (it is part of the corpus)
    old_ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = model(old_ids).logits
    model, stok, id_map = slice_model_and_tokenizer(model, tok, keep)
    new_ids = stok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert new_ids.shape == old_ids.shape
    assert torch.equal(id_map.decode(new_ids), old_ids)
    with torch.no_grad():
        out = model(new_ids, labels=new_ids)
    assert out.logits.shape[-1] == len(keep)  # the logits shrink too: V' instead of V columns
    torch.testing.assert_close(out.logits, ref[..., keep], atol=ATOL, rtol=0)
    # Loss: the sliced model's CE equals the original's after renormalising over the kept ids.
    logp = F.log_softmax(ref[..., keep].float(), dim=-1)[0, :-1]
    renorm = -logp.gather(-1, new_ids[0, 1:, None]).mean()
    torch.testing.assert_close(out.loss, renorm, atol=ATOL, rtol=1e-6)
    full = F.cross_entropy(ref[0, :-1].float(), old_ids[0, 1:])
    assert full > out.loss  # without renormalisation the original puts mass on dropped ids


@pytest.mark.parametrize("tied", [True, False])
def test_memory_saving_matches_formula_and_ties_are_kept(tok, corpus, tied):
    keep = kept_ids(tok, corpus, mode="corpus")
    model = tiny_model(len(tok), tied)
    before = parameter_bytes(model)
    model, _, _ = slice_model_and_tokenizer(model, tok, keep)
    saved = before - parameter_bytes(model)
    assert saved == (len(tok) - len(keep)) * HIDDEN * 4 * (1 if tied else 2)
    assert saved == embedding_bytes_saved(len(tok), len(keep), HIDDEN, 4, tied)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert emb.weight.shape == head.weight.shape == (len(keep), HIDDEN)
    assert (head.weight is emb.weight) == tied
    assert (
        model.config.vocab_size == len(keep)
        and head.out_features == len(keep)
        and emb.num_embeddings == len(keep)
    )


def test_config_special_ids_are_remapped(tok, corpus):
    keep = kept_ids(tok, corpus, mode="corpus")
    model = tiny_model(len(tok), True)
    model, stok, id_map = slice_model_and_tokenizer(model, tok, keep)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (2, 1, 0)
    assert model.generation_config.eos_token_id == 1
    assert (stok.bos_token_id, stok.eos_token_id, stok.pad_token_id, stok.unk_token_id) == (2, 1, 0, 3)
    assert len(stok) == stok.vocab_size == len(keep)
    # a non-trivial remap: drop id 3 (UNK) so that old id 4 becomes new id 3
    shifted = tiny_model(len(tok), True)
    shifted.config.eos_token_id = 4
    shifted.generation_config.eos_token_id = [4, 1]
    _, shifted_tok, shifted_map = slice_model_and_tokenizer(
        shifted, tok, [0, 1, 2, 4, *[i for i in keep if i > 4]]
    )
    assert shifted.config.eos_token_id == 3 and shifted.generation_config.eos_token_id == [3, 1]
    assert shifted_map.unk_id is None and shifted_tok.unk_token_id is None and shifted_tok.sep_token_id == 3


def test_slicing_refuses_to_drop_a_config_special_and_changes_nothing(tok):
    model = tiny_model(len(tok), True)
    before = model.get_input_embeddings().weight.shape
    with pytest.raises(ValueError, match="eos_token_id=1 is not among the kept ids"):
        slice_model_and_tokenizer(model, tok, [0, 2, 3, 10, 11])
    assert model.get_input_embeddings().weight.shape == before
    assert model.config.vocab_size == len(tok)


def test_outside_tokens_error_or_unk(tok, corpus):
    keep = kept_ids(tok, corpus, mode="corpus")
    model = tiny_model(len(tok), True)
    _, stok, id_map = slice_model_and_tokenizer(model, tok, keep)
    odd = "zebra quokka xylophone Ωψ"
    dropped = sorted({o for o in tok(odd, add_special_tokens=False)["input_ids"] if id_map.old_to_new[o] < 0})
    assert dropped  # the test needs tokens outside the corpus
    with pytest.raises(
        ValueError, match=rf"^{len(dropped)} token\(s\) outside the sliced vocabulary"
    ) as info:
        stok(odd)
    for o in dropped:  # every offending token is named, with its id
        assert f"{tok.convert_ids_to_tokens(o)!r} (id {o})" in str(info.value)
    assert "vocab.fallback=unk" in str(info.value)
    with pytest.raises(ValueError, match="outside the sliced vocabulary"):
        stok.encode(odd)
    unk = SlicedTokenizer(tok, id_map, fallback="unk")
    ids = unk(odd, add_special_tokens=False)["input_ids"]
    old = tok(odd, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(old) and unk.unk_token_id in ids
    assert [i for i, o in zip(ids, old) if id_map.old_to_new[o] >= 0] == [
        int(id_map.old_to_new[o]) for o in old if id_map.old_to_new[o] >= 0
    ]
    assert all(i == unk.unk_token_id for i, o in zip(ids, old) if id_map.old_to_new[o] < 0)


def test_sliced_tokenizer_batch_decode_and_tokens(tok, corpus):
    keep = kept_ids(tok, corpus, mode="corpus")
    _, stok, id_map = slice_model_and_tokenizer(tiny_model(len(tok), True), tok, keep)
    texts = [corpus[0][:200], corpus[1][:120]]
    batch = stok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2 and int(batch["input_ids"].max()) < len(keep)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()
    assert stok.decode(stok.encode(texts[0])) == texts[0]
    assert stok.batch_decode(batch["input_ids"], skip_special_tokens=True) == texts
    new = stok.encode(texts[1])
    assert stok.convert_ids_to_tokens(new) == tok.convert_ids_to_tokens(tok.encode(texts[1]))
    assert stok.convert_tokens_to_ids("<|eos|>") == stok.eos_token_id


def test_remap_examples_equals_building_with_the_sliced_tokenizer(tok):
    docs = generate_documents(3, seed=9)
    kw = dict(
        max_tokens=400, truncation="exp_decay", decay=0.5, min_tokens_per_section=16, instructions="Go."
    )
    train = build_examples(docs[:2], tok, **kw)
    # Kept ids from the examples' own tokens: exactly what the model will see (sections are tokenised
    # one by one, so whole-document texts would segment section boundaries differently).
    keep = kept_ids(tok, [e.input_ids for e in train], mode="corpus")
    _, _, id_map = slice_model_and_tokenizer(tiny_model(len(tok), True), tok, keep)
    remapped = remap_examples(train, id_map)
    assert [id_map.decode(e.input_ids) for e in remapped] == [e.input_ids for e in train]
    # Same examples as building with the sliced tokenizer, when every section's tokens are kept (the sliced
    # tokenizer encodes whole sections, including the parts that truncation then drops).
    section_texts = [format_section(s) for d in docs[:2] for s in d["sections"]]
    keep_all = kept_ids(tok, [*section_texts, "Go."], mode="corpus")
    assert set(keep) <= set(keep_all)
    _, stok, id_map_all = slice_model_and_tokenizer(tiny_model(len(tok), True), tok, keep_all)
    assert remap_examples(train, id_map_all) == build_examples(docs[:2], stok, **kw)
    assert [e.fact_spans for e in remapped] == [e.fact_spans for e in train]
    assert all(max(e.input_ids) < len(keep) for e in remapped)
    held_out = build_examples(docs[2:], tok, **kw)
    assert any(id_map.old_to_new[t] < 0 for e in held_out for t in e.input_ids)  # unseen tokens exist
    with pytest.raises(ValueError, match=rf"document '{docs[2]['id']}' section \d+: \d+ token\(s\) outside"):
        remap_examples(held_out, id_map, id_to_token=tok.convert_ids_to_tokens)
    unk = remap_examples(held_out, id_map, fallback="unk")
    assert any(id_map.unk_id in e.input_ids for e in unk)
    assert all(len(a.input_ids) == len(b.input_ids) for a, b in zip(unk, held_out))


# ----------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("tied", [True, False])
def test_export_reload_and_lora_adapter_generates(tok, corpus, tied, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    keep = kept_ids(tok, corpus, mode="corpus")
    model, stok, id_map = slice_model_and_tokenizer(tiny_model(len(tok), tied), tok, keep)
    export = tmp_path / "sliced"
    save_sliced(model, stok, export)
    assert json.loads((export / "config.json").read_text())["vocab_size"] == len(keep)
    with pytest.raises(Exception):  # noqa: B017 - any failure is fine; a silently wrong tokenizer is not
        AutoTokenizer.from_pretrained(str(export))

    ids = stok(corpus[0][:400], add_special_tokens=False, return_tensors="pt")["input_ids"]
    # A couple of LoRA steps on the sliced model.
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    peft_model.eval()
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter_dir))

    reloaded, rtok = load_sliced(export)
    assert rtok.id_map == id_map and len(rtok) == len(keep)
    assert (reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight) == tied
    loaded = PeftModel.from_pretrained(reloaded, str(adapter_dir)).eval()
    prompt = rtok(corpus[0][:80], add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, peft_model(prompt).logits, atol=ATOL, rtol=0)
        gen = loaded.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
        expected = peft_model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    assert gen.shape[1] > prompt.shape[1] and torch.equal(gen, expected)
    assert int(gen.max()) < len(keep)
    assert isinstance(rtok.decode(gen[0]), str)


def test_save_sliced_checks_sizes(tok, corpus, tmp_path):
    keep = kept_ids(tok, corpus, mode="corpus")
    model, stok, id_map = slice_model_and_tokenizer(tiny_model(len(tok), True), tok, keep)
    other = SlicedTokenizer(tok, IdMap(keep[:-1], len(tok), id_map.unk_id))
    with pytest.raises(ValueError, match="embedding rows"):
        save_sliced(model, other, tmp_path)
