"""Fact vs control token metrics (measure/quality.py): unit checks and real trials on the embedded model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import FAST
from vramsweep.measure.quality import QUALITY_KEYS, QualityMeter, fact_mask


def test_meter_splits_fact_and_control_tokens():
    # input ids 0..6; labels are the shifted ids, the first two positions are prompt (not scored)
    labels = torch.tensor([-100, -100, 12, 13, 14, 15])
    pred = torch.tensor([9, 9, 12, 0, 14, 0])  # hits at label positions 2 and 4
    nll = torch.tensor([7.0, 7.0, 0.5, 2.0, 1.0, 3.0])
    meter = QualityMeter()
    meter.add(nll, pred, labels, [(4, 6)])  # input positions 4, 5 -> label positions 3, 4
    got = meter.metrics()
    assert list(got) == list(QUALITY_KEYS)
    assert got["fact_tokens"] == 2 and got["control_tokens"] == 2
    assert got["fact_token_acc"] == 0.5 and got["fact_nll"] == pytest.approx(1.5)
    assert got["control_token_acc"] == 0.5 and got["control_nll"] == pytest.approx(1.75)
    # a second sequence without facts only moves the control set
    meter.add(torch.tensor([0.25]), torch.tensor([3]), torch.tensor([3]), [])
    got = meter.metrics()
    assert got["fact_tokens"] == 2 and got["control_tokens"] == 3
    assert got["control_token_acc"] == pytest.approx(2 / 3)
    assert got["control_nll"] == pytest.approx((0.5 + 3.0 + 0.25) / 3)


def test_meter_empty_sets_are_none_not_zero():
    got = QualityMeter().metrics()
    assert got["fact_token_acc"] is None and got["fact_nll"] is None and got["fact_tokens"] == 0
    meter = QualityMeter()
    meter.add(torch.tensor([1.0]), torch.tensor([1]), torch.tensor([1]), [])
    assert meter.metrics()["fact_token_acc"] is None and meter.metrics()["control_token_acc"] == 1.0


def test_fact_mask_rejects_spans_outside_the_sequence():
    assert fact_mask(4, [(1, 3)]).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match=r"fact span \(0, 2\) is outside"):
        fact_mask(4, [(0, 2)])
    with pytest.raises(ValueError, match="outside"):
        fact_mask(4, [(3, 7)])


def _run(tmp_path, *overrides):
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    fast = FAST
    if any(o.startswith("data=jsonl") for o in overrides):  # the record counts are the file's
        fast = [o for o in FAST if not o.startswith(("data.num_docs=", "data.num_eval_docs="))]
    over = [*fast, f"results_dir={tmp_path}", *overrides]
    return run_trial(compose(over), result_path=tmp_path / "r.json", overrides=over)


@pytest.mark.usefixtures("embedded_model_dir")
def test_trial_records_quality_metrics_that_add_up_to_eval_loss(tmp_path):
    res = _run(tmp_path, "train.eval_batches=2", "data.num_eval_docs=2")
    assert res["status"] == "ok", res["reason"]
    m = res["metrics"]
    assert m["fact_tokens"] > 0 and m["control_tokens"] > 0
    assert 0.0 <= m["fact_token_acc"] <= 1.0 and 0.0 <= m["control_token_acc"] <= 1.0
    # the two sets partition the scored target tokens: their token-weighted NLL is the eval loss
    total = m["fact_tokens"] + m["control_tokens"]
    mixed = (m["fact_nll"] * m["fact_tokens"] + m["control_nll"] * m["control_tokens"]) / total
    assert mixed == pytest.approx(m["eval_loss"], rel=1e-5)
    # every fact span counted by the exact-match task score is in the fact set (spans have >= 1 token)
    assert m["task_spans"] >= 1 and m["fact_tokens"] >= m["task_spans"]
    saved = json.loads((tmp_path / "r.json").read_text())["metrics"]
    for k in ("fact_token_acc", "fact_nll", "control_token_acc", "control_nll"):
        assert saved[k] == pytest.approx(m[k]) and math.isfinite(saved[k])


@pytest.mark.usefixtures("embedded_model_dir")
def test_jsonl_without_facts_has_no_fact_metrics_and_control_is_eval_loss(tmp_path):
    from vramsweep.data.documents import write_jsonl
    from vramsweep.data.synthetic import generate_documents

    docs = [{**d, "facts": []} for d in generate_documents(3, 5)]
    write_jsonl(docs, tmp_path / "d.jsonl")
    res = _run(tmp_path, "data=jsonl", f"data.path={tmp_path / 'd.jsonl'}")
    assert res["status"] == "ok", res["reason"]
    m = res["metrics"]
    assert m["fact_token_acc"] is None and m["fact_nll"] is None and m["fact_tokens"] == 0
    assert m["task_score"] is None
    assert m["control_nll"] == pytest.approx(m["eval_loss"], rel=1e-6)


@pytest.mark.usefixtures("embedded_model_dir")
def test_jsonl_fact_spans_are_scored_like_the_synthetic_ones(tmp_path):
    from vramsweep.data.documents import write_jsonl
    from vramsweep.data.synthetic import generate_documents

    docs = generate_documents(3, 5)
    write_jsonl(docs, tmp_path / "d.jsonl")
    write_jsonl(generate_documents(2, 6), tmp_path / "e.jsonl")
    over = ["data=jsonl", f"data.path={tmp_path / 'd.jsonl'}", f"data.eval_path={tmp_path / 'e.jsonl'}"]
    res = _run(tmp_path, *over, "train.eval_batches=2")
    assert res["status"] == "ok", res["reason"]
    m = res["metrics"]
    assert m["fact_tokens"] > 0 and m["fact_token_acc"] is not None and m["task_spans"] > 0


# ------------------------------------------------------------------------------------ the embedded model
def _score(model, tokenizer, docs, max_tokens=4096):
    from vramsweep.data.examples import build_examples
    from vramsweep.data.prep import collate_batch
    from vramsweep.measure.eval import evaluate

    ex = build_examples(
        docs,
        tokenizer,
        max_tokens=max_tokens,
        truncation="none",
        decay=0.5,
        min_tokens_per_section=16,
        instructions="Write the next section of the report.",
    )
    ex = [e for e in ex if e.fact_spans]  # the financial summaries and conclusions
    meter = QualityMeter()
    ev = evaluate(
        model,
        [collate_batch(ex[i : i + 4], tokenizer.pad_token_id) for i in range(0, len(ex), 4)],
        "cpu",
        meter=meter,
    )
    return {**meter.metrics(), "task_score": ev.task_score}


@pytest.mark.slow
def test_embedded_model_copies_facts_only_when_their_statement_is_in_context(embedded_model_dir):
    """The pre-trained base (no fine-tuning) copies fact values from their statements: fact accuracy with
    the whole document in context clearly above the same documents with the stating sections removed, and
    a higher fact NLL without them, while the control tokens (no long context needed) barely move.
    Measured for the committed base (CPU, README): 0.316 vs 0.168 (fact_nll 3.53 vs 4.05; control 0.933 vs
    0.915) -- per token it copies start dates, work-package counts, some surnames and acronym endings; the
    remaining floor is format tokens such as the thousands commas. Fails for the old 100-step base (0.07
    vs 0.06) and for a fact metric that ignored the spans."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vramsweep.data.synthetic import generate_documents, without_statements

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    docs = generate_documents(6, 1234 + 100_003)  # the default eval documents
    full = _score(model, tok, docs)
    cut = _score(model, tok, [without_statements(d) for d in docs])
    print("full", full, "\nno statements", cut)
    assert full["fact_tokens"] == cut["fact_tokens"] > 50
    assert full["fact_token_acc"] >= 0.25, full
    assert cut["fact_token_acc"] <= full["fact_token_acc"] - 0.1, (full, cut)
    assert cut["fact_nll"] >= full["fact_nll"] + 0.3, (full, cut)
    assert abs(full["control_token_acc"] - cut["control_token_acc"]) <= 0.05, (full, cut)
    assert abs(full["control_nll"] - cut["control_nll"]) <= 0.25, (full, cut)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


