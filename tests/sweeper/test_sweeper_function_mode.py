"""Function mode: ``hydra/sweeper=vramsweep`` on any Hydra app, like hydra-optuna-sweeper.

The apps below are hydra-optuna-sweeper's example apps (sphere, multi-objective, custom search space),
unchanged except that their config chooses our sweeper; each runs as its own process, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SRC = str(Path(__file__).resolve().parents[2] / "src")

SPHERE = """
import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def sphere(cfg: DictConfig) -> float:
    x: float = cfg.x
    y: float = cfg.y
    return x**2 + y**2


if __name__ == "__main__":
    sphere()
"""
SPHERE_CONF = """
defaults:
  - override hydra/sweeper: vramsweep
  - override hydra/sweeper/sampler: tpe

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: minimize
    study_name: sphere
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(-5.5, 5.5, step=0.5)
      y: choice(-5 ,0 ,5)

x: 1
y: 1
"""
MULTI = """
from typing import Tuple

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def binh_and_korn(cfg: DictConfig) -> Tuple[float, float]:
    x: float = cfg.x
    y: float = cfg.y

    v0 = 4 * x**2 + 4 * y**2
    v1 = (x - 5) ** 2 + (y - 5) ** 2
    return v0, v1


if __name__ == "__main__":
    binh_and_korn()
"""
MULTI_CONF = """
defaults:
  - override hydra/sweeper: vramsweep
  - override hydra/sweeper/sampler: nsgaii

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: [minimize, minimize]
    study_name: multi-objective
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(0, 5, step=0.5)
      y: range(0, 3, step=0.5)

x: 1
y: 1
"""
CUSTOM = """
import hydra
from omegaconf import DictConfig
from optuna.trial import Trial


@hydra.main(version_base=None, config_path="conf", config_name="config")
def multi_dimensional_sphere(cfg: DictConfig) -> float:
    w: float = cfg.w
    x: float = cfg.x
    y: float = cfg.y
    z: float = cfg.z
    return w**2 + x**2 + y**2 + z**2


def configure(cfg: DictConfig, trial: Trial) -> None:
    x_value = trial.params["x"]
    trial.suggest_float(
        "z",
        x_value - cfg.max_z_difference_from_x,
        x_value + cfg.max_z_difference_from_x,
    )
    trial.suggest_float("+w", 0.0, 1.0)  # note +w here, not w as w is a new parameter


if __name__ == "__main__":
    multi_dimensional_sphere()
"""
CUSTOM_CONF = """
defaults:
  - override hydra/sweeper: vramsweep
  - override hydra/sweeper/sampler: tpe

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: minimize
    study_name: custom-search-space
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(-5.5, 5.5, 0.5)
      y: choice(-5, 0, 5)
    custom_search_space: app.configure

