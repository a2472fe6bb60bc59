"""Bad input of the less obvious kinds (search spaces, optimizer kwargs, special files, conf dirs, deeply
nested JSON): each case exits 2 with one line ``vramsweep <verb>: error: ...`` naming the key, and writes
nothing (the harness of ``tests/_bad_inputs.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _bad_inputs import FAKE, check_bad_input
from vramsweep.cli import main
from vramsweep.config.errors import ConfigError

LONG = "n" * 256  # one byte over a file name's limit
SWEEP = ["-m", "adapter.r=8,16", *FAKE]
UNNAMED = ["-m", "adapter.r=8,16", *FAKE[:2]]  # without study_name, so sweep.name names the sweep

# (id, verb, argv with {placeholders}, env, substring of the one line)
CASES: list[tuple[str, str, list[str], dict[str, str], str]] = [
    # item 5: a path component over 255 bytes (was OSError: File name too long)
    ("long-results-dir", "train", [f"results_dir={{root}}/{LONG}"], {}, "is 256 bytes long"),
    ("long-results-dir-cjk", "train", ["results_dir='{root}/" + "資" * 86 + "'"], {}, "is 258 bytes long"),
    ("long-cache", "train", [], {"VRAMSWEEP_CACHE": f"/tmp/{LONG}"}, "VRAMSWEEP_CACHE=/tmp/nnn"),
    ("long-report", "report", [f"{{root}}/{LONG}"], {}, "is 256 bytes long"),
    ("long-config-dir", "train", [f"--config-dir={{root}}/{LONG}"], {}, "--config-dir: the name"),
    ("long-sweep-name", "train", [*UNNAMED, f"sweep.name={LONG}"], {}, "sweep.name is 256 bytes long"),
    # item 7: sweep.name=.. wrote into results_dir itself
    (
        "sweep-name-dotdot",
        "train",
        [*UNNAMED, "sweep.name=.."],
        {},
        "sweep.name='..' must be a plain file name",
    ),
    ("sweep-name-dot", "train", [*UNNAMED, "sweep.name=."], {}, "sweep.name='.' must be a plain file name"),
    # item 5: search-space syntax and sweeper settings that raised
    (
        "range-step-0",
        "train",
        ["-m", "adapter.r=range(1,10,0)", *FAKE],
        {},
        "adapter.r=range(1,10,0): range step 0",
    ),
    (
        "nested-choice",
        "train",
        ["-m", "adapter.r=choice(choice(8,16),32)", *FAKE],
        {},
        "a choice cannot hold another sweep",
    ),
    (
        "pruner-negative",
        "train",
        [*SWEEP, "hydra.sweeper.sampler=tpe", "hydra.sweeper.pruner={name:median,n_startup_trials:-1}"],
        {},
        "hydra.sweeper.pruner={'name': 'median', 'n_startup_trials': -1}: Number of startup trials",
    ),
    # item 8: values accepted or the wrong key named
    (
        "cuda-devices-negative",
        "train",
        [*SWEEP, "hydra.sweeper.cuda_devices=[-1]"],
        {},
        "has '-1', not a device",
    ),
    (
        "preload-missing",
        "train",
        [*SWEEP, "hydra.sweeper.preload=[no_such_module_xyz]"],
        {},
        "hydra.sweeper.preload has 'no_such_module_xyz', a module that cannot be imported",
    ),
    (
        "custom-search-space-unresolved",
        "train",
        [*SWEEP, "hydra.sweeper.custom_search_space=no_such_mod.configure"],
        {},
        "hydra.sweeper.custom_search_space='no_such_mod.configure' does not resolve",
    ),
    (
        "custom-search-space-in-trial-mode",
        "train",
        [*SWEEP, "hydra.sweeper.custom_search_space=os.path.join"],
        {},
        "is for function mode",
    ),
    # item 3: refused by the trial cap by arithmetic, before any point is built (the harness: < 10 s of CPU;
    # the grid took 48 s to be refused for disk space, sweep.repeats=100000 never answered)
    (
        "repeats-100000",
        "train",
        ["-m", "sweep=adapter_rank", "+sweep.repeats=100000", *FAKE],
        {},
        "sweep.repeats: the sweep plans 800,000 trials (a grid of 8 points x 100,000 repeat(s))",
    ),
    (
        "grid-409600",
        "train",
        [
            "-m",
            "adapter.r=range(1,41)",
            "train.lr=range(1,41)",
            "train.micro_batch=range(1,17)",
            "context.max_tokens=range(1,17)",
            *FAKE,
        ],
        {},
        "hydra.sweeper.params: the sweep plans 409,600 trials",
    ),
]


@pytest.mark.parametrize(("case_id", "verb", "argv", "env", "needle"), CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line_with_nothing_written(
    tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle
):
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle)


def test_a_fifo_as_data_path_is_refused_not_read(tmp_path, capsys, monkeypatch):
    """A FIFO as ``data.path`` would block ``train`` forever waiting for a writer: not a regular file."""
    os.mkfifo(tmp_path / "fifo.jsonl")
    argv = ["data=file", f"data.path={tmp_path / 'fifo.jsonl'}"]
    check_bad_input(tmp_path, capsys, monkeypatch, "fifo", "train", argv, {}, "not a regular file")


def test_a_symlink_loop_under_results_dir_is_refused_before_the_trial(tmp_path, capsys, monkeypatch):
    """The pre-flight probed the first existing folder above the loop and passed; the result write failed
    after the training."""
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    before = sorted(Path(tmp_path).rglob("*"))
    assert main(["train", f"results_dir={tmp_path / 'a' / 'res'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("vramsweep train: error: results_dir=")
        and "symlink loop" in err[0]
    )
    assert sorted(Path(tmp_path).rglob("*")) == before


def test_sweep_node_as_a_list_is_one_line(tmp_path, capsys, monkeypatch):
    """A user's sweep file whose ``sweep:`` is a list: ``AttributeError: 'list' object has no attribute 'get'``."""
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "uc" / "sweep"
    conf.mkdir(parents=True)
    (conf / "lst.yaml").write_text("# @package _global_\nsweep:\n  - a\n  - b\n")
    before = sorted(Path(tmp_path).rglob("*"))
    code = main(
        [
            "train",
            "-m",
            f"--config-dir={tmp_path / 'uc'}",
            "sweep=lst",
            *FAKE[:2],
            f"results_dir={tmp_path}/r",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "sweep: is a list, not a mapping" in err[0], err
    assert sorted(Path(tmp_path).rglob("*")) == before


CASES_VALUES: list[tuple[str, str, list[str], dict[str, str], str]] = [
    # item 5 / 8: the model's positions (0 raised ZeroDivisionError; -1 blamed context.max_tokens "32..-1")
    (
        "positions-0",
        "train",
        ["model.max_position_embeddings=0"],
        {},
        "model.max_position_embeddings=0 is out of range",
    ),
    (
        "positions-neg",
        "train",
        ["model.max_position_embeddings=-1"],
        {},
        "model.max_position_embeddings=-1 is out",
    ),
    (
        "positions-neg-estimate",
        "estimate",
        ["model.max_position_embeddings=-1"],
        {},
        "model.max_position_embeddings",
    ),
    # item 3: a model.* value of the embedded base's recipe started a new base's pre-training (2,650 steps,
    # hours on a loaded CPU) before any check
    ("rope-theta-neg", "train", ["model.rope_theta=-1"], {}, "model.rope_theta=-1.0 is out of range (0, "),
    ("rms-eps-neg", "train", ["model.rms_norm_eps=-1"], {}, "model.rms_norm_eps=-1.0 is out of range (0, 1)"),
    (
        "pretrain-batch-0",
        "train",
        ["model.pretrain_batch=0"],
        {},
        "model.pretrain_batch=0 is out of range [1,",
    ),
    # item 4: the optimizer's class and keywords in the sweep's parent, read from source (no torch there);
    # each trial failed on its own (exit 1, a result JSON each)
    (
        "sweep-optimizer-kwarg",
        "train",
        ["-m", "+optimizer.kwargs.foo=1", "adapter.r=4,8", *FAKE],
        {},
        "AdamW takes no keyword 'foo' (optimizer.kwargs.foo)",
    ),
    (
        "sweep-optimizer-kwarg-in-space",
        "train",
        ["-m", "optimizer.kwargs.eps=1e-8,1e-6", "+optimizer.kwargs.bogus=1", "adapter.r=4,8", *FAKE],
        {},
        "takes no keyword 'bogus'",
    ),
    (
        "sweep-optimizer-lr",
        "train",
        ["-m", "+optimizer.kwargs.lr=0.1", "adapter.r=4,8", *FAKE],
        {},
        "optimizer.kwargs.lr duplicates train.lr",
    ),
    (
        "sweep-optimizer-missing-class",
        "train",
        ["-m", "optimizer._target_=torch.optim.AdamWW", "adapter.r=4,8", *FAKE],
        {},
        "optimizer._target_='torch.optim.AdamWW' is not an importable class",
    ),
    (
        "sweep-optimizer-function",
        "train",
        ["-m", "optimizer._target_=torch.optim.adamw.adamw", "adapter.r=4,8", *FAKE],
        {},
        "optimizer._target_='torch.optim.adamw.adamw' names a function, not an optimizer class",
    ),
    (
        "sweep-optimizer-space-value",
        "train",
        ["-m", "optimizer=adamw,adafactor", "+optimizer.kwargs.amsgrad=true", *FAKE],
        {},
        "search space: 'optimizer=adafactor' is invalid: optimizer=adafactor: Adafactor takes no keyword 'amsgrad'",
    ),
    (
        "sweep-optimizer-design-point",
        "train",
        ["-m", "sweep=optimizer", "+optimizer.kwargs.amsgrad=true", *FAKE],
        {},
        "design factor ['optimizer=adafactor', 'train.seed=0'] is invalid: optimizer=adafactor: Adafactor takes no",
    ),
    # item 3: the host check applies on CPU too (231 GiB estimated; it ran, RSS 8.3 GB and growing at 58 s)
    ("cpu-micro-batch-4096", "train", ["train.micro_batch=4096"], {}, "GiB of RAM available on this machine"),
    # item 8: hardware.* ranges
    (
        "hw-flops-neg",
        "train",
        ["hardware.peak_bf16_flops=-1"],
        {},
        "hardware.peak_bf16_flops=-1.0 is out of range",
    ),
    (
        "hw-bandwidth-neg",
        "estimate",
        ["hardware.bandwidth_bytes_per_s=-1"],
        {},
        "hardware.bandwidth_bytes_per_s",
    ),
    (
        "hw-overhead-neg",
        "estimate",
        ["hardware.overhead_bytes=-1"],
        {},
        "hardware.overhead_bytes=-1 is out of range",
    ),
    (
        "hw-budget-above-memory",
        "estimate",
        ["hardware=rtx4080_16gb", "hardware.budget_gib=100"],
        {},
        "hardware.budget_gib=100 is above the card's memory (hardware.memory_gib=16)",
    ),
    ("schema-name", "estimate", ["quant=base_quant"], {}, "unknown option quant=base_quant"),
]


@pytest.mark.parametrize(
    ("case_id", "verb", "argv", "env", "needle"), CASES_VALUES, ids=[c[0] for c in CASES_VALUES]
)
def test_values_refused_naming_their_own_key(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle):
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle)
    assert "context.max_tokens" not in capsys.readouterr().err


#: ``_target_`` values read from source and imported: what the source says must be what the import says.
TARGETS = [
    "torch.optim.AdamW",
    "torch.optim.adamw.AdamW",
    "torch.optim.SGD",
    "torch.optim.Adafactor",
    "torch.optim.Optimizer",
    "torch.optim.AdamWW",
    "torch.optim.adamw.adamw",
    "torch.optim.lr_scheduler",
    "transformers.optimization.Adafactor",
    "transformers.Adafactor",  # a lazy module: not read (None), left to the trial
    "bitsandbytes.optim.AdamW8bit",
    "bitsandbytes.optim.Lion8bit",
    "bitsandbytes.optim.PagedAdamW8bit",
    "bitsandbytes.optim.PagedAdamW32bit",
    "collections.OrderedDict",
    "no_such_package_xyz.Optimizer",  # not installed: a machine matter, left to the trial
]


def _imported(target: str) -> tuple:
    import importlib
    import inspect

    module, _, name = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return ("missing",)
    if not isinstance(obj, type):
        return ("function",) if callable(obj) else ("missing",)
    sig = inspect.signature(obj.__init__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())
    return ("class", obj.__name__, None if var_kw else tuple(sig))


@pytest.mark.parametrize("target", TARGETS)
def test_an_optimizer_read_from_source_is_what_its_import_gives(target):
    """The sweep's parent reads ``optimizer._target_`` from source (it must not import torch); where it
    answers, it answers what importing the class and ``inspect.signature(cls.__init__)`` give."""
    from vramsweep.knobs.optim_source import read_target

    found = read_target(target)
    if target in ("transformers.Adafactor", "no_such_package_xyz.Optimizer", "collections.OrderedDict"):
        assert found is None, found
        return
    assert found is not None, f"{target}: not read from source"
    read = ("class", found.name, found.params) if found.kind == "class" else (found.kind,)
    assert read == _imported(target)


def test_every_shipped_optimizer_is_read_from_source():
    """Each ``conf/optimizer/*.yaml`` class is read (the sweep's parent checks its keywords) and takes
    its option file's keywords."""
    from vramsweep.config import compose
    from vramsweep.knobs.optim import check_optimizer_source
    from vramsweep.knobs.optim_source import read_target

    names = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "optimizer").glob("*.yaml"))
    assert len(names) >= 6, names
    for name in names:
        cfg = compose([f"optimizer={name}"], rules="values")
        found = read_target(str(cfg.optimizer["_target_"]))
        assert found is not None and found.kind == "class", (name, found)
        assert found == read_target(str(cfg.optimizer["_target_"]))
        check_optimizer_source(cfg)


