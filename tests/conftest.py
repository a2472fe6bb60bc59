"""Shared fixtures: one cached embedded model per session, isolated results folders, no network."""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from vramsweep.record.result import RESULT_LOG_ENV

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VRAMSWEEP_CACHE", str(ROOT / ".cache" / "vramsweep"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# train.dtype=auto is bf16 on a CPU with native bf16, else fp32: the suite's figures assume bf16 everywhere.
os.environ.setdefault("VRAMSWEEP_CPU_BF16", "native")
# The suite composes from the packaged conf only (a developer's own conf dir must not change results).
os.environ.pop("VRAMSWEEP_CONFIG_DIR", None)
# A suite started in the background by a non-interactive shell inherits SIGINT ignored (POSIX), and Python
# then never raises KeyboardInterrupt: the Ctrl-C tests (interrupt_main, SIGINT to a sweeper process) would
# wait forever. Python's own handler back; processes the tests start inherit the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Test doubles (tests/fakes.py, ...) are importable by the trial and sweeper processes tests start too.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)

# Every result JSON the product writes during the session (record.write_result, in this process or any
# trial/sweeper process it starts) is checked against the schema (record.schema.check_result) and logged
# here as ``ok|bad <path> [error]``; the autouse fixture below fails the test that produced a bad one.
RESULT_LOG = Path(tempfile.mkdtemp(prefix="vramsweep-result-log-")) / "results.log"
RESULT_LOG.touch()
os.environ[RESULT_LOG_ENV] = str(RESULT_LOG)


def result_log_lines(start: int = 0) -> list[str]:
    """Lines of the session's result log from byte offset ``start``."""
    with open(RESULT_LOG, encoding="utf-8") as fh:
        fh.seek(start)
        return fh.read().splitlines()


@pytest.fixture(autouse=True)
def results_follow_the_schema():
    """Fail a test whose run wrote a result JSON that breaks the schema (docs/CONTRACTS.md)."""
    start = RESULT_LOG.stat().st_size
    yield
    bad = [line.split("\t", 1)[1] for line in result_log_lines(start) if line.startswith("bad\t")]
    if bad:
        pytest.fail("result JSON breaks the schema (docs/CONTRACTS.md): " + "; ".join(bad), pytrace=False)


# Without torch (the Python 3.12 job: `make test-py312`) only tests marked ``torchfree`` run: modules that
# mark none are not imported (most import torch at the top), the other tests of a module are skipped.
HAS_TORCH = importlib.util.find_spec("torch") is not None
collect_ignore = (
    []
    if HAS_TORCH
    else [
        str(p.relative_to(_TESTS))
        for p in Path(_TESTS).rglob("test_*.py")
        if "torchfree" not in p.read_text()
    ]
)


def pytest_collection_modifyitems(config, items):
    if HAS_TORCH:
        return
    skip = pytest.mark.skip(reason="needs torch (not installed here; only torchfree tests run)")
    for item in items:
        if "torchfree" not in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    lines = result_log_lines() if RESULT_LOG.exists() else []
    if lines:
        n_bad = sum(line.startswith("bad\t") for line in lines)
        terminalreporter.write_line(f"result JSONs checked against the schema: {len(lines)} ({n_bad} bad)")


def pytest_unconfigure(config):
    shutil.rmtree(RESULT_LOG.parent, ignore_errors=True)


# Small, fast trial settings shared by tests that run real trials on the embedded model.
FAST = [
    "train.steps=4",
    "train.measure_warmup_steps=2",
    "train.eval_batches=1",
    "train.warmup_steps=0",
    "data.num_docs=4",
    "data.num_eval_docs=1",
    "context.max_tokens=128",
]


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """Build (or reuse) the cached embedded model once per session."""
    from vramsweep.config import compose
    from vramsweep.embedded import ensure_embedded

    cfg = compose([])
    return ensure_embedded(cfg.model, progress=False)


@pytest.fixture()
def fake_unsloth(monkeypatch):
    """A fake ``unsloth`` whose ``FastLanguageModel`` records the keyword arguments of each call
    (``{"from_pretrained": {...}, "get_peft_model": {...}}``, the dict returned): ``from_pretrained`` gives
    a 4x4 ``Linear`` with ``kind="base"`` and ``"tokenizer"``; ``get_peft_model`` marks it ``kind="peft"``."""
    import torch

    calls: dict[str, dict] = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kw):
            calls["from_pretrained"] = kw
            model = torch.nn.Linear(4, 4)
            model.kind = "base"
            return model, "tokenizer"

        @staticmethod
        def get_peft_model(model, **kw):
            calls["get_peft_model"] = kw
            model.kind = "peft"
            return model

    mod = types.ModuleType("unsloth")
    mod.FastLanguageModel = FastLanguageModel
    monkeypatch.setitem(sys.modules, "unsloth", mod)
    return calls