@pytest.mark.slow
def test_truncation_ablation_separates_strategies_above_seed_noise(tmp_path, embedded_model_dir):
    """``sweeps/truncation_quality.yaml`` for real (3 strategies x 3 seeds at 512 tokens, documents of
    2-3.3k). What each strategy keeps decides which facts the base can copy: tail keeps the newest sections,
    which include the timeline's opening sentence ("The project starts on 19 March 2026"), and the base
    copies the date from there; head keeps the summary, consortium and objectives, whose repeats the base
    mostly cannot copy (the acronym's first token differs at a line start, first names follow "Prof.",
    counts are repeated in other words): acronym endings and a surname; exp_decay keeps the *ends* of the older sections,
    while the statements open them. So tail must beat head and exp_decay on fact accuracy by more than twice
    the pooled seed std (and by 3 fact tokens of 95 at least), while the control tokens lose less than a third
    as much in relative terms: lost context, not a worse model. Fails for a base that does not copy (all three
    at chance)."""
    from vramsweep.sweeper import run_multirun

    rc = run_multirun(["sweep=truncation_quality", f"results_dir={tmp_path}"])
    assert rc == 0
    trials = [
        json.loads(p.read_text())
        for p in sorted((tmp_path / "sweeps" / "truncation_quality" / "trials").glob("*.json"))
    ]
    assert len(trials) == 9 and {t["status"] for t in trials} == {"ok"}
    by: dict[str, dict[str, list[float]]] = {}
    for t in trials:
        s = by.setdefault(t["config"]["context"]["truncation"], {})
        for k in ("fact_token_acc", "control_token_acc", "task_score"):
            s.setdefault(k, []).append(t["metrics"][k])
    assert set(by) == {"head", "tail", "exp_decay"} and all(
        len(v["fact_token_acc"]) == 3 for v in by.values()
    )
    stats = {s: {k: _mean_std(v) for k, v in d.items()} for s, d in by.items()}
    print(json.dumps(stats, indent=1))
    tail_m, tail_s = stats["tail"]["fact_token_acc"]
    for other in ("head", "exp_decay"):
        m, s = stats[other]["fact_token_acc"]
        pooled = ((tail_s**2 + s**2) / 2) ** 0.5
        assert tail_m - m > max(2 * pooled, 0.03), (other, stats)
        c_tail, c = stats["tail"]["control_token_acc"][0], stats[other]["control_token_acc"][0]
        # lost context, not a worse model: facts lose (relatively) 3x more than the control tokens
        assert (tail_m - m) / tail_m > 3 * abs(c_tail - c) / c_tail, (other, stats)