def test_a_users_base_named_option_is_listed_and_composes(tmp_path, capsys, monkeypatch):
    """Only the schema ``base_<group>`` is hidden; a user's ``quant/base_mine.yaml`` was hidden and refused."""
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "uc" / "quant"
    conf.mkdir(parents=True)
    (conf / "base_mine.yaml").write_text("defaults:\n  - base_quant\n  - _self_\nname: none\n")
    assert main(["estimate", f"--config-dir={tmp_path / 'uc'}", "quant=nope"]) == 2
    err = capsys.readouterr().err
    assert "base_mine" in err and "base_quant" not in err, err
    assert main(["estimate", f"--config-dir={tmp_path / 'uc'}", "quant=base_mine"]) == 0, (
        capsys.readouterr().err
    )


def _calibration_sweep(folder: Path) -> Path:
    import json

    from _estimates import SMALL, _fake_result

    (folder / "trials").mkdir(parents=True)
    factors = {"layers": 1.1, "attention": 1.0, "logits": 1.0}
    for i, s in enumerate((64, 128, 256)):
        r = _fake_result([*SMALL, f"context.max_tokens={s}"], factors, folder, i)
        (folder / "trials" / f"{i:04d}.json").write_text(json.dumps(r))
    return folder


def test_calibrate_writes_results_calibration_not_into_the_folder_it_reads(tmp_path, monkeypatch, capsys):
    """docs/ESTIMATOR.md: ``results/calibration/<hardware>.json``; a folder outside ``sweeps/`` got a
    ``calibration/`` written into itself."""
    monkeypatch.chdir(tmp_path)
    sweep = _calibration_sweep(tmp_path / "elsewhere" / "mysweep")
    assert main(["estimate", "--calibrate", str(sweep)]) == 0, capsys.readouterr().err
    assert not (sweep / "calibration").exists()
    assert (tmp_path / "results" / "calibration" / "cpu.json").is_file()


