"""``vramsweep train -m`` does what a Hydra user typed.

Comma lists / ``range`` / ``choice`` on the command line are a grid over exactly their Cartesian
product; a search runs only when a sweep file or ``hydra.sweeper.sampler`` asks for one. Every sweep has
its own study (ad-hoc sweeps are named by a hash of what they run); a named sweep resumes only when it
is the same sweep. ``--cfg``/``--info`` run nothing. Bad sampler/space/name input exits 2 before any file
is written. All trials here are the in-process fake trial: milliseconds each.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.request
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import optuna
import pytest

from vramsweep.cli import main as cli_main
from vramsweep.sweeper import run_multirun

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.isolation=inprocess",
]


def sweep(tmp_path: Path, *args: str) -> int:
    return run_multirun([f"results_dir={tmp_path}", *FAKE, *args])


def sweep_dir_of(out: str) -> Path:
    dirs = re.findall(r"^results: (.+)$", out, flags=re.M)
    assert dirs, out
    return Path(dirs[-1])


def study_of(folder: Path) -> optuna.Study:
    info = json.loads((folder / "sweep.json").read_text())
    return optuna.load_study(study_name=info["study_name"], storage=f"sqlite:///{folder}/study.db")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # no access log on stderr
        pass


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that ran a point (copies of an earlier point are excluded)."""
    return [t for t in study.trials if "duplicate_of" not in t.user_attrs and t.state.is_finished()]


# ------------------------------------------------------------------------------------- 1. grid semantics


def test_comma_lists_are_a_grid_over_the_cartesian_product(tmp_path, capsys):
    assert sweep(tmp_path, "quant=none,nf4", "adapter.r=4,8,16") == 0
    folder = sweep_dir_of(capsys.readouterr().out)
    info = json.loads((folder / "sweep.json").read_text())
    assert info["design"] == "grid" and info["n_total"] == 6
    study = study_of(folder)
    got = [(t.params["quant"], int(t.params["adapter.r"])) for t in study.trials]
    assert got == [(q, r) for q in ("none", "nf4") for r in (4, 8, 16)]  # every point once, stable order


def test_range_and_choice_on_the_command_line_are_a_grid(tmp_path, capsys):
    assert sweep(tmp_path, "adapter.r=range(4,13,4)", "quant=choice(none,nf4_dq)") == 0
    study = study_of(sweep_dir_of(capsys.readouterr().out))
    got = [(int(t.params["adapter.r"]), t.params["quant"]) for t in study.trials]
    assert got == [(4, "none"), (4, "nf4_dq"), (8, "none"), (8, "nf4_dq"), (12, "none"), (12, "nf4_dq")]


def test_a_search_only_when_a_sampler_asks(tmp_path, capsys):
    assert sweep(tmp_path, "quant=none,nf4", "hydra.sweeper.sampler=random", "hydra.sweeper.n_trials=2") == 0
    folder = sweep_dir_of(capsys.readouterr().out)
    assert json.loads((folder / "sweep.json").read_text())["design"] == "search"


def test_duplicates_do_not_consume_the_budget(tmp_path, capsys):
    """A random sampler over 6 points re-proposes measured ones; the study still measures 5 distinct points."""
    args = ["quant=none,nf4,nf4_dq", "adapter.r=4,8", "hydra.sweeper.sampler={name: random, seed: 0}"]
    assert sweep(tmp_path, *args, "hydra.sweeper.n_trials=5") == 0
    study = study_of(sweep_dir_of(capsys.readouterr().out))
    ran = measured(study)
    assert len(ran) == 5
    assert len({tuple(sorted(t.params.items())) for t in ran}) == 5
    copies = [t for t in study.trials if "duplicate_of" in t.user_attrs]
    for (
        t
    ) in copies:  # a copy keeps the earlier outcome (the sampler learns it) and says which trial it copies
        assert t.values == study.trials[t.user_attrs["duplicate_of"]].values


