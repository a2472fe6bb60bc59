"""Many workers on one study in a real PostgreSQL server: exactly n_trials, no duplicates, no lock errors.

Starts its own throw-away cluster (initdb + pg_ctl, loopback port, temp dir; as the ``postgres`` user
when run as root), or uses ``VRAMSWEEP_PG_URL``. Skipped when neither is available (fails instead with
``VRAMSWEEP_REQUIRE_PG=1``). CI installs the server binaries in ``.ci/run``.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.postgres

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.preload=[fakes]",
]


def _pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{d}/initdb") and os.path.exists(f"{d}/pg_ctl"):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _skip(why: str) -> None:
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
    if os.environ.get("VRAMSWEEP_PG_URL"):
        yield os.environ["VRAMSWEEP_PG_URL"]
        return
    bindir = _pg_bin()
    if bindir is None:
        _skip("no PostgreSQL server binaries (apt-get install postgresql) and no VRAMSWEEP_PG_URL")
    runas: list[str] = []
    root = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            _skip("running as root and there is no 'postgres' user to run the server")
        runas = ["runuser", "-u", "postgres", "--"]
        os.chown(root, pw.pw_uid, pw.pw_gid)
        for parent in list(root.parents)[:3]:
            os.chmod(parent, os.stat(parent).st_mode | 0o011)  # let the server user traverse the temp dirs
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


def test_four_workers_five_trials_each_make_exactly_twenty(pg_url, tmp_path):
    import optuna
    from optuna.trial import TrialState

    name = f"pg-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, VRAMSWEEP_FAKE=json.dumps({"sleep_s": 0.2}))
    cmd = [
        sys.executable,
        "-m",
        "vramsweep.sweeper",
        f"results_dir={tmp_path}",
        *FAKE,
        "adapter.r=range(1,4000)",
        "train.lr=tag(log,interval(1e-5,1e-2))",
        "hydra.sweeper.sampler=tpe",
        "hydra.sweeper.n_trials=20",
        f"hydra.sweeper.storage={pg_url}",
        f"hydra.sweeper.study_name={name}",
        "hydra.sweeper.dedup=false",
    ]
    # four independent sweeper processes started at once on a fresh database (the create-study race)
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        low = err.lower()
        assert "traceback" not in low and "lock" not in low and "deadlock" not in low, err
    from vramsweep.sweeper.settings import normalise_storage_url

    study = optuna.load_study(study_name=name, storage=normalise_storage_url(pg_url))
    trials = study.trials
    assert len(trials) == 20 and sorted(t.number for t in trials) == list(range(20))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({t.system_attrs["vramsweep:slot"] for t in trials}) == 20
    owners = {t.system_attrs["vramsweep:owner"]["pid"] for t in trials}
    assert len(owners) >= 2, "the four workers shared the work"
    files = sorted((tmp_path / "sweeps" / name / "trials").glob("*.json"))
    assert [int(f.stem) for f in files] == list(range(20))
    assert sum(out.count("/20 trial ") for out, _ in outs) == 20  # each trial reported once