def test_calibrate_into_a_read_only_results_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """The write refused (EACCES, injected: the suite may run as root) -> one line, exit 2, no traceback."""
    monkeypatch.chdir(tmp_path)
    sweep = _calibration_sweep(tmp_path / "res" / "sweeps" / "s")

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("vramsweep.estimate.calibration.atomic_write_json", refuse)
    code = main(["estimate", "--calibrate", str(sweep)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("vramsweep estimate: error: --calibrate: cannot write")
    )
    assert "res/calibration/cpu.json (Permission denied)" in err[0], err


DEEP = "[" * 100_000 + "]" * 100_000  # json raises RecursionError, not ValueError, past ~1,000 levels


def _one_line(capsys, verb: str) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"vramsweep {verb}: error: "), err
    return err[0]


def test_deeply_nested_json_in_a_data_file_names_file_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "deep.jsonl"
    data.write_text('{"id": "a", "sections": ' + DEEP + "}\n")
    before = sorted(tmp_path.rglob("*"))
    assert main(["train", "data=jsonl", f"data.path={data}", f"results_dir={tmp_path}/r"]) == 2
    assert f"{data}:1: invalid JSON: nested too deeply" in _one_line(capsys, "train")
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("verb", ["report", "pick", "calibrate"])
def test_deeply_nested_result_file_is_a_note_not_a_traceback(tmp_path, capsys, monkeypatch, verb):
    import json

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "s"
    (sweep / "trials").mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"name": "s"}))
    (sweep / "trials" / "0000.json").write_text(DEEP)
    argv = {
        "report": ["report", str(sweep)],
        "pick": ["pick", str(sweep), "--budget-gib", "16", "--config-dir", str(tmp_path / "conf")],
        "calibrate": ["estimate", "--calibrate", str(sweep)],
    }[verb]
    assert main(argv) == 2  # the only result is unreadable: nothing to report, said in one line
    line = _one_line(capsys, argv[0])
    if verb == "report":
        assert "skipped 0000.json: unreadable (ValueError: JSON nested too deeply" in line, line


