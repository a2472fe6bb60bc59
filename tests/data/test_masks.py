"""What is trained is what the record means, on three tokenizer families (tests/data/_tokenizers.py) and
three chat templates (tests/fixtures/chat_templates): the end-of-turn token after whitespace, a token that
straddles the prompt/answer boundary, think blocks, the stop-token guard."""

from __future__ import annotations

import pytest
from _tokenizers import END_OF_TURN, TEMPLATES, TOKENIZERS

from vramsweep.data.examples import IGNORE_INDEX
from vramsweep.data.formats import normalize_records
from vramsweep.data.render import RenderSettings, build_item_examples
from vramsweep.data.sources import Record


def settings(template=None, train_on="assistant", max_tokens=4096, truncation="tail", **kw) -> RenderSettings:
    return RenderSettings(
        too_long=kw.pop("too_long", "truncate"),
        train_on=train_on,
        template=template,
        enable_thinking=kw.pop("enable_thinking", False),
        max_tokens=max_tokens,
        truncation=truncation,
        decay=kw.pop("decay", 0.5),
        min_tokens_per_section=kw.pop("min_tokens_per_section", 4),
    )


def items(*objs, fmt="auto"):
    return normalize_records([Record(f"f.jsonl:{i + 1}", o) for i, o in enumerate(objs)], fmt)


def example(tok, rec, **kw):
    from vramsweep.data.render import build_item_slots

    (e,) = build_item_slots(items(rec), tok, settings(**kw))
    return e


def runs(e) -> list[tuple[int, int]]:
    """The trained token runs of an example: ``[start, end)`` of each contiguous run of labels != -100."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(e.labels):
        if t == IGNORE_INDEX:
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def texts(tok, e) -> list[str]:
    """The text of each trained run, as the prefix difference of decodes (a SentencePiece-style decoder
    drops a leading space when it decodes a run on its own)."""
    out = []
    for a, b in runs(e):
        head, whole = tok.decode(e.input_ids[:a]), tok.decode(e.input_ids[:b])
        assert whole.startswith(head)
        out.append(whole[len(head) :])
    return out


# ---------------------------------------------------------------- bug 1: whitespace before the end of turn
@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("template", ["chatml", "qwen3", "llama3"])
@pytest.mark.parametrize("answer", ["Four.\n", "Four. ", "Four.\n\n", " Four.\t\n"])
def test_an_answer_ending_in_whitespace_trains_its_end_of_turn_token(tok_name, template, answer):
    """Bug 1: the span ended after the stripped content and looked for the end marker only right after it,
    so an answer ending in whitespace (common in chat exports) trained no end-of-turn token."""
    tok = TOKENIZERS[tok_name]()
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}]}
    e = example(tok, rec, template=TEMPLATES[template])
    eot = tok.convert_tokens_to_ids(END_OF_TURN[template])
    ((a, b),) = runs(e)
    assert e.input_ids[b - 1] == eot
    shown = answer.strip() if template == "llama3" else answer  # Llama 3's template trims the content
    (text,) = texts(tok, e)
    assert text.endswith(shown + END_OF_TURN[template])


def test_the_embedded_template_trains_its_end_of_turn_after_whitespace():
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    tok = load_tokenizer(ASSET_DIR, embedded=True)
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four.\n"}]}
    e = example(tok, rec, template=tok.chat_template)
    assert tok.decode([t for t in e.labels if t != IGNORE_INDEX]) == "Four.\n<|eos|>"


# ------------------------------------------------------- bug 2: a token straddling the prompt/answer boundary
@pytest.mark.parametrize("tok_name", ["bpe", "metaspace"])
def test_a_token_merging_the_prompts_trailing_space_with_the_answer_is_trained(tok_name):
    """Bug 2: byte-level BPE (and SentencePiece-style) tokenizers merge a string prompt's trailing space
    into the completion's first token (``"Answer: " + "yes"`` -> ``' yes'``); a token was trained only if
    it started inside the completion, so a one-token answer trained only EOS. Trained from the first token
    that differs from the tokenised prompt (TRL's split), and counted as boundary-merged."""
    tok = TOKENIZERS[tok_name]()
    e = example(tok, {"prompt": "Answer: ", "completion": "yes"}, train_on="completion")
    ids = tok("Answer: yes", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[-1] in ("Ġyes", "▁yes")  # the straddling token exists
    trained = [t for t in e.labels if t != IGNORE_INDEX]
    assert trained == [ids[-1], tok.eos_token_id]
    assert e.boundary_merged == 1
    kept = example(tok, {"prompt": "Answer:", "completion": " yes"}, train_on="completion")
    assert [t for t in kept.labels if t != IGNORE_INDEX] == trained and kept.boundary_merged == 0


def test_a_chat_answer_whose_first_newline_merges_with_the_templates_is_trained_and_counted():
    """Qwen2-style pre-tokenisation joins newlines: ChatML's ``assistant\\n`` + an answer starting with
    ``\\n`` is one ``'\\n\\n'`` token straddling the boundary: trained (it holds the answer's newline) and
    counted."""
    tok = TOKENIZERS["bpe"]()
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "\nFour."}]}
    e = example(tok, rec, template=TEMPLATES["chatml"])
    assert texts(tok, e) == ["\n\nFour.<|im_end|>"] and e.boundary_merged == 1