def test_n_trials_above_a_finite_space_is_capped(tmp_path, capsys):
    args = ["quant=none,nf4", "adapter.r=4,8", "hydra.sweeper.sampler={name: random, seed: 1}"]
    assert sweep(tmp_path, *args, "hydra.sweeper.n_trials=10") == 0
    cap = capsys.readouterr()
    assert "capped to 4" in cap.err
    study = study_of(sweep_dir_of(cap.out))
    assert len({tuple(sorted(t.params.items())) for t in measured(study)}) == 4 == len(measured(study))


# ------------------------------------------------------------------------------------- 2. study names


def test_ad_hoc_sweeps_get_their_own_studies(tmp_path, capsys):
    assert sweep(tmp_path, "quant=nf4,nf4_dq") == 0
    first = sweep_dir_of(capsys.readouterr().out)
    assert sweep(tmp_path, "adapter.r=4,8,16") == 0
    out = capsys.readouterr().out
    second = sweep_dir_of(out)
    assert first != second and "resuming" not in out
    assert len(study_of(first).trials) == 2 and len(study_of(second).trials) == 3
    s1, s2 = (json.loads((d / "sweep.json").read_text())["study_name"] for d in (first, second))
    assert s1 != s2
    # the same command again is the same sweep: it resumes (nothing left to run)
    assert sweep(tmp_path, "adapter.r=4,8,16") == 0
    out = capsys.readouterr().out
    assert sweep_dir_of(out) == second and "3/3 finished" in out and len(study_of(second).trials) == 3


def test_sweep_name_names_an_ad_hoc_sweep(tmp_path, capsys):
    assert sweep(tmp_path, "sweep.name=mine", "adapter.r=4,8") == 0
    assert sweep_dir_of(capsys.readouterr().out) == tmp_path / "sweeps" / "mine"
    assert study_of(tmp_path / "sweeps" / "mine").study_name == "mine"


def test_a_named_sweep_refuses_a_different_space(tmp_path, capsys):
    assert sweep(tmp_path, "hydra.sweeper.study_name=n1", "adapter.r=4,8") == 0
    before = (tmp_path / "sweeps" / "n1" / "sweep.json").read_text()
    capsys.readouterr()
    assert sweep(tmp_path, "hydra.sweeper.study_name=n1", "adapter.r=4,8,16") == 2
    err = capsys.readouterr().err
    assert "n1" in err and "adapter.r=16" in err and "different sweep" in err
    assert (tmp_path / "sweeps" / "n1" / "sweep.json").read_text() == before
    assert len(study_of(tmp_path / "sweeps" / "n1").trials) == 2


# ------------------------------------------------------------------------------------- 3. --cfg / --info


@pytest.mark.parametrize("multirun", [False, True])
@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--cfg", "job"], "adapter:"),
        (["--cfg", "hydra"], "sweeper:"),
        (["--cfg", "all"], "hydra:"),
        (["--info"], "Config search path"),
    ],
)
def test_cfg_and_info_print_and_run_nothing(tmp_path, capsys, multirun, flags, expect):
    argv = [
        "train",
        *(["-m"] if multirun else []),
        *flags,
        f"results_dir={tmp_path}/r",
        *FAKE[:1],
        "quant=none,nf4" if multirun else "quant=nf4",
    ]
    if not multirun:
        argv.remove(FAKE[0])
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert expect in out
    assert not (tmp_path / "r").exists() and not Path("multirun").exists()


def test_cfg_without_a_value_still_takes_overrides(tmp_path, capsys):
    assert cli_main(["train", "--cfg", "quant=nf4"]) == 0
    assert "nf4" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- 4. hydra.sweep.dir


def test_hydra_sweep_dir_is_honoured(tmp_path, capsys):
    target = tmp_path / "elsewhere"
    assert sweep(tmp_path, "adapter.r=4,8", f"hydra.sweep.dir={target}") == 0
    assert sweep_dir_of(capsys.readouterr().out) == target
    assert (target / "sweep.json").is_file() and len(study_of(target).trials) == 2


# ------------------------------------------------------------------------------------- 5. changed fixed overrides