# --- pick leaves nothing behind when a step after the experiment's write fails
def _pick_sweep(tmp_path: Path) -> Path:
    from omegaconf import OmegaConf

    from _reports import result, write_sweep
    from vramsweep.config import compose

    cfg = OmegaConf.to_container(compose(["adapter.r=8"], rules="none"), resolve=True)
    return write_sweep(tmp_path / "sw", [result(0, ["adapter.r=8"], peak=1.0, tps=500, loss=2.0, config=cfg)])


@pytest.mark.parametrize("fails", ["compose", "production.md"])
@pytest.mark.parametrize("old", [None, "# the user's own experiment\n"])
def test_pick_that_fails_after_writing_leaves_the_conf_dir_as_it_was(
    tmp_path, monkeypatch, capsys, fails, old
):
    """It used to leave ``conf/experiment/`` (and, when production.md could not be written, the experiment
    file) behind, and a compose failure deleted a user's experiment of the same name."""
    from vramsweep.report import pick
    from vramsweep.report.load import ReportError

    folder = _pick_sweep(tmp_path)
    conf = tmp_path / "conf"
    if old is not None:
        (conf / "experiment").mkdir(parents=True)
        (conf / "experiment" / "prod.yaml").write_text(old)
    if fails == "compose":

        def verify(*a, **k):
            raise ReportError("a group option vanished")

        monkeypatch.setattr(pick, "verify_experiment", verify)
    else:
        real = pick.atomic_write_text

        def write(path, text):
            if Path(path).name == "production.md":
                raise OSError(28, "No space left on device")
            return real(path, text)

        monkeypatch.setattr(pick, "atomic_write_text", write)
    code = main(["pick", str(folder), "--budget-gib", "4", "--name", "prod", "--config-dir", str(conf)])
    err = capsys.readouterr().err
    assert code == (1 if fails == "compose" else 2), err
    if old is None:
        assert not conf.exists(), sorted(map(str, conf.rglob("*")))
    else:
        assert (conf / "experiment" / "prod.yaml").read_text() == old
        assert sorted(p.name for p in conf.rglob("*")) == ["experiment", "prod.yaml"]
    assert not (folder / "production.md").exists()