# ----------------------------------------------------------------------- bug 3: Qwen3 think blocks
REASONING = [
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is six."},
]
REASONING_FIELD = [
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "It is six.", "reasoning_content": "add again"},
]


@pytest.mark.parametrize("msgs", [REASONING, REASONING_FIELD], ids=["think-in-content", "reasoning_content"])
@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_qwen3_think_block_is_prompt_without_thinking_and_trained_from_its_opener_with(msgs, tok_name):
    """Bug 3: with enable_thinking=false the span started inside the think block (``add again\\n</think>
    \\n\\nIt is six.<|im_end|>`` trained, its opener not). Now the record's think block is prompt (the
    generation prompt pre-fills an empty one at inference); with enable_thinking=true the whole block is
    trained from ``<think>``."""
    tok = TOKENIZERS[tok_name]()
    off = example(tok, {"messages": msgs}, template=TEMPLATES["qwen3"])
    assert texts(tok, off) == ["It is six.<|im_end|>"]
    assert "add again" in tok.decode(off.input_ids)  # the reasoning stays in the prompt
    on = example(tok, {"messages": msgs}, template=TEMPLATES["qwen3"], enable_thinking=True)
    assert texts(tok, on) == ["<think>\nadd again\n</think>\n\nIt is six.<|im_end|>"]


# ----------------------------------------------------------------------------- the stop-token guard
def test_a_template_without_an_end_of_turn_token_is_refused_naming_the_record():
    """ChatML's ``<|im_end|>`` on a tokenizer that does not have it: the end of a turn would be trained
    as plain characters (no stop token); refused before anything is built."""
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    tok = load_tokenizer(ASSET_DIR, embedded=True)
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four."}]}
    with pytest.raises(
        ValueError, match=r"^f.jsonl:1: the chat template writes no special token .*'<\|im_end\|>"
    ):
        build_item_examples(items(rec), tok, settings(template=TEMPLATES["chatml"]))


class _Claims:
    """A tokenizer that lists special tokens it does not have as tokens (a tokenizer_config.json naming
    specials its tokenizer.json lacks): the template's end of turn is then split into characters."""

    def __init__(self, base, extra):
        self._base, self._extra = base, extra

    @property
    def all_special_tokens(self):
        return [*self._base.all_special_tokens, *self._extra]

    def __getattr__(self, name):
        return getattr(self._base, name)


def test_a_turn_whose_end_of_turn_is_not_one_trained_token_is_refused():
    """The stop-token guard, per record: the end-of-turn text is there but is not one special token, so no
    stop token would be trained: refused naming the record and why."""
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    tok = _Claims(load_tokenizer(ASSET_DIR, embedded=True), ["<|im_start|>", "<|im_end|>"])
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four."}]}
    with pytest.raises(
        ValueError,
        match=r"^f.jsonl:1: a trained turn does not end with a trained end-of-turn token \(one of <\|eos\|>, "
        r"<\|im_end\|>\): it ends with 'ssistant\\nFour.<\|im_end\|>', not tokenised as that special token",
    ):
        build_item_examples(items(rec), tok, settings(template=TEMPLATES["chatml"]))


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_a_conversation_cut_inside_its_last_answer_is_truncated_not_refused(tok_name):
    """Only a turn cut at context.max_tokens may lose its end-of-turn token: counted as truncated."""
    tok = TOKENIZERS[tok_name]()
    long = " ".join(["the answer is yes"] * 40)
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": long}]}
    e = example(tok, rec, template=TEMPLATES["chatml"], max_tokens=24)
    assert e.truncated and len(e.input_ids) == 24 and e.labels[-1] != IGNORE_INDEX


@pytest.mark.parametrize(
    "rec",
    [
        {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "2+2?"}]},
        {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "2+2?"}]},
    ],
    ids=["messages", "sharegpt"],
)
def test_an_assistant_first_conversation_is_refused_saying_so(rec):
    """It was refused as 'Cannot apply chat template to an empty conversation'."""
    with pytest.raises(
        ValueError, match=r"^f.jsonl:1: '(messages|conversations)' starts with an assistant turn"
    ):
        items(rec)


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("template", ["chatml", "qwen3", "llama3"])
def test_a_first_exchange_longer_than_the_context_is_cut_not_refused(tok_name, template):
    """docs/DATA.md: only when the newest exchange alone is too long is the sequence cut at max_tokens. It
    was refused with 'Cannot apply chat template to an empty conversation'."""
    tok = TOKENIZERS[tok_name]()
    user = " ".join(["what is the answer"] * 60)
    rec = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "It is yes."}]}
    e = example(tok, rec, template=TEMPLATES[template], max_tokens=48)
    assert e.truncated and len(e.input_ids) <= 48
    assert texts(tok, e)[-1].endswith("It is yes." + END_OF_TURN[template])  # the answer whole, stop trained