def test_changed_fixed_overrides_on_a_finished_named_sweep_are_refused(tmp_path, capsys):
    assert sweep(tmp_path, "sweep=demo", "train.steps=3") == 0
    folder = tmp_path / "sweeps" / "demo"
    before = (folder / "sweep.json").read_text()
    capsys.readouterr()
    assert sweep(tmp_path, "sweep=demo", "train.steps=50") == 2
    err = capsys.readouterr().err
    assert "train.steps=3" in err and "train.steps=50" in err and "sweep.name=" in err
    assert (folder / "sweep.json").read_text() == before
    assert json.loads(before)["fixed_overrides"].count("train.steps=3") == 1


# ------------------------------------------------------------------------------------- 6. dashboard


def test_optuna_dashboard_sees_over_budget_trials_as_infeasible(tmp_path, capsys):
    from optuna_dashboard._app import create_app

    budget = 0.08  # GiB: the fake's rank-256 adapter peaks above it, ranks 4 and 16 below
    assert sweep(tmp_path, "adapter.r=4,16,256", f"hardware.budget_gib={budget}") == 0
    folder = sweep_dir_of(capsys.readouterr().out)
    app = create_app(optuna.storages.RDBStorage(f"sqlite:///{folder}/study.db"))
    # the real dashboard app, served on loopback and queried over HTTP like its web UI does
    server = make_server("127.0.0.1", 0, app, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"

    def get(path: str) -> dict:
        with urllib.request.urlopen(base + path, timeout=30) as resp:
            assert resp.status == 200
            return json.loads(resp.read())

    try:
        sid = get("/api/studies")["study_summaries"][0]["study_id"]
        trials = get(f"/api/studies/{sid}")["trials"]
    finally:
        server.shutdown()
    feasible = {t["number"]: all(c <= 0 for c in t["constraints"]) for t in trials}
    assert all(t["constraints"] for t in trials)  # the dashboard reads the list attr `constraints`
    assert feasible == {0: True, 1: True, 2: False}
    study = study_of(folder)
    assert study.best_trial.number == 1  # Optuna itself still reads the named constraint
    assert study.trials[2].constraints["vram_over_budget_gib"] > 0


# ------------------------------------------------------------------------------------- 7. bad samplers / spaces


@pytest.mark.parametrize(
    "args, says",
    [
        (
            [
                "hydra.sweeper.sampler={_target_: optuna.samplers.CmaEsSampler}",
                "train.lr=interval(1e-4,1e-2)",
            ],
            "cmaes",
        ),
        (
            ["hydra.sweeper.sampler={_target_: optuna.samplers.NoSuchSampler}", "quant=none,nf4"],
            "NoSuchSampler",
        ),
        (
            [
                "hydra.sweeper.pruner={_target_: optuna.pruners.NoSuchPruner}",
                "hydra.sweeper.sampler=tpe",
                "train.lr=interval(1e-4,1e-2)",
            ],
            "NoSuchPruner",
        ),
        (["sweep=quant,optimizer"], "one sweep file"),
        (["adapter.r=glob(1*)"], "glob"),
    ],
)
def test_bad_sampler_pruner_or_space_exits_2_before_any_file(tmp_path, capsys, args, says):
    pytest.importorskip("optuna")
    if "cmaes" in says:
        import importlib.util

        if importlib.util.find_spec("cmaes") is not None:
            pytest.skip("cmaes is installed here")
    assert sweep(tmp_path, *args) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "sweeps").exists()


def test_grid_sampler_by_target_is_a_grid(tmp_path, capsys):
    assert (
        sweep(tmp_path, "hydra.sweeper.sampler={_target_: optuna.samplers.GridSampler}", "adapter.r=4,8") == 0
    )
    folder = sweep_dir_of(capsys.readouterr().out)
    assert json.loads((folder / "sweep.json").read_text())["design"] == "grid"
    assert [t.params["adapter.r"] for t in study_of(folder).trials] == [4, 8]


def test_glob_over_a_config_group_expands_to_its_options(tmp_path, capsys):
    assert sweep(tmp_path, "quant=glob(nf*)") == 0
    study = study_of(sweep_dir_of(capsys.readouterr().out))
    assert [t.params["quant"] for t in study.trials] == ["nf4", "nf4_dq"]


