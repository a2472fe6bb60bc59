"""``vramsweep check``: the default config passes every check; a deliberately broken stack fails the check
that covers it, with its figure, and exits 1; a bad override exits 2 and writes nothing.

The broken variants are the bugs the checks exist for: per-micro-batch mean losses instead of token-weighted
accumulation, bitsandbytes' CPU repacking of 4-bit weights left on (issue 49, item 1), a resume that does not
restore the optimizer state, the fp32 masters (issue 49, item 2) or the RNG, a trained span without its stop
token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vramsweep import check, loop
from vramsweep.cli import main
from vramsweep.data.examples import IGNORE_INDEX, Example

pytestmark = pytest.mark.usefixtures("embedded_model_dir")

LINE = re.compile(r"^(PASS|FAIL) (\w+): (.*) \(tolerance (\S+)( missing)?\)$")


def _run(capsys, *argv: str) -> tuple[int, dict[str, tuple[str, str, str]], str]:
    code = main(["check", *argv])
    out = capsys.readouterr()
    lines = {}
    for text in out.out.splitlines():
        if m := LINE.match(text):
            lines[m.group(2)] = (m.group(1), m.group(3), m.group(4))
    return code, lines, out.err


def _figure(text: str) -> float:
    """The relative difference a line reports (its last number before the tolerance)."""
    return float(re.findall(r"\d\.\de[+-]\d+", text)[-1])


def test_the_default_config_passes_every_check(capsys):
    code, lines, _ = _run(capsys)
    assert code == 0, lines
    assert set(lines) == {"accumulation", "eval_then_train", "packing", "resume", "stop_token"}
    assert all(verdict == "PASS" for verdict, _, _ in lines.values())
    for name in ("accumulation", "eval_then_train", "packing"):  # bf16 on a CPU with bf16, else fp32
        assert _figure(lines[name][1]) <= float(lines[name][2])
    assert re.search(
        r"[1-9]\d* trained spans of 64 records end with a trained stop token", lines["stop_token"][1]
    )


def test_per_micro_batch_means_fail_the_accumulation_check(capsys, monkeypatch):
    """Weighing each micro-batch's mean loss equally (the classic accumulation bug) is caught: the figure
    (~0.3 on the default config) is far above the tolerance; the other checks still pass."""
    monkeypatch.setattr(loop, "token_weights", lambda micro: [1 / len(micro)] * len(micro))
    code, lines, _ = _run(capsys, "train.dtype=fp32")
    assert code == 1
    verdict, figure, tol = lines["accumulation"]
    assert verdict == "FAIL" and "micro_batch=2 x grad_accum=2 vs 4 x 1" in figure
    assert _figure(figure) > 1e-2 > float(tol) == 1e-5
    assert {n: v for n, (v, _, _) in lines.items() if n != "accumulation"} == dict.fromkeys(
        ("eval_then_train", "packing", "resume", "stop_token"), "PASS"
    )


def test_bitsandbytes_cpu_repacking_fails_the_eval_then_train_check(capsys, monkeypatch):
    """With bitsandbytes' repacking for CPU inference left on (a CPU with AVX512-BF16, forced here), the
    LoRA gradients after an eval lose the part flowing through the 4-bit weights: FAIL with ~0.95."""
    import bitsandbytes.nn.modules as bnb_modules

    from vramsweep.knobs import quant

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(quant, "keep_trainable_4bit_layout", lambda model: 0)
    code, lines, _ = _run(capsys, "quant=nf4")
    assert code == 1
    verdict, figure, tol = lines["eval_then_train"]
    assert verdict == "FAIL" and _figure(figure) > 0.1 > float(tol)
    assert lines["accumulation"][0] == "PASS"


def test_attention_across_packed_examples_fails_the_packing_check(capsys, monkeypatch):
    """Packed rows whose segments are ignored (every token attends to the whole row, as in plain
    concatenation) give another loss than the records unpacked: FAIL with the figure."""
    from vramsweep.knobs import packed_attention

    monkeypatch.setattr(packed_attention, "segment_bounds", lambda pos: [[(0, pos.shape[1])]] * pos.shape[0])
    code, lines, _ = _run(capsys, "train.dtype=fp32")
    assert code == 1
    verdict, figure, tol = lines["packing"]
    assert verdict == "FAIL" and _figure(figure) > 1e-3 > float(tol)
    assert lines["accumulation"][0] == "PASS"


RESUMED = re.compile(r"(\d+)/(\d+) adapter tensors differ \(max \|diff\| (\S+)\), losses max \|diff\| (\S+)$")


def _resume_figures(figure: str) -> tuple[int, float, float]:
    m = RESUMED.search(figure)
    assert m, figure
    return int(m.group(1)), float(m.group(3)), float(m.group(4))


def test_a_resume_without_the_optimizer_state_fails_the_resume_check(capsys, monkeypatch):
    """A resume that loads the adapter and the scheduler but not the optimizer's moments (fresh AdamW
    state after the checkpoint): FAIL with the figure, exit 1; the other checks still pass."""
    from _resume import restore_without_optimizer_state

    restore_without_optimizer_state(monkeypatch)
    code, lines, _ = _run(capsys)
    assert code == 1
    verdict, figure, tol = lines["resume"]
    n_off, d_adapter, d_loss = _resume_figures(figure)
    assert verdict == "FAIL" and tol == "bitwise" and "4 steps vs stopped after 2 and resumed" in figure
    assert n_off > 0 and d_adapter > 1e-4 and d_loss > 1e-3
    assert all(v == "PASS" for n, (v, _, _) in lines.items() if n != "resume")


def _resume_line(*overrides: str) -> check.Line:
    """The resume check alone on the config's proxy (as ``run_checks`` builds it)."""
    cfg = check.compose(list(overrides))
    examples = check.trial_data(cfg, check.model_source(cfg)[1]).train[: check.N_RECORDS]
    small, vocab = check.proxy_examples(examples)
    return check.check_resume(check.proxy_config(cfg, packing=False, vocab=vocab)[0], small)