def slurm_skip(why: str) -> None:
    """Skip, saying why - or fail where CI says the SLURM cluster is up (``VRAMSWEEP_REQUIRE_SLURM=1``)."""
    if os.environ.get("VRAMSWEEP_REQUIRE_SLURM") == "1":
        pytest.fail(f"VRAMSWEEP_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


def slurm_cluster(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``bash scripts/slurm_local.sh <args>`` (start, ctld-stop, ...), its output captured."""
    script = ROOT / "scripts" / "slurm_local.sh"
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm():
    """A running single-node SLURM cluster with accounting (left running: CI stops it with the machine)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        slurm_skip("SLURM is not installed (bash scripts/slurm_local.sh install)")
    if os.geteuid() != 0:
        slurm_skip("starting a SLURM cluster needs root")
    p = slurm_cluster("start")
    if p.returncode == 3:
        slurm_skip(f"SLURM cannot start here: {p.stderr.strip()[-300:]}")
    if p.returncode != 0:
        slurm_skip(f"scripts/slurm_local.sh start failed (rc {p.returncode}): {p.stderr.strip()[-800:]}")


def _pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{d}/initdb") and os.path.exists(f"{d}/pg_ctl"):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def pg_skip(why: str) -> None:
    """Skip, unless CI demands the server (``VRAMSWEEP_REQUIRE_PG=1``): then fail loudly."""
    if os.environ.get("VRAMSWEEP_REQUIRE_PG") == "1":
        pytest.fail(f"VRAMSWEEP_REQUIRE_PG=1 but {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pg_url(tmp_path_factory):
    """The URL of a PostgreSQL database: ``VRAMSWEEP_PG_URL``, or a throw-away server (initdb + pg_ctl,
    loopback port, temp folder; as the ``postgres`` user when run as root) stopped after the module."""
    if os.environ.get("VRAMSWEEP_PG_URL"):
        yield os.environ["VRAMSWEEP_PG_URL"]
        return
    bindir = _pg_bin()
    if bindir is None:
        pg_skip("no PostgreSQL server binaries (apt-get install postgresql) and no VRAMSWEEP_PG_URL")
    runas: list[str] = []
    root = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pg_skip("running as root and there is no 'postgres' user to run the server")
        runas = ["runuser", "-u", "postgres", "--"]
        # Not under pytest's temp root: pytest resets it to 0700 whenever a pytest session starts (another
        # test run on the machine), and the server user must traverse it.
        root = Path(tempfile.mkdtemp(prefix="vramsweep-pg-"))
        os.chown(root, pw.pw_uid, pw.pw_gid)
    data, port = root / "data", _free_port()
    subprocess.run(
        [
            *runas,
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "vramsweep",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *runas,
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://vramsweep@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*runas, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(root, ignore_errors=True)


def trial_spec(tmp_path: Path, n: int = 0, **kw):
    """A ``TrialSpec`` for trial ``n`` writing ``tmp_path/NNNN.json``: sweep and study ``s``, no storage, no
    objectives, the built-in trial function; ``kw`` sets any other field."""
    from vramsweep.sweeper.trialproc import TrialSpec

    fields = {
        "number": n,
        "trial_id": n,
        "slot": n,
        "overrides": [],
        "result_path": str(tmp_path / f"{n:04d}.json"),
        "sweep_name": "s",
        "study_name": "s",
        "storage": "",
        "objectives": [],
        "trial_fn": "vramsweep.trial:run_trial_overrides",
    }
    return TrialSpec(**{**fields, **kw})


@pytest.fixture()
def results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    return d


@pytest.fixture(autouse=True)
def _no_conf_dir_leaks():
    """``vramsweep train --config-dir`` (and ``./conf``) export ``VRAMSWEEP_CONFIG_DIR`` for the trial
    processes; a test that runs the CLI must not leave it to the next test."""
    yield
    os.environ.pop("VRAMSWEEP_CONFIG_DIR", None)