# ---------------------------------------------------------------------------------------- bug 5: length
LONG_PROMPT = {"prompt": "Context: " + "the answer is yes and " * 60 + "so: ", "completion": "It is yes."}


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_a_long_string_prompt_is_cut_from_its_start_keeping_the_completion(tok_name):
    """Bug 5: plain records kept their first tokens whatever context.truncation said, so a long prompt cut
    the completion away and stopped the run ('no trained token after masking'). Now the prompt is cut from
    its start (TRL's keep-end, LLaMA-Factory's cutoff) and the completion is whole, EOS trained."""
    tok = TOKENIZERS[tok_name]()
    e = example(tok, LONG_PROMPT, train_on="completion", max_tokens=32)
    assert len(e.input_ids) == 32 and e.truncated
    (text,) = texts(tok, e)
    assert text.endswith("It is yes." + tok.eos_token)
    full = tok(LONG_PROMPT["prompt"] + LONG_PROMPT["completion"] + tok.eos_token, add_special_tokens=False)
    assert e.input_ids == full["input_ids"][-32:]
    head = example(tok, LONG_PROMPT, train_on="completion", max_tokens=32, truncation="head", too_long="drop")
    assert head is None


def test_head_keeps_the_first_tokens_and_drop_and_error_do_what_they_say():
    tok = TOKENIZERS["bpe"]()
    short = {"prompt": "Q: ", "completion": "yes"}
    with pytest.raises(ValueError, match=r"^f.jsonl:1: no trained token after masking .*cut to context"):
        build_item_examples(
            items(LONG_PROMPT), tok, settings(train_on="completion", max_tokens=32, truncation="head")
        )
    both = items(LONG_PROMPT, short)
    kept = build_item_examples(both, tok, settings(train_on="completion", max_tokens=32, too_long="drop"))
    assert [e.where for e in kept] == ["f.jsonl:2"] and not kept[0].truncated
    from vramsweep.data.truncation import ContextOverflowError

    with pytest.raises(
        ContextOverflowError,
        match=r"^f.jsonl:1: \d+ tokens, the longest of 1 of 2 records .*\(data.too_long=error",
    ):
        build_item_examples(both, tok, settings(train_on="completion", max_tokens=32, too_long="error"))


def test_too_long_is_a_checked_setting():
    from vramsweep.config import compose
    from vramsweep.config.compose import ConfigError

    with pytest.raises(ConfigError, match=r"data.too_long.*truncate, drop, error|data.too_long"):
        compose(["data=grant_chat", "data.too_long=cut"])
    with pytest.raises(ConfigError, match=r"data.too_long=drop does not apply to data.source=embedded"):
        compose(["data.too_long=drop"])


def test_counts_of_truncated_dropped_and_merged_records_reach_meta_data_and_the_summary(
    tmp_path, monkeypatch
):
    import json

    from vramsweep.config import compose
    from vramsweep.data.prep import summary_line, trial_data
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    tok = load_tokenizer(ASSET_DIR, embedded=True)
    recs = [LONG_PROMPT, *[{"prompt": f"Q{i}: 2+2?\n", "completion": "Four."} for i in range(9)]]
    p, long = tmp_path / "pc.jsonl", tmp_path / "long.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    long.write_text(json.dumps(LONG_PROMPT) + "\n")
    base = ["data=file", f"data.path={p}", "context.max_tokens=64"]
    d = trial_data(compose(base), tok)
    assert (d.stats["train"]["truncated"], d.stats["eval"]["truncated"], len(d.train)) == (1, 0, 9)
    assert (d.stats["train"]["dropped"], d.stats["eval"]["dropped"]) == (0, 0)
    dropped = trial_data(compose([*base, "data.too_long=drop"]), tok)
    assert (dropped.stats["train"]["dropped"], dropped.stats["train"]["truncated"], len(dropped.train)) == (
        1,
        0,
        8,
    )
    line = summary_line(dropped.stats)
    assert line.startswith("data: prompt_completion, train_on=completion, too_long=drop: train 8 records"), (
        line
    )
    assert "truncated 0, dropped 1, boundary-merged 0; eval 1 records" in line, line
    with pytest.raises(ValueError, match=r"data.too_long=drop: all 1 held-out records are longer"):
        trial_data(compose([*base, "data.too_long=drop", f"data.eval_path={long}"]), tok)