#: QLoRA's stack with bf16 adapters over fp32 masters (the long-context stack), 8-bit AdamW, dropout
QLORA_COMPUTE = ("quant=nf4", "adapter.dtype=compute", "train.dtype=bf16", "optimizer=adamw_8bit",
                 "adapter.dropout=0.1")  # fmt: skip


def test_the_resume_check_passes_bitwise_on_qlora_with_compute_adapters():
    line = _resume_line(*QLORA_COMPUTE)
    assert line.ok, line
    assert _resume_figures(line.figure) == (0, 0.0, 0.0)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param("masters", id="fp32-masters-not-restored"),  # issue 49, item 2
        pytest.param("rng", id="rng-not-restored", marks=pytest.mark.slow),
    ],
)
def test_a_resume_that_loses_the_masters_or_the_rng_fails_the_resume_check(monkeypatch, broken):
    """The masters the optimizer steps rebuilt from the fresh adapter (issue 49's bug: the training before
    the checkpoint lost), or the dropout masks drawn from a fresh RNG: FAIL with the figure."""
    from vramsweep.knobs import optim
    from vramsweep.production import checkpoint

    if broken == "masters":
        monkeypatch.setattr(optim.Fp32Master, "restore", lambda self, opt: 0)
    else:
        monkeypatch.setattr(checkpoint.Resume, "restore_rng", lambda self: None)
    line = _resume_line(*QLORA_COMPUTE)
    n_off, d_adapter, d_loss = _resume_figures(line.figure)
    assert not line.ok and str(line).startswith("FAIL resume: ")
    assert n_off > 0 and d_adapter > 0 and d_loss > 0


def test_a_bad_override_exits_2_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["check", "quant=nf5", f"results_dir={tmp_path / 'results'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("vramsweep check: error: ") and "quant" in err and "nf4" in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def _ex(labels: list[int], ids: list[int], truncated: bool = False) -> Example:
    return Example(
        ids, labels, doc_id="d", target_section=0, n_context_tokens=0, where="r:1", truncated=truncated
    )


class _Tok:
    eos_token_id = 9


def test_the_stop_token_check_fails_on_a_span_without_its_stop_token():
    cfg = check.compose(["context.max_tokens=64"])
    good = _ex([IGNORE_INDEX, 5, 9, IGNORE_INDEX, 6, 9], [1, 5, 9, 2, 6, 9])
    cut = _ex([IGNORE_INDEX, 5, 6], [1, 5, 6], truncated=True)
    assert check.check_stop_token(cfg, _Tok(), [good, cut], "documents").ok
    line = check.check_stop_token(cfg, _Tok(), [good, _ex([IGNORE_INDEX, 5, 6], [1, 5, 6])], "documents")
    assert (
        not line.ok
        and "2 trained spans of 2 records" in line.figure
        and "1 do not (first: r:1)" in line.figure
    )


def test_the_accumulation_examples_spread_over_trained_token_counts():
    ex = [_ex([IGNORE_INDEX] * (10 - k) + [1] * k, [1] * 10) for k in range(1, 9)]
    picked = [check.n_trained(e) for e in check.spread_by_trained(ex, 4)]
    assert picked[0] == 1 and picked[-1] == 8 and len(set(picked)) == 4


def test_a_gpu_config_runs_its_proxy_on_the_cpu_and_says_what_it_replaced(capsys):
    """A GPU profile is checked here too: the machine's rules apply to the proxy (which runs on the CPU),
    and each replacement is a note."""
    code = main(["check", "hardware=rtx4080_16gb", "attention=flash_attention_2", "train.dtype=bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "note: hardware.device=cuda runs on the CPU" in out
    assert "note: attention=flash_attention_2 runs as sdpa" in out
    assert "note: resume on the card is bitwise only with train.deterministic=true" in out
    assert out.count("\nPASS ") == 5


def test_records_all_cut_at_the_context_pass_and_say_no_stop_token_is_trained():
    cfg = check.compose(["context.max_tokens=64"])
    line = check.check_stop_token(
        cfg, _Tok(), [_ex([IGNORE_INDEX, 5, 6], [1, 5, 6], truncated=True)], "documents"
    )
    assert line.ok and "1 cut at context.max_tokens=64" in line.figure
    assert "no stop token is trained" in line.figure


SWEEP_DIR = Path(__file__).parents[2] / "sweeps"
SWEEPS = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_shipped_sweeps_baseline_passes(capsys, sweep):
    """``vramsweep check sweep=<name> <baseline>`` for every shipped sweep (GPU profiles on the CPU proxy):
    all 18 passed on 2026-12-06 with the resume line, 22-123 s each on a 2-core CPU at load average 15-18."""
    import yaml

    spec = yaml.safe_load((SWEEP_DIR / f"{sweep}.yaml").read_text())
    baseline = (spec.get("sweep") or {}).get("baseline") or []
    code, lines, err = _run(capsys, f"sweep={sweep}", *baseline)
    assert code == 0 and lines and all(v == "PASS" for v, _, _ in lines.values()), (lines, err)
