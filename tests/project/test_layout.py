"""The layout the design card names: top-level ``conf/`` (config groups, ``train.yaml``) and
``sweeps/`` (the sweep files, the config group ``sweep``) are the source of truth; ``results/`` is the
default output folder and git-ignored; a user's conf dir still layers on top, for sweeps too."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_conf_and_sweeps_are_what_composes():
    from vramsweep.config.paths import packaged_conf_dir, packaged_sweeps_dir

    assert packaged_conf_dir() == ROOT / "conf" and (ROOT / "conf" / "train.yaml").is_file()
    assert packaged_sweeps_dir() == ROOT / "sweeps" and (ROOT / "sweeps" / "demo.yaml").is_file()
    assert not (ROOT / "src" / "vramsweep" / "conf").exists()  # one copy: the wheel's is made at build time
    assert not (ROOT / "conf" / "sweep").exists()


def test_results_is_the_default_output_folder_and_ignored():
    import yaml

    assert yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["results_dir"] == "results"
    assert "results/" in (ROOT / ".gitignore").read_text().split()


def test_shipped_sweep_composes_and_lists():
    from vramsweep.config import compose, list_options

    assert {"demo", "quant", "production_16gb"} <= set(list_options("sweep"))
    cfg = compose(["sweep=quant"], rules="none")
    assert cfg.sweep.name == "quant" and cfg.sweep.design == "ablation"


def test_a_users_sweep_of_the_same_name_wins(tmp_path):
    from vramsweep.config import compose, list_options
    from vramsweep.config.paths import find_option

    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "quant.yaml").write_text(
        "# @package _global_\nsweep:\n  name: my_quant\n  design: grid\n"
    )
    (tmp_path / "sweep" / "extra.yaml").write_text("# @package _global_\nsweep:\n  name: extra\n")
    assert find_option("sweep", "quant", tmp_path) == tmp_path / "sweep" / "quant.yaml"
    assert {"extra", "quant", "demo"} <= set(list_options("sweep", tmp_path))
    assert compose(["sweep=quant"], conf_dir=tmp_path, rules="none").sweep.name == "my_quant"
    assert compose(["sweep=demo"], conf_dir=tmp_path, rules="none").sweep.name == "demo"  # shipped


def test_unknown_sweep_names_the_shipped_options():
    """``sweep`` is an optional group (Hydra ignores an unknown option of one): the pre-flight names it."""
    from vramsweep.config import ConfigError
    from vramsweep.preflight import check_named_options

    with pytest.raises(ConfigError) as err:
        check_named_options(["sweep=nope"])
    assert "nope" in str(err.value) and "demo" in str(err.value) and "sweeps/" in str(err.value)


def test_the_sweeps_source_is_only_the_sweep_group(tmp_path):
    from hydra.core.object_type import ObjectType

    from hydra_plugins.vramsweep_sweeper.sweeps_source import SweepsConfigSource

    (tmp_path / "a.yaml").write_text("x: 1\n")
    src = SweepsConfigSource("t", str(tmp_path))
    assert src.list("", ObjectType.GROUP) == ["sweep"] and src.list("", ObjectType.CONFIG) == []
    assert src.list("sweep", None) == ["a"]
    assert src.is_config("sweep/a") and not src.is_config("quant/a") and not src.is_config("a")
    assert src.is_group("sweep") and not src.is_group("quant")
    assert src.load_config("sweep/a").config.x == 1
