"""The result contract (record/): statuses, metric registry, feasibility rule, typed result and its JSON.

Every result JSON the product writes during the test session is also checked (tests/conftest.py,
``results_follow_the_schema``); the tests here pin the contract itself and that the check really runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import RESULT_LOG, result_log_lines
from vramsweep.record import GIB, METRIC_KEYS, STATUSES, Status, feasibility
from vramsweep.record.metrics import (
    BY_NAME,
    LOSS_METRICS,
    METRICS,
    OBJECTIVE_METRICS,
    PRUNABLE_METRICS,
    direction,
    is_objective,
)
from vramsweep.record.result import RESULT_LOG_ENV, new_result, write_result
from vramsweep.record.schema import Estimate, Meta, Metrics, ResultSchemaError, TrialResult, check_result

FIXTURES = Path(__file__).parents[1] / "fixtures" / "result_json"

# ------------------------------------------------------------------------------------------ statuses


@pytest.mark.torchfree
def test_status_is_a_str_enum_and_json_keeps_the_strings():
    assert STATUSES == (
        "ok",
        "oom",
        "host_oom",
        "unsupported",
        "diverged",
        "error",
        "infeasible_estimate",
        "pruned",
    )
    assert Status.OK == "ok" and Status("oom") is Status.OOM
    assert json.dumps({"status": Status.INFEASIBLE_ESTIMATE}) == '{"status": "infeasible_estimate"}'
    assert new_result(status=Status.PRUNED)["status"] == "pruned"
    assert type(new_result(status=Status.PRUNED)["status"]) is str  # a plain string in the dict
    with pytest.raises(ValueError, match=r"status='done' \(allowed: ok, oom, host_oom, unsupported"):
        new_result(status="done")


# ------------------------------------------------------------------------------------------ metrics


@pytest.mark.torchfree
def test_the_registry_is_the_one_list_of_metrics():
    # Every result carries these keys (null until measured): the file format of schema 1, unchanged.
    assert METRIC_KEYS == (
        "peak_memory_bytes",
        "memory_kind",
        "memory_breakdown_bytes",
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "train_loss",
        "initial_eval_loss",
        "eval_loss",
        "eval_ppl",
        "task_score",
    )
    assert PRUNABLE_METRICS == ("eval_loss", "eval_ppl")
    assert set(LOSS_METRICS) == {"train_loss", "eval_loss", "eval_ppl", "initial_eval_loss"}
    assert {"peak_memory_bytes", "tokens_per_s", "eval_loss", "task_score"} <= set(OBJECTIVE_METRICS)
    assert len(BY_NAME) == len(METRICS)  # names are unique
    for m in METRICS:
        assert m.kind in ("number", "text", "map", "list") and m.direction in (None, "minimize", "maximize")
        assert not (m.prunable and not m.objective), m.name


@pytest.mark.torchfree
def test_direction_comes_from_the_registry():
    assert direction("peak_memory_bytes") == "minimize"
    assert direction("tokens_per_s") == "maximize"
    assert direction("task_score") == "maximize" and direction("mfu") == "maximize"
    assert direction("eval_loss") == "minimize"
    assert direction("memory_breakdown_bytes.activations") == "minimize"  # a map metric's part
    assert direction("fact_token_acc") == "maximize" and direction("fact_nll") == "minimize"
    with pytest.raises(KeyError, match="unknown metric 'speed'"):
        direction("speed")
    with pytest.raises(KeyError, match="no better direction"):
        direction("memory_kind")
    assert is_objective("memory_breakdown_bytes.grads") and not is_objective("tokens_per_s.x")
    assert not is_objective("memory_kind")


@pytest.mark.torchfree
def test_sweep_objectives_take_the_registry_direction():
    from vramsweep.sweeper.settings import parse_objectives

    objs = parse_objectives(["eval_loss", "tokens_per_s", "fact_token_acc", "memory_breakdown_bytes.params"])
    assert [o.direction for o in objs] == ["minimize", "maximize", "maximize", "minimize"]


# ------------------------------------------------------------------------------------------ feasibility

FEASIBILITY_CASES = [
    # status, peak GiB, recorded hardware.budget_gib (absent: not recorded), sweep budget, feasible
    ("ok", 1.0, 2.0, 0.0, True),
    ("ok", 3.0, 2.0, 0.0, False),
    ("ok", 3.0, 0.0, 2.0, True),  # the trial's own budget (0 = none) wins over the sweep's
    ("ok", 3.0, None, 2.0, False),  # not recorded: the sweep's
    ("ok", 2.0, 2.0, 0.0, True),  # at the budget fits
    ("ok", None, 2.0, 0.0, False),  # a budget and no measured peak: cannot be checked
    ("ok", None, 0.0, 0.0, True),
    ("oom", 1.0, 2.0, 0.0, False),
    ("pruned", 1.0, 0.0, 0.0, False),
]


def _case_result(status, peak_gib, recorded, sweep_budget):
    config = {"hardware": {"budget_gib": recorded}} if recorded is not None else {}
    r = new_result(status=status, config=config, sweep="s", trial=0)
    r["metrics"]["peak_memory_bytes"] = None if peak_gib is None else int(peak_gib * GIB)
    r["metrics"]["eval_loss"] = 1.0
    return r


@pytest.mark.parametrize("status,peak,recorded,sweep_budget,want", FEASIBILITY_CASES)
@pytest.mark.torchfree
def test_one_feasibility_rule_for_sweeper_report_and_progress(status, peak, recorded, sweep_budget, want):
    from vramsweep.report.load import SweepData, TrialRecord
    from vramsweep.sweeper.outcome import classify
    from vramsweep.sweeper.progress import status_label
    from vramsweep.sweeper.settings import Objective

    r = _case_result(status, peak, recorded, sweep_budget)
    assert feasibility.result_feasible(r, sweep_budget) is want
    # the sweeper: feasible <=> COMPLETE with constraint <= 0
    out = classify(dict(r), [Objective("eval_loss", "minimize")], budget_gib=sweep_budget)
    assert (out.state == "COMPLETE" and out.constraint is not None and out.constraint <= 0) is want
    # the report
    sweep = SweepData("s", None, {"budget_gib": sweep_budget}, [TrialRecord.from_result(r)])
    assert sweep.feasible(sweep.trials[0]) is want
    # the progress line says "over budget" exactly for an ok trial with a measured peak over its budget
    over = status == "ok" and peak is not None and not want
    assert (status_label(r, sweep_budget) == "over budget") is over


@pytest.mark.parametrize("status,peak,recorded,sweep_budget,want", FEASIBILITY_CASES)
@pytest.mark.torchfree
def test_the_sweep_summary_counts_a_trial_as_the_progress_line_labels_it(
    status, peak, recorded, sweep_budget, want
):
    """The summary's count by status (``2 ok, 1 over budget, ...``) uses the progress line's
    ``status_label``, read from the study trial the sweeper told."""
    import optuna

    from vramsweep.sweeper.outcome import CONSTRAINT_KEY, DASHBOARD_CONSTRAINTS_KEY, classify, user_attrs
    from vramsweep.sweeper.progress import status_label, summary_status
    from vramsweep.sweeper.settings import Objective

    r = _case_result(status, peak, recorded, sweep_budget)
    out = classify(r, [Objective("eval_loss", "minimize")], budget_gib=sweep_budget)
    c = out.constraint
    told = optuna.trial.create_trial(  # what StudyBook.tell stores
        state=optuna.trial.TrialState[out.state],
        values=out.values if out.state == "COMPLETE" else None,
        user_attrs=user_attrs(r, out, "trials/0000.json"),
        system_attrs={} if c is None else {DASHBOARD_CONSTRAINTS_KEY: [c]},
        constraints=None if c is None else {CONSTRAINT_KEY: c},
    )
    assert summary_status(told) == status_label(r, sweep_budget)
    assert (summary_status(told) == "over budget") is (status == "ok" and peak is not None and not want)


# ------------------------------------------------------------------------------------------ schema


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
@pytest.mark.torchfree
def test_result_fixture_files_load_and_round_trip(name):
    data = _fixture(name)
    typed = check_result(data)
    assert typed.to_json() == data
    assert isinstance(typed.status, Status)


@pytest.mark.torchfree
def test_a_real_trial_result_is_typed():
    r = TrialResult.from_json(_fixture("real_cpu_trial.json"))
    assert r.status is Status.OK and r.schema == 1
    assert r.metrics.number("tokens_per_s") > 0 and r.metrics.get("memory_kind") == "cpu_tracked"
    assert r.metrics.number("memory_breakdown_bytes.params") > 0
    assert isinstance(r.estimate, Estimate) and r.estimate.peak_memory_bytes > 0
    assert isinstance(r.meta, Meta) and r.meta.wall_s > 0 and r.meta.get("timing_conditions")
    assert r.config["quant"]["name"] == "none"


@pytest.mark.torchfree
def test_an_old_minimal_result_still_loads_and_round_trips():
    old = {"status": "oom", "reason": "OutOfMemoryError: x", "metrics": {"peak_memory_bytes": 5}}
    r = check_result(old)
    assert r.schema == 1 and r.overrides == [] and r.meta.design is None and r.estimate is None
    assert r.to_json() == old  # absent keys stay absent


@pytest.mark.torchfree
def test_unknown_keys_are_kept_verbatim():
    data = new_result(status="ok", sweep="s", trial=3)
    data["future_field"] = {"a": [1, 2]}
    data["metrics"]["my_custom_metric"] = "anything"
    data["meta"]["custom"] = 1
    r = check_result(data)
    assert r.extra == {"future_field": {"a": [1, 2]}}
    assert r.metrics.extra == {"my_custom_metric": "anything"} and r.meta.extra == {"custom": 1}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"status": "done"}, "result.status='done' (allowed: ok, oom"),
        ({"status": None}, "result.status=None (allowed: a string)"),
        ({"schema": 2}, "result.schema=2 (allowed: <= 1"),
        ({"overrides": "quant=nf4"}, "result.overrides='quant=nf4' (allowed: a list of strings)"),
        ({"trial": "3"}, "result.trial='3' (allowed: an integer or null)"),
        ({"metrics": []}, "result.metrics=[] (allowed: an object)"),
        ({"metrics": {"tokens_per_s": "fast"}}, "metrics.tokens_per_s='fast' (allowed: a number or null)"),
        ({"metrics": {"memory_breakdown_bytes": {"params": "x"}}}, "metrics.memory_breakdown_bytes="),
        ({"estimate": {"peak_memory_bytes": True}}, "estimate.peak_memory_bytes=True"),
        ({"meta": {"wall_s": "1s"}}, "meta.wall_s='1s' (allowed: a number or null)"),
    ],
)
@pytest.mark.torchfree
def test_a_malformed_result_is_rejected_naming_the_key(change, message):
    data = new_result(status="ok") | change
    with pytest.raises(ResultSchemaError) as err:
        TrialResult.from_json(data)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.torchfree
def test_typed_result_built_in_code_matches_new_result():
    r = TrialResult(status=Status.ERROR, reason="x", sweep="s", trial=1, overrides=["a=1"])
    r.metrics = Metrics.from_json(new_result()["metrics"])
    assert r.to_json() == new_result(status="error", reason="x", sweep="s", trial=1, overrides=["a=1"])


# ------------------------------------------------------------------------------------------ the session check


@pytest.mark.torchfree
def test_typed_result_new_is_new_result():
    r = TrialResult.new(status="oom", reason="x", sweep="s", trial=2, overrides=("a=1",), config={"k": 1})
    assert r.status is Status.OOM and r.metrics.values == {k: None for k in METRIC_KEYS}
    assert r.to_json() == new_result(
        status="oom", reason="x", sweep="s", trial=2, overrides=["a=1"], config={"k": 1}
    )
    with pytest.raises(ValueError, match=r"status='done' \(allowed: ok, oom"):
        TrialResult.new(status="done")


@pytest.mark.torchfree
def test_setting_a_key_on_a_loaded_result_writes_it():
    old = {"status": "oom", "reason": "OutOfMemoryError: x", "metrics": {"peak_memory_bytes": 5}, "meta": {}}
    r = TrialResult.from_json(old)
    assert r.to_json() == old
    r.meta.result_path = None  # set: written, even as null
    r.status = Status.ERROR
    r.estimate = Estimate.from_json({"peak_memory_bytes": 7})
    assert r.to_json() == old | {
        "status": "error",
        "estimate": {"peak_memory_bytes": 7},
        "meta": {"result_path": None},
    }


# ------------------------------------------------------------------------------------------ the writer


@pytest.mark.torchfree
def test_write_result_takes_a_trial_result(tmp_path):
    r = TrialResult.new(status=Status.DIVERGED, reason="nan", sweep="s", trial=4)
    r.metrics.values["train_loss"] = float("nan")  # JSON has no NaN: written as null
    r.meta.wall_s = 1.5
    path = write_result(tmp_path / "r.json", r)
    data = json.loads(path.read_text())
    assert data["status"] == "diverged" and data["metrics"]["train_loss"] is None
    assert data["meta"] == {"wall_s": 1.5}
    assert check_result(data).status is Status.DIVERGED


@pytest.mark.parametrize(
    "change,message",
    [
        ({"overrides": "quant=nf4"}, "result.overrides='quant=nf4' (allowed: a list of strings)"),
        ({"status": "done"}, "result.status='done' (allowed: ok, oom"),
        ({"metrics": {"tokens_per_s": "fast"}}, "metrics.tokens_per_s='fast'"),
    ],
)
@pytest.mark.torchfree
def test_write_result_refuses_a_result_that_breaks_the_contract_and_writes_nothing(
    tmp_path, monkeypatch, change, message
):
    log = tmp_path / "log"
    monkeypatch.setenv(RESULT_LOG_ENV, str(log))
    folder = tmp_path / "trials"
    folder.mkdir()
    (folder / "0001.json").write_text("previous\n")
    with pytest.raises(ResultSchemaError) as err:
        write_result(folder / "0001.json", new_result(status="ok") | change)
    assert message in str(err.value)
    assert (folder / "0001.json").read_text() == "previous\n"  # the old file is untouched
    assert [p.name for p in folder.iterdir()] == ["0001.json"]  # no temp file left behind
    with pytest.raises(ResultSchemaError, match="allowed: an object"):
        write_result(folder / "0002.json", ["not", "a", "result"])
    assert not (folder / "0002.json").exists() and not log.exists()


@pytest.mark.torchfree
def test_write_result_logs_what_it_wrote(tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv(RESULT_LOG_ENV, str(log))
    good = write_result(tmp_path / "good.json", new_result(status="ok"))
    assert log.read_text().splitlines() == [f"ok\t{good.resolve()}"]


def test_results_written_by_sweep_processes_are_checked(tmp_path):
    """The session check sees results written by trial processes (fork server) and in-process trials."""
    from vramsweep.sweeper import run_multirun

    start = RESULT_LOG.stat().st_size
    for iso in ("fork", "inprocess"):
        rc = run_multirun(
            [
                f"results_dir={tmp_path / iso}",
                "hydra.sweeper.trial_fn=fakes:fake_trial",
                "hydra.sweeper.preload=[fakes]",
                f"hydra.sweeper.isolation={iso}",
                "hydra.sweeper.sampler=random",
                "hydra.sweeper.n_trials=2",
                "adapter.r=choice(8,16)",
            ]
        )
        assert rc == 0
    logged = {line.split("\t")[1] for line in result_log_lines(start)}
    written = {str(p.resolve()) for p in tmp_path.glob("*/sweeps/*/trials/*.json")}
    assert written <= logged
    assert {Path(p).parts[-5] for p in written} == {"fork", "inprocess"} and len(written) >= 4


@pytest.mark.torchfree
def test_report_objectives_without_direction_take_the_registry_direction():
    from vramsweep.report.load import DEFAULT_OBJECTIVES, SweepData

    settings = {"objectives": [{"metric": "tokens_per_s"}, {"metric": "eval_loss"}, {"metric": "x"}]}
    sweep = SweepData("s", None, settings, [])
    assert sweep.objectives == [("tokens_per_s", "maximize"), ("eval_loss", "minimize"), ("x", "minimize")]
    assert DEFAULT_OBJECTIVES == (
        ("peak_memory_bytes", "minimize"),
        ("tokens_per_s", "maximize"),
        ("eval_loss", "minimize"),
    )


@pytest.mark.torchfree
def test_results_are_written_with_write_result():
    """Every result JSON goes through record.write_result (the session check sees only those)."""
    import ast

    src = Path(__file__).resolve().parents[2] / "src" / "vramsweep"
    offenders = []
    for path in src.rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "atomic_write_json"
                and node.args
            ):
                target = ast.get_source_segment(text, node.args[0]) or ""
                if "result_path" in target:
                    offenders.append(
                        f"{path.relative_to(src)}:{node.lineno}: atomic_write_json({target}, ...)"
                    )
    assert not offenders, offenders


@pytest.mark.slow  # a pytest subprocess: ~20 s on a loaded machine
def test_the_session_check_fails_a_test_that_writes_a_malformed_result(tmp_path):
    """tests/conftest.py's autouse check turns a bad result written by the product into a test error."""
    import subprocess
    import sys

    tests = Path(__file__).resolve().parents[1]
    shutil.copy(tests / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(
        "import os\n"
        "import pytest\n"
        "from vramsweep.record.result import RESULT_LOG_ENV, new_result, write_result\n"
        "from vramsweep.record.schema import ResultSchemaError\n\n"
        "def test_good(tmp_path):\n"
        "    write_result(tmp_path / 'r.json', new_result(status='ok'))\n\n"
        "def test_refused(tmp_path):\n"  # the writer refuses a malformed result before writing it
        "    with pytest.raises(ResultSchemaError):\n"
        "        write_result(tmp_path / 'r.json', new_result(status='ok') | {'trial': 'three'})\n"
        "    assert not (tmp_path / 'r.json').exists()\n\n"
        "def test_bad(tmp_path):\n"  # a bad result that got written anyway (a writer of another kind)
        "    with open(os.environ[RESULT_LOG_ENV], 'a') as fh:\n"
        "        fh.write(f\"bad\\t{tmp_path}/r.json\\tresult.trial='three'\\n\")\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # test_bad's call passes; its teardown (the check) errors
    assert "ERROR" in out and "test_bad" in out and "result.trial='three'" in out, out