x: 1
y: 1
z: 100
max_z_difference_from_x: 0.5
"""


def _run_app(tmp_path: Path, code: str, conf: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conf").mkdir()
    (tmp_path / "app.py").write_text(code)
    (tmp_path / "conf" / "config.yaml").write_text(conf)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)]))
    sweep_dir = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "app.py", "--multirun", f"hydra.sweep.dir={sweep_dir}", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return p, sweep_dir


def test_sphere_example_runs_unchanged(tmp_path):
    p, out = _run_app(tmp_path, SPHERE, SPHERE_CONF)
    assert p.returncode == 0, p.stderr[-2000:]
    res = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert res["best_value"] <= 1.0  # x^2 + y^2 over the grid: 0 at (0, 0); TPE gets there or close
    assert p.stderr.count("Launching 1 jobs locally") == 20 or p.stdout.count("#") >= 20


def test_multi_objective_example_runs_unchanged(tmp_path):
    p, out = _run_app(tmp_path, MULTI, MULTI_CONF)
    assert p.returncode == 0, p.stderr[-2000:]
    res = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert res["solutions"] and all(len(s["values"]) == 2 for s in res["solutions"])


def test_custom_search_space_example_runs_unchanged(tmp_path):
    p, out = _run_app(tmp_path, CUSTOM, CUSTOM_CONF)
    assert p.returncode == 0, p.stderr[-2000:]
    res = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert {"x", "y", "z", "+w"} <= set(res["best_params"])
    assert abs(res["best_params"]["z"] - res["best_params"]["x"]) <= 0.5


def test_grid_and_missing_cmaes_in_function_mode(tmp_path):
    import importlib.util

    p, out = _run_app(
        tmp_path,
        SPHERE,
        SPHERE_CONF,
        "hydra/sweeper/sampler=grid",
        "x=-1,0,1",
        "hydra.sweeper.n_trials=100",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert yaml.safe_load((out / "optimization_results.yaml").read_text())["best_value"] == 0
    if importlib.util.find_spec("cmaes") is None:
        q = subprocess.run(
            [
                sys.executable,
                "app.py",
                "--multirun",
                "hydra/sweeper/sampler=cmaes",
                f"hydra.sweep.dir={tmp_path}/c",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)])),
            timeout=300,
        )
        assert q.returncode == 2 and "cmaes" in q.stderr
        assert not (tmp_path / "c").exists()


def test_a_conf_with_only_sampler_seed_gets_tpe_like_upstream(tmp_path):
    """Upstream's custom-search-space example sets only ``sampler.seed`` (no sampler choice): upstream
    defaults to TPE; we exited 2 with "unknown sampler 'None'"."""
    conf = CUSTOM_CONF.replace("  - override hydra/sweeper/sampler: tpe\n", "")
    assert "sampler: tpe" not in conf
    p, out = _run_app(tmp_path, CUSTOM, conf, "hydra.sweeper.n_trials=4")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "optimization_results.yaml").exists()


def test_a_fixed_command_line_value_pins_a_param(tmp_path):
    """``sphere.py -m y=0``: upstream pins ``y`` and drops it from the search space; every trial had its
    own ``y`` from ``choice(-5, 0, 5)``."""
    p, out = _run_app(tmp_path, SPHERE, SPHERE_CONF, "y=0", "hydra.sweeper.n_trials=5")
    assert p.returncode == 0, p.stderr[-2000:]
    res = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert "y" not in res["best_params"], res
    overrides = [yaml.safe_load(f.read_text()) for f in out.glob("*/.hydra/overrides.yaml")]
    assert overrides and all("y=0" in o for o in overrides), overrides


# --- upstream's plugin tests that failed against our sweeper
UPSTREAM_SPHERE = SPHERE.replace(
    "    y: float = cfg.y\n",
    '    y: float = cfg.y\n    if cfg.get("error", False):\n        raise RuntimeError("cfg.error is True")\n',
)
UPSTREAM_SPHERE_CONF = (
    SPHERE_CONF + "z: 1\n\n# if true, simulate a failure by raising an exception\nerror: false\n"
)


def _run_named_app(
    tmp_path: Path, name: str, code: str, conf: str, *args: str
) -> subprocess.CompletedProcess:
    """Like :func:`_run_app` with the app's own file name (upstream's ``custom-search-space-objective.py``)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / name).write_text(code)
    (tmp_path / "conf" / "config.yaml").write_text(conf)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)]))
    return subprocess.run(
        [sys.executable, name, "--multirun", f"hydra.sweep.dir={tmp_path / 'out'}", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_custom_search_space_by_upstreams_hyphenated_module_name(tmp_path):
    """Upstream's conf says ``custom_search_space: custom-search-space-objective.configure``, which
    ``hydra.utils.get_method`` resolves; we exited 2 ("must be 'module.function'")."""
    conf = CUSTOM_CONF.replace("app.configure", "custom-search-space-objective.configure")
    p = _run_named_app(tmp_path, "custom-search-space-objective.py", CUSTOM, conf, "hydra.sweeper.n_trials=4")
    assert p.returncode == 0, p.stderr[-2000:]
    res = yaml.safe_load((tmp_path / "out" / "optimization_results.yaml").read_text())
    assert {"z", "+w"} <= set(res["best_params"]) and abs(
        res["best_params"]["z"] - res["best_params"]["x"]
    ) <= 0.5


def test_a_custom_search_space_that_does_not_resolve_exits_2_before_any_trial(tmp_path):
    conf = CUSTOM_CONF.replace("app.configure", "app.no_such_function")
    p = _run_named_app(tmp_path, "app.py", CUSTOM, conf)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "hydra.sweeper.custom_search_space='app.no_such_function' does not resolve" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


def test_motpe_says_in_one_line_that_it_runs_tpe(tmp_path):
    """Upstream's ``test_example_with_removed_motpe``: stderr names 'motpe' and "sampler was removed in
    Optuna 4.0" (we mapped it to TPE without a word)."""
    conf = MULTI_CONF.replace("sampler: nsgaii", "sampler: motpe")
    p = _run_named_app(tmp_path, "app.py", MULTI, conf, "hydra.sweeper.n_trials=3")
    assert p.returncode == 0, p.stderr[-2000:]
    said = [ln for ln in p.stderr.splitlines() if "sampler was removed in Optuna 4.0" in ln]
    assert len(said) == 1 and "motpe" in said[0] and "TPESampler" in said[0], p.stderr[-2000:]


@pytest.mark.parametrize("max_failure_rate", (0.5, 1.0))
def test_failure_rate_stderr_wording_as_upstream(tmp_path, max_failure_rate):
    """Upstream's ``test_failure_rate``: under ``max_failure_rate=1.0`` failures are warnings and
    ``RuntimeError: cfg.error is True`` is not in stderr; below 1.0 the abort carries it."""
    p = _run_named_app(
        tmp_path,
        "sphere.py",
        UPSTREAM_SPHERE,
        UPSTREAM_SPHERE_CONF,
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=123",
        f"hydra.sweeper.max_failure_rate={max_failure_rate}",
        "error=true",
    )
    error_string = "RuntimeError: cfg.error is True"
    if max_failure_rate < 1.0:
        assert p.returncode == 1 and error_string in p.stderr, p.stderr[-2000:]
    else:
        assert error_string not in p.stderr, p.stderr[-2000:]
        assert "cfg.error is True" in p.stderr  # still said, as a warning per trial


class _Ret:
    """A launched job's return: its value, or the app's exception when read (as Hydra's JobReturn)."""

    def __init__(self, value):
        self.value = value

    @property
    def return_value(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _OneFailsLauncher:
    """Runs nothing: the second job fails, every other returns 1.0."""

    def __init__(self):
        self.jobs = 0

    def launch(self, overrides, initial_job_idx):
        out = []
        for _ in overrides:
            out.append(_Ret(RuntimeError("boom") if self.jobs == 1 else 1.0))
            self.jobs += 1
        return out


def test_function_mode_uses_the_declared_max_failure_rate_default(capsys):
    """A ``hydra.sweeper`` node without ``max_failure_rate`` gets the declared default (0.5, SweeperConf) in
    function mode too: 1 failure in 2, then in 4, trials is tolerated (it used to default to 0.0 there and abort)."""
    from omegaconf import OmegaConf

    from vramsweep.sweeper.function_mode import plan_function_sweep, run_function_sweep
    from vramsweep.sweeper.settings import SweeperConf

    settings = {
        "params": {"x": "choice(1,2,3,4)"},
        "n_trials": 4,
        "n_jobs": 1,
        "sampler": "random",
        "seed": 1,
    }
    assert plan_function_sweep(settings, []).conf.max_failure_rate == SweeperConf.max_failure_rate == 0.5
    launcher = _OneFailsLauncher()
    assert run_function_sweep(settings, [], OmegaConf.create({}), lambda: launcher) == 0, (
        capsys.readouterr().err
    )
    assert launcher.jobs == 4
    assert "ABORTED" not in capsys.readouterr().err