def test_readme_jsonl_fact_example_gives_a_fact_span(tmp_path):
    """docs/DATA.md's marked-fact example loads and its repeated value becomes a scored fact span."""
    from transformers import PreTrainedTokenizerFast

    from vramsweep.data.documents import load_jsonl
    from vramsweep.data.examples import build_examples
    from vramsweep.data.synthetic import pretrain_texts
    from vramsweep.data.tokenizer import train_tokenizer

    line = (
        '{"sections": [{"heading": "Summary", "text": "ACME is led by Ada Byron."}, {"heading": "Conclusions", '
        '"text": "In short, ACME is led by Ada Byron."}], "facts": [{"key": "lead", "value": "Ada Byron", '
        '"stated_in": 0, "repeated_in": [1]}]}'
    )
    assert line in open("docs/DATA.md").read().replace("\n", " ").replace("  ", " ")
    (tmp_path / "d.jsonl").write_text(line + "\n")
    (doc,) = load_jsonl(tmp_path / "d.jsonl")
    tok = train_tokenizer(pretrain_texts(4, 0), vocab_size=600)
    assert isinstance(tok, PreTrainedTokenizerFast)
    (ex,) = build_examples(
        [doc], tok, max_tokens=256, truncation="tail", decay=0.5, min_tokens_per_section=16, instructions="x"
    )
    ((s, e),) = ex.fact_spans
    assert tok.decode(ex.input_ids[s:e]).strip() == "Ada Byron"
