"""Real trials on the embedded tiny model: measured, recorded, and failures turned into data."""

from __future__ import annotations

import json

import pytest

from conftest import FAST
from vramsweep.cli import main
from vramsweep.config import compose
from vramsweep.record.result import STATUSES
from vramsweep.trial import run_trial

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


def _trial(tmp_path, *overrides, **kw):
    over = [*FAST, f"results_dir={tmp_path}", *overrides]
    cfg = compose(over)
    return run_trial(cfg, result_path=tmp_path / "r.json", overrides=over, **kw)


def test_default_trial_via_cli_learns_and_records(tmp_path, capsys):
    code = main(
        [
            "train",
            f"results_dir={tmp_path}",
            "train.steps=12",
            "data.num_docs=8",
            "data.num_eval_docs=2",
            "context.max_tokens=256",
            "train.eval_batches=2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, out
    assert out[-1].startswith("result: ")
    path = out[-1].split("result: ", 1)[1]
    res = json.loads(open(path).read())
    assert res["schema"] == 1 and res["status"] == "ok" and res["reason"] is None
    m = res["metrics"]
    assert m["peak_memory_bytes"] > 0 and m["memory_kind"] == "cpu_tracked"
    assert set(m["memory_breakdown_bytes"]) == {"params", "grads", "optimizer", "activations", "other"}
    assert sum(m["memory_breakdown_bytes"].values()) == m["peak_memory_bytes"]
    assert m["tokens_per_s"] > 0 and m["step_time_s"] > 0
    assert m["mfu"] is None  # CPU profile has no FLOP peak: null, not a made-up figure
    assert m["eval_loss"] < m["initial_eval_loss"] - 0.03, (m["initial_eval_loss"], m["eval_loss"])
    assert m["eval_ppl"] == pytest.approx(2.718281828 ** m["eval_loss"], rel=1e-6)
    assert res["config"]["train"]["steps"] == 12
    assert res["meta"]["versions"]["torch"] and res["meta"]["wall_s"] > 0
    assert res["meta"]["build"]["adapter"]["type"] == "lora"


def test_qlora_stack_records_smaller_params_and_optimizer(tmp_path):
    small = _trial(
        tmp_path / "a", "quant=nf4_dq", "adapter=rslora", "optimizer=adamw_8bit", "checkpointing=on"
    )
    big = _trial(tmp_path / "b", "quant=none", "adapter=lora", "optimizer=adamw")
    assert small["status"] == big["status"] == "ok", (small["reason"], big["reason"])
    s, b = small["metrics"]["state_bytes"], big["metrics"]["state_bytes"]
    assert s["params"] + s["optimizer"] < b["params"] + b["optimizer"]
    assert s["params"] < b["params"] and s["optimizer"] < b["optimizer"]


def test_injected_oom_is_classified(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FAULT", "oom@0")
    res = _trial(tmp_path)
    assert res["status"] == "oom" and "out of memory" in res["reason"].lower()
    assert res["metrics"]["initial_eval_loss"] is not None  # partial metrics kept
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "oom"


def test_injected_nan_is_diverged(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FAULT", "nan@1")
    res = _trial(tmp_path)
    assert res["status"] == "diverged" and "step 1" in res["reason"]


def test_reporter_prunes_and_keeps_partial_metrics(tmp_path):
    calls = []

    def reporter(step, loss):
        calls.append((step, loss))
        return True

    res = _trial(tmp_path, "train.eval_every=3", "train.steps=6", reporter=reporter)
    assert res["status"] == "pruned"
    assert calls and calls[0][0] == 3
    assert res["metrics"]["intermediate_eval"][0]["step"] == 3
    assert res["metrics"]["peak_memory_bytes"] > 0


def test_unsupported_option_is_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSWEEP_FORCE_NO_CUDA", "1")
    cfg = compose([*FAST, "attention=flash_attention_2"], rules="none")
    res = run_trial(cfg, result_path=tmp_path / "u.json")
    assert res["status"] == "unsupported" and "flash_attention_2" in res["reason"]
    assert res["status"] in STATUSES


def test_wandb_offline_one_run_per_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    a = _trial(tmp_path / "a", "logger=wandb", f"logger.dir={tmp_path / 'wb'}")
    b = _trial(tmp_path / "b", "logger=wandb", f"logger.dir={tmp_path / 'wb'}")
    assert a["status"] == b["status"] == "ok"
    assert a["meta"]["wandb"]["mode"] == "offline"
    assert a["meta"]["wandb"]["run_id"] != b["meta"]["wandb"]["run_id"]
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2


def test_local_model_path_and_arch_only_models(tmp_path, embedded_model_dir):
    res = _trial(tmp_path / "p", "model=local", f"model.path={embedded_model_dir}")
    assert res["status"] == "ok", res["reason"]
    arch = _trial(tmp_path / "a", "model.source=arch", "model.name=arch_tiny", "model.num_layers=2")
    assert arch["status"] == "ok", arch["reason"]
    assert arch["meta"]["data"]["random_tokens"] is True
    assert arch["metrics"]["task_score"] is None


def test_vocab_sliced_trains_end_to_end(tmp_path):
    full = _trial(tmp_path / "f")
    res = _trial(tmp_path / "s", "vocab=sliced")
    assert res["status"] == "ok", res["reason"]
    v = res["meta"]["build"]["vocab"]
    assert v["kept"] < v["original"] == 3072
    # tied embedding: the saving is exactly (V - V') * h * 2 bytes (bf16), measured on the built model
    saved = full["metrics"]["state_bytes"]["params"] - res["metrics"]["state_bytes"]["params"]
    assert saved == (v["original"] - v["kept"]) * 256 * 2
    assert res["metrics"]["eval_loss"] is not None and res["metrics"]["tokens_per_s"] > 0


def test_peak_includes_optimizer_state_and_activations_whatever_the_warmup(tmp_path):
    """Issue: measure_warmup_steps=1 reported 60.3 MiB with optimizer 0.00 MiB (vs 62.7 / 2.38 with 2
    warm-up steps), and measure_warmup_steps=0 closed the tracker before step 0 (peak 8.7 MiB = the
    weights, activations 0)."""
    res = {
        w: _trial(tmp_path / f"w{w}", "train.steps=3", f"train.measure_warmup_steps={w}") for w in (0, 1, 2)
    }
    ref = res[2]["metrics"]
    assert ref["memory_breakdown_bytes"]["optimizer"] > 0
    for w in (0, 1):
        m = res[w]["metrics"]
        assert res[w]["status"] == "ok", res[w]["reason"]
        bd = m["memory_breakdown_bytes"]
        assert bd["optimizer"] == ref["memory_breakdown_bytes"]["optimizer"], (w, bd)
        assert bd["activations"] > 0.5 * ref["memory_breakdown_bytes"]["activations"], (w, bd)
        assert sum(bd.values()) == m["peak_memory_bytes"]
        assert m["peak_memory_bytes"] == pytest.approx(ref["peak_memory_bytes"], rel=0.03), w
        assert m["tokens_per_s"] > 0  # timed steps still exist (the tracked step 0 is not timed)


def test_step_phases_recorded_and_consistent(tmp_path):
    res = _trial(tmp_path)
    ph = res["meta"]["step_phases_s"]
    assert set(ph) >= {"h2d", "forward", "backward", "optimizer", "sync_wait", "loss_sync", "other", "step"}
    assert ph["forward"] > 0 and ph["backward"] > 0
    assert ph["loss_sync"] == 0.0 and "device_s" not in ph  # CPU: no sync point, no CUDA events
    parts = sum(ph[k] for k in ("h2d", "forward", "backward", "optimizer", "sync_wait", "loss_sync", "other"))
    assert parts == pytest.approx(ph["step"], rel=1e-3)
    assert ph["step"] == pytest.approx(res["metrics"]["step_time_s"], rel=0.05)
    assert ph["host_bound"] is False  # CPU: every phase is compute
    tc = res["meta"]["timing_conditions"]  # what can disturb the tokens/s, recorded beside it
    assert tc["cpu_count"] >= 1 and tc["torch_threads"] >= 1
    assert len(tc["loadavg"]) == 3 and len(tc["loadavg_end"]) == 3