def test_a_new_embedded_base_is_announced_with_its_time_after_the_checks(tmp_path, capsys, monkeypatch):
    """A valid ``model.*`` change of the embedded recipe: the pre-flight passes and says, in one line, that
    the first trial pre-trains a new base, which keys changed and roughly how long it takes; nothing is
    built or cached by the pre-flight. The shipped recipe gets no such line."""
    from vramsweep.config import compose
    from vramsweep.preflight import preflight

    monkeypatch.setenv("VRAMSWEEP_CACHE", str(tmp_path / "cache"))
    preflight(compose(["model.rope_theta=2000000", f"results_dir={tmp_path}/r"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.* rope_theta=2000000.0:" in err[0], err
    assert "pre-trains one before it trains (2,650 steps" in err[0] and " min on " in err[0], err
    assert not (tmp_path / "cache" / "embedded").exists()
    preflight(compose([f"results_dir={tmp_path}/r"]))
    assert "pre-trains" not in capsys.readouterr().err


def test_the_cpu_host_check_refuses_above_the_ram_and_names_the_micro_batch_that_fits():
    """hardware=cpu: the estimated peak is host memory; at need > MemAvailable the check names the largest
    micro-batch the estimate fits, and passes at or below it."""
    from vramsweep.config import compose
    from vramsweep.estimate import estimate
    from vramsweep.preflight import check_host_memory

    cfg = compose(["train.micro_batch=8"])
    need = estimate(cfg, calibration=False)["required_bytes"]
    check_host_memory(cfg, available=need)
    with pytest.raises(ConfigError, match=r"micro_batch=8, is more than") as err:
        check_host_memory(cfg, available=need // 2)
    assert err.value.key == "train.micro_batch" and err.value.allowed[0] == "train.micro_batch<=4"