# ------------------------------------------------------------------------------------- 8. unknown names, report


@pytest.mark.torchfree
def test_unknown_sweep_name_in_a_multirun_exits_2_with_the_known_ones(tmp_path, capsys):
    assert sweep(tmp_path, "sweep=nonexistent") == 2
    err = capsys.readouterr().err
    assert "nonexistent" in err and "demo" in err and "quant" in err
    assert not (tmp_path / "sweeps").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "sweep=nonexistent", "--cfg"], "demo"),
        (["train", "+experiment=nope"], "experiment"),
        (["train", "-m", "experiment=nope", "adapter.r=4,8"], "experiment"),
    ],
)
@pytest.mark.torchfree
def test_unknown_sweep_or_experiment_exits_2(tmp_path, capsys, argv, says):
    assert cli_main([*argv, f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err or "nonexistent" in err
    assert says in err
    assert not any(tmp_path.iterdir())


def test_report_on_a_copied_sweep_folder_reads_the_copy(tmp_path, capsys):
    from vramsweep.report.load import load_sweep

    assert sweep(tmp_path, "sweep.name=orig", "adapter.r=4,8") == 0
    orig = tmp_path / "sweeps" / "orig"
    copy = tmp_path / "copied"
    shutil.copytree(orig, copy)
    data = load_sweep(str(copy))
    assert data.storage == f"sqlite:///{copy.resolve()}/study.db" and len(data.trials) == 2
    # a copy without its database does not silently read the original's (named in sweep.json)
    for p in copy.glob("study.db*"):
        p.unlink()
    data = load_sweep(str(copy))
    assert data.storage is None and any("outside this folder" in n for n in data.notes)
    assert len(data.trials) == 2  # from the trial JSONs


# ------------------------------------------------------------------------------------- efficiency bench


@pytest.mark.torchfree
def test_fake_landscape_does_not_depend_on_where_results_go():
    """The bench's landscape is reproducible: the same knobs measure the same under /tmp/a and /tmp/b."""
    from fakes import landscape, parse_overrides

    a = landscape(
        parse_overrides(["quant=nf4", "adapter.r=16", "results_dir=/tmp/a", "hardware.budget_gib=1"])
    )
    b = landscape(parse_overrides(["quant=nf4", "adapter.r=16", "results_dir=/tmp/b"]))
    assert a == b
    seeded = landscape(parse_overrides(["quant=nf4", "adapter.r=16", "train.seed=1"]))
    assert seeded["eval_loss"] != a["eval_loss"]  # seed noise is still there


def test_an_in_process_sweep_gives_the_logging_configuration_back(tmp_path):
    """Hydra configures logging for its run; after run_multirun returns, every logger's handlers and levels
    are the caller's again (a handler left on a closed stream printed '--- Logging error ---' into later
    commands' stderr)."""
    import logging

    def snapshot():
        return {
            name: (tuple(lg.handlers), lg.level, lg.propagate, lg.disabled)
            for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger) and (lg.handlers or lg.level)
        } | {"": (tuple(logging.root.handlers), logging.root.level)}

    before = snapshot()
    assert sweep(tmp_path, "quant=none,nf4") == 0
    after = snapshot()
    assert {k: after.get(k) for k in before} == before  # loggers made during the run keep their own levels
    assert after[""] == before[""]


@pytest.mark.parametrize("cfg", ["job", "hydra", "all"])
@pytest.mark.torchfree
def test_cfg_over_sweep_values_without_multirun_prints_the_base(cfg, capsys):
    """`vramsweep train quant=none,nf4 --cfg job` (no -m) prints the sweep's base config and exits 0, as
    --cfg hydra|all do (it exited 2 on the list); nothing runs."""
    code = cli_main(["train", "quant=none,nf4", "--cfg", cfg])
    out = capsys.readouterr().out
    assert code in (0, None), out
    if cfg == "job":
        assert "# the sweep's base config; each trial adds one point of: quant=none,nf4" in out
        assert "quant:" in out
