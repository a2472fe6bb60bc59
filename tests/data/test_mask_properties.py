"""Property: on every generated record, the trained tokens are exactly what the template renders for the
assistant turns plus their end-of-turn token — on three tokenizer families x three chat templates
(tests/data/_tokenizers.py, tests/fixtures/chat_templates). Records mix leading/trailing whitespace and
newlines, unicode, empty and absent system prompts, multi-turn, tool turns and reasoning (a think block in
the content or a ``reasoning_content`` field), with and without ``enable_thinking``.

The expected text of each turn comes from an oracle written here from each template's rules (ChatML shows
the content as is; Llama 3 trims it; Qwen3 moves reasoning into a think block, which is prompt with
``enable_thinking=false``), not from the code under test. A token that straddles the boundary (a
byte-level BPE joining the template's ``\\n`` with an answer's leading ``\\n``) is trained and counted:
its prompt-side characters are the only text a run may hold before the turn's rendering."""

from __future__ import annotations

import pytest
from _tokenizers import END_OF_TURN, TEMPLATES, TOKENIZERS, UNICODE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_masks import items, runs, texts
from test_masks import settings as render_settings

from vramsweep.data.render import build_item_examples

WS = st.text(alphabet=" \n\t", max_size=3)
CORE = st.text(
    alphabet=st.sampled_from(
        list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,:;!?'\"()-\n") + list(UNICODE)
    ),
    min_size=1,
    max_size=24,
).filter(lambda t: t.strip())
TEXT = st.builds(lambda a, c, b: a + c + b, WS, CORE, WS)


@st.composite
def assistant(draw) -> dict:
    content = draw(TEXT)
    how = draw(st.sampled_from(["plain", "plain", "think", "field"]))
    if how == "think":
        return {"role": "assistant", "content": f"<think>\n{draw(CORE)}\n</think>\n\n{content}"}
    if how == "field":
        return {"role": "assistant", "content": content, "reasoning_content": draw(CORE)}
    return {"role": "assistant", "content": content}


@st.composite
def conversation(draw) -> list[dict]:
    msgs: list[dict] = []
    system = draw(st.sampled_from(["absent", "empty", "text"]))
    if system != "absent":
        msgs.append({"role": "system", "content": "" if system == "empty" else draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(TEXT)})
        if draw(st.booleans()):  # a tool round: the assistant's call, the tool's answer
            msgs.append(draw(assistant()))
            msgs.append({"role": "tool", "content": draw(TEXT)})
        msgs.append(draw(assistant()))
    return msgs


def _split_think(m: dict) -> tuple[str, str | None]:
    """(content, reasoning) as Qwen3's template reads them (None: no reasoning given)."""
    content = m["content"]
    if isinstance(m.get("reasoning_content"), str):
        return content, m["reasoning_content"]
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return content.split("</think>")[-1].lstrip("\n"), reasoning
    return content, None


def expected(template: str, msgs: list[dict], thinking: bool) -> list[str]:
    """The text each assistant turn trains, by the template's rules (module docstring)."""
    eot = END_OF_TURN[template]
    if template == "chatml":
        return [m["content"] + eot for m in msgs if m["role"] == "assistant"]
    if template == "llama3":
        return [m["content"].strip() + eot for m in msgs if m["role"] == "assistant"]
    last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        content, reasoning = _split_think(m)
        if i > last_query and (i == len(msgs) - 1 or reasoning):
            answer = content.lstrip("\n")
            block = "<think>\n" + (reasoning or "").strip("\n") + "\n</think>\n\n"
            out.append((block if thinking else "") + answer + eot)
        else:
            out.append(content + eot)
    return out


@pytest.mark.parametrize("template", ["chatml", "qwen3", "llama3"])
@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversation(), thinking=st.booleans())
def test_trained_text_is_the_templates_rendering_of_the_assistant_turns(tok_name, template, msgs, thinking):
    tok = TOKENIZERS[tok_name]()
    s = render_settings(template=TEMPLATES[template], enable_thinking=thinking)
    (e,) = build_item_examples(items({"messages": msgs}), tok, s)
    want = expected(template, msgs, thinking)
    got = texts(tok, e)
    assert len(got) == len(want), (got, want)
    merged = 0
    full = tok.decode(e.input_ids)
    for g, w, (a, _) in zip(got, want, runs(e)):
        assert g.endswith(w), (g, w)
        extra = g[: len(g) - len(w)]
        if extra:  # only the prompt-side characters of one straddling token: its text holds them and more
            merged += 1
            first = tok.decode(e.input_ids[: a + 1])[len(tok.decode(e.input_ids[:a])) :]
            assert "\ufffd" in first or (first.startswith(extra) and len(first) > len(extra)), (first, extra)
    assert e.boundary_merged == merged
    assert full.count(END_OF_TURN[template]) >= len(want)
    for _, b in runs(e):
        assert e.input_ids[b - 1] == tok.convert_tokens_to_ids(END_OF_TURN[template])


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@settings(max_examples=40, deadline=None)
@given(prompt=st.builds(lambda c, b: c + b, CORE, WS), completion=TEXT)
def test_a_completion_is_trained_from_the_first_token_that_differs_from_the_prompts(
    tok_name, prompt, completion
):
    """Plain prompt/completion strings: TRL's split, exactly; the trained text holds the whole completion."""
    tok = TOKENIZERS[tok_name]()
    (e,) = build_item_examples(
        items({"prompt": prompt, "completion": completion}), tok, render_settings(train_on="completion")
    )
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    full = tok(prompt + completion + tok.eos_token, add_special_tokens=False)["input_ids"]
    n = next((i for i, (x, y) in enumerate(zip(p, full)) if x != y), min(len(p), len(full)))
    assert e.input_ids == full
    assert [i for i, t in enumerate(e.labels) if t != -100] == list(range(n, len(full)))
    (text,) = texts(tok, e)
    assert text.endswith(completion + tok.eos_token)
    assert e.boundary_merged == int(n < len(p))
