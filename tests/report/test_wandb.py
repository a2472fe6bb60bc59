"""W&B as its users read it, checked on the offline run files with W&B's own record schema.

Every assertion reads ``<dir>/wandb/offline-run-*/run-*.wandb`` back (``tests/_wandb_records.py``:
the log framing + ``wandb.proto.wandb_internal_pb2.Record``); nothing about W&B is mocked except the
injected failures of the "never fails because W&B does" tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from _reports import BASE, ablation_results, result, write_sweep
from _wandb_records import offline_runs, read_run
from vramsweep.record.result import atomic_write_json, new_result
from vramsweep.record.units import GIB as G


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("VRAMSWEEP_SWEEP_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # keep $HOME clean
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def _cfg(tmp_path: Path, extra: list[str] = ()):
    from vramsweep.config import compose

    return compose(
        ["logger=wandb", f"results_dir={tmp_path / 'results'}", "quant=nf4", "adapter.r=16", *extra],
        rules="none",
    )


def _finished(res: dict, status: str = "ok") -> dict:
    """Fill a result the way the trial loop does at the end (numbers are synthetic but typed right)."""
    res["status"] = status
    res["reason"] = None if status == "ok" else "OutOfMemoryError: CUDA out of memory (synthetic)"
    m = res["metrics"]
    if status == "ok":
        m.update(
            {
                "peak_memory_bytes": 2 * G,
                "memory_kind": "cuda_reserved",
                "memory_breakdown_bytes": {
                    "params": G,
                    "grads": 0,
                    "optimizer": G // 4,
                    "activations": G // 2,
                },
                "tokens_per_s": 1234.5,
                "step_time_s": 0.25,
                "mfu": 0.31,
                "eval_loss": 2.5,
                "eval_ppl": math.exp(2.5),
                "task_score": 0.5,
                "state_bytes": {"params": G, "grads": 0, "optimizer": G // 4},
            }
        )
    res["estimate"] = {
        "peak_memory_bytes": int(2.2 * G),
        "breakdown_bytes": {"params": G, "activations": G},
        "peak_phase": "loss",
        "fits": True,
    }
    res["meta"].update(
        {
            "device": "NVIDIA H200",
            "hardware_profile": "rtx4090_24gb",
            "hardware_emulation": {
                "profile": "rtx4090_24gb",
                "physical_device": "NVIDIA H200",
                "emulated": True,
            },
            "mfu": {
                "device": "NVIDIA H200",
                "flops_per_token": 1.2e9,
                "peak_key": "h200",
                "peak_flops": 989e12,
            },
            "step_phases_s": {
                "forward": 0.1,
                "backward": 0.12,
                "optimizer": 0.03,
                "step": 0.25,
                "host_bound": False,
                "device_s": {"forward": 0.2, "step": 0.24},
            },
            "wall_s": 12.5,
            "git_sha": "abc123",
        }
    )
    return res


def _run_trial_logger(
    tmp_path: Path, *, status: str = "ok", sweep_dir: Path | None = None, design=None
) -> dict:
    from vramsweep.report.wandb_run import start_logger

    cfg = _cfg(tmp_path)
    res = new_result(sweep="sw", trial=7, overrides=["quant=nf4", "adapter.r=16", "logger=wandb"], config={})
    res["meta"]["design"] = design or {
        "kind": "ablation",
        "role": "factor",
        "change": ["quant=nf4"],
        "repeat": 0,
    }
    logger = start_logger(cfg, name="sw-0007", group="sw", result=res, sweep_dir=sweep_dir)
    assert logger is not None, res["meta"]["wandb"]
    for k in range(1, 4):
        if k == 3:
            logger.log({"eval/loss": 2.6}, step=2)  # the loop logs an eval right after its step's row
        logger.log(
            {
                "train/loss": 3.0 / k,
                "train/lr": 1e-3,
                "train/step_time_s": 0.25,
                "memory/allocated_bytes": k * 1000,
                "memory/peak_reserved_bytes": 5000,
            },
            step=k,
        )
    logger.finish(_finished(res, status))
    return res


# ---------------------------------------------------------------------------------------------
# trial runs
# ---------------------------------------------------------------------------------------------
def test_trial_run_job_type_tags_config_history_summary(tmp_path: Path) -> None:
    res = _run_trial_logger(tmp_path)
    runs = offline_runs(tmp_path / "results" / "wandb")
    assert len(runs) == 1
    run = runs[0]
    assert res["meta"]["wandb"]["run_id"] == run.run_id and res["meta"]["wandb"]["mode"] == "offline"
    assert (run.job_type, run.name, run.group, run.project) == ("trial", "sw-0007", "sw", "vramsweep")
    # tags: design role + option names at start, status at finish
    assert {"design:ablation", "quant:nf4", "kernels:none", "adapter:lora", "status:ok"} <= set(run.tags)
    # config: trial number, sweep, varied knobs typed at top level, composed config nested
    c = run.config
    assert c["trial"] == 7 and c["sweep"] == "sw"
    assert c["quant"] == "nf4" and c["adapter.r"] == 16 and c["logger"] == "wandb"
    assert c["config"]["adapter"]["r"] == 16 and c["config"]["quant"]["name"] == "nf4"
    assert c["design"]["kind"] == "ablation" and c["overrides"] == [
        "quant=nf4",
        "adapter.r=16",
        "logger=wandb",
    ]
    # history: one row per optimizer step (+ the eval row merged into step 2)
    steps = [h["_step"] for h in run.history]
    assert steps == [1, 2, 3]
    assert [h["train/loss"] for h in run.history] == [3.0, 1.5, 1.0]
    assert run.history[1]["eval/loss"] == 2.6
    assert all("memory/allocated_bytes" in h and "train/step_time_s" in h for h in run.history)
    # summary: memory breakdown, estimate and its error, MFU, device, status, throughput, eval
    s = run.summary
    assert s["status"] == "ok" and s["reason"] == ""  # the key is always there (README)
    assert s["memory/peak_bytes"] == 2 * G and s["memory/kind"] == "cuda_reserved"
    assert s["memory/breakdown/params_bytes"] == G and s["memory/breakdown/activations_bytes"] == G // 2
    assert s["memory/state/optimizer_bytes"] == G // 4
    assert s["estimate/peak_bytes"] == int(2.2 * G)
    assert s["estimate/error"] == pytest.approx(int(2.2 * G) / (2 * G) - 1)
    assert s["estimate/breakdown/activations_bytes"] == G and s["estimate/peak_phase"] == "loss"
    assert s["mfu"] == 0.31 and s["mfu/peak_flops"] == 989e12 and s["mfu/peak_key"] == "h200"
    assert s["git_sha"] == "abc123" and s["wall_s"] == 12.5
    assert s["device"] == "NVIDIA H200" and s["hardware_emulation/emulated"] is True
    assert s["step_phase/backward_s"] == 0.12 and "step_phase/host_bound_s" not in s
    assert s["step_phase/device/forward_s"] == 0.2 and s["step_phase/device/step_s"] == 0.24  # CUDA events
    assert s["tokens_per_s"] == 1234.5 and s["train/tokens_per_s"] == 1234.5
    assert s["eval/loss"] == 2.5 and s["eval/ppl"] == pytest.approx(math.exp(2.5))
    assert run.exit_code == 0


def test_failed_trial_tags_status_and_reason(tmp_path: Path) -> None:
    _run_trial_logger(tmp_path, status="oom", design={"kind": "ablation", "role": "baseline", "change": []})
    run = offline_runs(tmp_path / "results" / "wandb")[0]
    assert "status:oom" in run.tags and "status:ok" not in run.tags and "design:baseline" in run.tags
    assert run.summary["status"] == "oom" and "out of memory" in run.summary["reason"]
    assert "memory/peak_bytes" not in run.summary  # nothing measured, nothing invented
    assert run.exit_code == 1


@pytest.mark.parametrize(
    ("design", "role"),
    [
        ({"kind": "ablation", "role": "baseline"}, "baseline"),
        ({"kind": "ablation", "role": "factor"}, "ablation"),
        ({"kind": "stacking", "step": 0}, "baseline"),
        ({"kind": "stacking", "step": 2}, "stacking"),
        ({"kind": "search", "sampler": "tpe"}, "search"),
        ({"kind": "search", "sampler": "grid"}, "grid"),  # as the summary run's design:grid
        (None, None),
    ],
)
def test_design_role(design: dict | None, role: str | None) -> None:
    from vramsweep.report.wandb_run import design_role

    assert design_role(design) == role


def test_trial_runs_go_to_the_sweep_folder(tmp_path: Path, monkeypatch) -> None:
    from vramsweep.report.wandb_run import wandb_root

    cfg = _cfg(tmp_path)
    res = new_result(sweep="sw", trial=3)
    results = tmp_path / "results"
    assert wandb_root(cfg, res) == results  # no sweep folder yet
    atomic_write_json(results / "sweeps" / "sw" / "sweep.json", {"name": "sw"})
    assert wandb_root(cfg, res) == results / "sweeps" / "sw"  # the sweeper's default sweep_dir
    assert wandb_root(cfg, new_result()) == results  # a single trial
    monkeypatch.setenv("VRAMSWEEP_SWEEP_DIR", str(tmp_path / "elsewhere"))
    assert wandb_root(cfg, res) == tmp_path / "elsewhere"
    assert wandb_root(cfg, res, tmp_path / "given") == tmp_path / "given"
    assert wandb_root(_cfg(tmp_path, [f"logger.dir={tmp_path / 'mine'}"]), res) == tmp_path / "mine"


def test_wandb_failures_never_fail_the_trial(tmp_path: Path, monkeypatch) -> None:
    import wandb

    from vramsweep.report.wandb_run import WandbLogger, start_logger

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", boom)
    res = new_result(sweep="sw", trial=1)
    assert start_logger(_cfg(tmp_path), name="x", group=None, result=res) is None
    assert "no W&B today" in res["meta"]["wandb"]["errors"][0]

    class Broken:
        tags = ()
        summary: dict = {}

        def log(self, *a: Any, **k: Any) -> None:
            raise OSError("disk full")

        def finish(self, *a: Any, **k: Any) -> None:
            raise OSError("disk full")

    logger = WandbLogger(Broken(), res)
    logger.log({"train/loss": 1.0}, step=1)
    logger.finish(_finished(res))
    assert (
        "disk full" in res["meta"]["wandb"]["log_error"]
        and "disk full" in res["meta"]["wandb"]["finish_error"]
    )


# ---------------------------------------------------------------------------------------------
# the sweep-summary run
# ---------------------------------------------------------------------------------------------
def _ablation_sweep(tmp_path: Path) -> Path:
    results = ablation_results(True)
    for r in results:
        r["meta"]["wandb"] = {"name": f"syn-{r['trial']:04d}", "run_id": f"id{r['trial']}"}
    return write_sweep(
        tmp_path / "sw",
        results,
        design="ablation",
        baseline=BASE,
        factors=[["quant=nf4"], ["optimizer=adamw_8bit"]],
        budget_gib=15,
        storage="postgresql://me:secret@db/x",
    )


def _table(run_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    return json.loads((run_dir / "files" / entry["path"]).read_text())


def _history_entry(run, key: str) -> dict[str, Any]:
    rows = [h for h in run.history if f"{key}/_type" in h]
    assert len(rows) == 1, f"{key}: {len(rows)} history rows"
    return {k[len(key) + 1 :] if k.startswith(key + "/") else k: v for k, v in rows[0].items()}


def test_sweep_summary_run_table_plots_and_one_folder(tmp_path: Path) -> None:
    from vramsweep.report.wandb_summary import STATE_FILE, update_sweep_summary

    folder = _ablation_sweep(tmp_path)
    assert update_sweep_summary(folder) is None
    runs = offline_runs(folder / "wandb")
    assert len(runs) == 1
    run = runs[0]
    assert (run.job_type, run.name, run.group) == ("sweep-summary", "syn-summary", "syn")
    assert "sweep-summary" in run.tags and "design:ablation" in run.tags
    assert run.config["sweep"]["storage"] == "postgresql://me:***@db/x"  # no password in W&B
    state = json.loads((folder / "wandb" / STATE_FILE).read_text())
    assert state["run_id"] == run.run_id and state["n_trials"] == 6

    trials = _history_entry(run, "trials")
    assert trials["_type"] == "table-file" and trials["nrows"] == 6
    table = _table(run.path.parent, trials)
    cols = table["columns"]
    assert cols[:3] == ["trial", "status", "design"]
    assert {
        "quant",
        "optimizer",
        "peak_gib",
        "tokens_per_s",
        "eval_loss",
        "estimate_error",
        "wandb_run",
    } <= set(cols)
    rows = [dict(zip(cols, r)) for r in table["data"]]
    assert [r["trial"] for r in rows] == list(range(6))
    assert rows[0]["design"] == "baseline" and rows[2]["design"] == "ablation" and rows[2]["quant"] == "nf4"
    assert rows[0]["peak_gib"] == pytest.approx(10.0) and rows[0]["estimate_error"] == pytest.approx(0.05)
    assert rows[5]["status"] == "oom" and rows[5]["peak_gib"] is None
    assert rows[3]["wandb_run"] == "syn-0003"
    assert _history_entry(run, "table/ablation")["_type"] == "table-file"
    assert _history_entry(run, "plot/pareto")["_type"] == "image-file"
    assert run.summary["n_trials"] == 6 and run.summary["status/ok"] == 5 and run.summary["status/oom"] == 1

    # idempotent: nothing changed -> no new snapshot, state untouched
    before = (folder / "wandb" / STATE_FILE).read_text()
    assert update_sweep_summary(folder) is None
    assert len(list((folder / "wandb").glob("offline-run-*"))) == 1
    assert (folder / "wandb" / STATE_FILE).read_text() == before

    # a trial finishes -> same run id, the newer snapshot replaces the old one, 7 rows
    atomic_write_json(
        folder / "trials" / "0006.json",
        result(6, ["quant=nf4", "optimizer=adamw_8bit"], peak=5.0, tps=700, loss=2.4),
    )
    assert update_sweep_summary(folder) is None
    runs = offline_runs(folder / "wandb")
    assert len(runs) == 1 and runs[0].run_id == run.run_id and runs[0].path != run.path
    assert _history_entry(runs[0], "trials")["nrows"] == 7

    # trial runs share the sweep's wandb folder with the summary run
    _run_trial_logger(tmp_path, sweep_dir=folder)
    kinds = sorted(r.job_type for r in offline_runs(folder / "wandb"))
    assert kinds == ["sweep-summary", "trial"]
    assert not (tmp_path / "results" / "wandb").exists()


def test_report_wandb_resumes_the_live_summary_run(tmp_path: Path, capsys) -> None:
    from vramsweep.report.sweep_report import run_report
    from vramsweep.report.wandb_summary import update_sweep_summary

    folder = _ablation_sweep(tmp_path)
    assert update_sweep_summary(folder) is None
    first = offline_runs(folder / "wandb")[0]
    assert run_report(str(folder), wandb=True) == 0
    assert "W&B summary run:" in capsys.readouterr().out
    runs = offline_runs(folder / "wandb")
    assert len(runs) == 1 and runs[0].run_id == first.run_id
    assert _history_entry(runs[0], "plot/importances")["_type"] == "image-file"  # the full report


def test_summary_update_failure_is_a_warning(tmp_path: Path, monkeypatch) -> None:
    import wandb

    from vramsweep.report.wandb_summary import update_sweep_summary

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("no W&B today")

    folder = _ablation_sweep(tmp_path)
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", boom)
    warning = update_sweep_summary(folder)
    assert warning == "W&B summary run not logged: RuntimeError: no W&B today"
    monkeypatch.setattr(wandb, "init", real_init)
    empty = write_sweep(tmp_path / "empty", [])
    assert update_sweep_summary(empty) is None  # no trial finished yet: nothing to log
    assert not (empty / "wandb").exists()
    assert "no such sweep folder" in update_sweep_summary(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------------------------
# one real trial
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_trial_logs_every_step(tmp_path: Path, embedded_model_dir: Path) -> None:
    from conftest import FAST
    from vramsweep.trial import run_trial_overrides

    res = run_trial_overrides(
        [*FAST, "logger=wandb", f"results_dir={tmp_path}", "adapter.r=16", "train.eval_every=2"],
        sweep="real",
        trial=0,
        design={"kind": "search", "sampler": "grid"},
    )
    assert res["status"] == "ok", res["reason"]
    run = read_run(Path(res["meta"]["wandb"]["dir"]))
    assert run.job_type == "trial" and {"status:ok", "design:grid"} <= set(run.tags)
    assert run.config["adapter.r"] == 16 and run.config["trial"] == 0
    assert [h["_step"] for h in run.history] == [1, 2, 3, 4]
    assert all("train/loss" in h and "train/step_time_s" in h for h in run.history)
    assert "eval/loss" in run.history[1] and "memory/peak_tracked_bytes" in run.history[-1]
    assert run.summary["memory/peak_bytes"] == res["metrics"]["peak_memory_bytes"]
    assert run.summary["estimate/error"] == pytest.approx(
        res["estimate"]["peak_memory_bytes"] / res["metrics"]["peak_memory_bytes"] - 1
    )
    assert run.summary["device"].startswith("cpu")


def test_summary_updater_coalesces_and_catches_up(tmp_path: Path, monkeypatch) -> None:
    from vramsweep.report.wandb_summary import SummaryUpdater

    folder = _ablation_sweep(tmp_path)
    seen: list[str] = []
    up = SummaryUpdater(folder, on_warning=seen.append)
    for n in range(6, 10):  # trials finishing faster than an update takes
        atomic_write_json(
            folder / "trials" / f"{n:04d}.json", result(n, ["quant=nf4"], peak=5.0, tps=700, loss=2.4)
        )
        up.poke()
    up.close()
    assert 1 <= up.updates <= 5 and not seen
    runs = offline_runs(folder / "wandb")
    assert len(runs) == 1 and _history_entry(runs[0], "trials")["nrows"] == 10  # the last poke is not lost

    import wandb

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", boom)
    up = SummaryUpdater(folder, on_warning=seen.append)
    for n in (10, 11):
        atomic_write_json(
            folder / "trials" / f"{n:04d}.json", result(n, ["quant=nf4"], peak=5.0, tps=700, loss=2.4)
        )
        up.poke()
        up.close()  # a poke after close still gets its update
    assert 2 <= up.updates <= 4  # each round ran at least once (poke + close may give two)
    assert seen == ["W&B summary run not logged: RuntimeError: no W&B today"]  # once, not per trial


def test_summary_of_a_real_sweep_folder(tmp_path: Path) -> None:
    """A (fake-trial) sweep as the sweeper writes it: sweep.json, trials/*.json, study.db."""
    from vramsweep.report.wandb_summary import update_sweep_summary
    from vramsweep.sweeper import run_multirun

    rc = run_multirun(
        [
            f"results_dir={tmp_path}",
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.preload=[fakes]",
            "hydra.sweeper.isolation=inprocess",
            "sweep=memory_stack",
        ]
    )
    assert rc == 0
    folder = tmp_path / "sweeps" / "memory_stack"
    assert update_sweep_summary(folder) is None
    (run,) = offline_runs(folder / "wandb")
    table = _table(run.path.parent, _history_entry(run, "trials"))
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    steps = 1 + len(json.loads((folder / "sweep.json").read_text())["stack"])
    repeats = (
        len(rows) // steps
    )  # memory_stack has a quality objective: seed repeats by default, repeat-major
    assert (
        repeats >= 2 and [r["design"] for r in rows] == (["baseline"] + ["stacking"] * (steps - 1)) * repeats
    )
    assert rows[0]["quant"] == "none" and rows[1]["quant"] != "none"  # the stack's first step
    assert all(r["status"] == "ok" and r["peak_gib"] > 0 for r in rows)
    assert run.summary["n_trials"] == len(rows) and run.summary["status/ok"] == len(rows)
    assert _history_entry(run, "table/stacking")["_type"] == "table-file"


def test_sweep_with_wandb_logger_keeps_the_summary_run_current(tmp_path: Path) -> None:
    """logger=wandb on a sweep: the sweeper itself updates the summary run as trials finish (no report)."""
    from vramsweep.sweeper import run_multirun

    rc = run_multirun(
        [
            f"results_dir={tmp_path}",
            "hydra.sweeper.trial_fn=fakes:fake_trial",
            "hydra.sweeper.isolation=inprocess",
            "sweep=memory_stack",
            "logger=wandb",
        ]
    )
    assert rc == 0
    folder = tmp_path / "sweeps" / "memory_stack"
    assert (folder / "wandb" / "summary_run.json").is_file()
    (run,) = offline_runs(folder / "wandb")
    assert run.job_type == "sweep-summary"
    table = _table(run.path.parent, _history_entry(run, "trials"))
    assert len(table["data"]) == run.summary["n_trials"] >= 2


@pytest.mark.parametrize("status", ["ok", "oom"])
def test_summary_says_status_as_tags_do_and_why_mfu_is_missing(tmp_path: Path, status: str) -> None:
    """Read back from the run file: a real trial's result holds ``Status`` members, which
    W&B wrote by name (``"OK"``); ``mfu: null`` is dropped by W&B's reader, so ``mfu/reason`` must say why."""
    from vramsweep.record.status import Status
    from vramsweep.report.wandb_run import start_logger

    res = new_result(sweep="sw", trial=3, overrides=["quant=nf4"], config={})
    logger = start_logger(_cfg(tmp_path), name="sw-0003", group="sw", result=res)
    assert logger is not None, res["meta"]["wandb"]
    _finished(res, status)
    res["status"] = Status(status)
    res["metrics"]["mfu"] = None
    reason = "device 'cpu' is not in the peak table (vramsweep.measure.flops.DEVICE_PEAKS)"
    if status == "ok":
        res["meta"]["mfu"] = {"device": "cpu", "flops_per_token": 1.2e9, "reason": reason}
    else:
        res["meta"].pop("mfu", None)
    logger.finish(res)
    run = offline_runs(tmp_path / "results" / "wandb")[0]
    assert run.summary["status"] == status and f"status:{status}" in run.tags
    assert "mfu" not in run.summary
    want = reason if status == "ok" else "not measured (trial status oom)"
    assert run.summary["mfu/reason"] == want