# ------------------------------------------------------------------------------------------ tool calls
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_openai_tool_call_turns_render_through_a_template_that_supports_them(tok_name):
    """Bug 5: ``content: null`` + ``tool_calls`` was refused as "'content' must be a string". Qwen3's
    template renders the call, which is trained with its end-of-turn token."""
    tok = TOKENIZERS[tok_name]()
    e = example(tok, {"messages": TOOL_CHAT}, template=TEMPLATES["qwen3"])
    assert texts(tok, e) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>",
    ]


def test_a_template_that_drops_tool_calls_is_named():
    tok = TOKENIZERS["bpe"]()
    with pytest.raises(
        ValueError,
        match=r"^f.jsonl:1: the chat template \(data.chat_template=chatml\) does not render tool calls",
    ):
        build_item_examples(items({"messages": TOOL_CHAT}), tok, settings(template=TEMPLATES["chatml"]))


def test_the_preflight_prints_the_data_summary_line_once_every_check_passed(tmp_path, monkeypatch, capsys):
    import json

    from vramsweep.config import compose
    from vramsweep.preflight import preflight

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four.\n"}]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(10)))
    cfg = compose(["data=file", f"data.path={p}", f"results_dir={tmp_path / 'r'}"])
    capsys.readouterr()
    preflight(cfg)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("data: ")]
    from vramsweep.data.tokenizer import load_tokenizer
    from vramsweep.embedded import ASSET_DIR

    tok = load_tokenizer(ASSET_DIR, embedded=True)
    n = len(tok.apply_chat_template(chat)["input_ids"])
    k = len(tok("Four.\n<|eos|>", add_special_tokens=False)["input_ids"])  # the answer's tokens and its stop
    assert err == [
        f"data: messages, train_on=assistant, too_long=truncate: train 9 records, {9 * n} tokens ({9 * k} "
        f"trained), truncated 0, dropped 0, boundary-merged 0; eval 1 records, {n} tokens ({k} trained), "
        "truncated 0, dropped 0, boundary-merged 0"
    ]


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_qwen3_tool_chains_whose_earlier_reasoning_renders_differently_are_masked_by_their_openers(tok_name):
    """Qwen3 shows an assistant turn's reasoning only when no user message follows it, so the rendering of
    a prefix is not a prefix of the full rendering: spans found by prefix rendering started in the wrong
    turn (found by the property test). Counting the openers finds each turn."""
    tok = TOKENIZERS[tok_name]()
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nask the tool\n</think>\n\nLet me check."},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Welcome."},
    ]
    e = example(tok, {"messages": msgs}, template=TEMPLATES["qwen3"])
    assert texts(tok, e) == ["Let me check.<|im_end|>", "Sunny.<|im_end|>", "Welcome.<|im_end|>"]


def test_a_user_content_holding_the_opener_text_falls_back_to_prefix_rendering():
    """The openers cannot be counted (a user pasted ``<|im_start|>assistant``): the turn is found by
    rendering the prefix, with the same result."""
    tok = TOKENIZERS["bpe"]()
    msgs = [
        {"role": "user", "content": "Explain <|im_start|>assistant\n please"},
        {"role": "assistant", "content": "It opens a turn.\n"},
    ]
    e = example(tok, {"messages": msgs}, template=TEMPLATES["chatml"])
    assert texts(tok, e) == ["It opens a turn.\n<|im_end|>"]


def test_a_refused_preflight_says_only_its_error_and_a_passed_one_its_data_line(
    tmp_path, monkeypatch, capsys
):
    """Bad input is one error line (exit 2): when a check after the data step fails (here the host memory:
    this machine 'has' 1 MiB) the data summary line is not said before it, nor left over for the next
    pre-flight; a pre-flight that passes says its data line once."""
    import json

    from vramsweep import preflight as pf
    from vramsweep.config import compose
    from vramsweep.config.compose import ConfigError

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four."}]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(10)))
    cfg = compose(["data=file", f"data.path={p}", f"results_dir={tmp_path / 'r'}"])
    real = pf.available_host_bytes
    monkeypatch.setattr(pf, "available_host_bytes", lambda: 2**20)
    capsys.readouterr()
    with pytest.raises(ConfigError, match="RAM available on this machine"):
        pf.preflight(cfg)
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("data: ")]
    monkeypatch.setattr(pf, "available_host_bytes", real)
    pf.preflight(cfg)
    err = capsys.readouterr().err.splitlines()
    said = [ln for ln in err if ln.startswith("data: ")]
    assert (
        len(said) == 1
        and said[0].startswith("data: messages, train_on=assistant")
        and "train 9 records" in said[0]
    )
