"""Storage pre-flight on a real PostgreSQL server: a database that does not exist and a user
who may not create Optuna's tables are refused before anything runs (exit 2, one line, password masked,
nothing written); a usable server passes. The unreachable cases (closed port, unknown host) run without a
server in ``tests/cli/test_bad_inputs.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.settings import normalise_storage_url
from vramsweep.sweeper.storage_check import check_storage

pytestmark = pytest.mark.postgres

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.isolation=inprocess",
    "hydra.sweeper.study_name=pgbad",
    "adapter.r=8,16",
]


def _refused(tmp_path, capsys, url: str) -> str:
    """The command in its own process (logging set up by earlier in-process sweeps cannot leak in)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    argv = ["train", "-m", f"results_dir={tmp_path / 'res'}", *FAKE, f"hydra.sweeper.storage={url}"]
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from vramsweep.cli import main; sys.exit(main(sys.argv[1:]))",
            *argv,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    code, err = p.returncode, p.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("vramsweep train: error: hydra.sweeper.storage"), lines[0]
    assert not (tmp_path / "res").exists()
    return lines[0]


def test_server_that_answers_passes(pg_url):
    check_storage(normalise_storage_url(pg_url))


def test_missing_database_is_refused(pg_url, tmp_path, capsys):
    base = pg_url.rsplit("/", 1)[0].replace("vramsweep@", "vramsweep:hunter2@")
    line = _refused(tmp_path, capsys, f"{base}/no_such_db")
    assert 'database "no_such_db" does not exist' in line and "hunter2" not in line and ":***@" in line


def test_user_without_create_privilege_is_refused(pg_url, tmp_path, capsys):
    import sqlalchemy

    if os.environ.get("VRAMSWEEP_PG_URL"):
        pytest.skip("creates a role and revokes CREATE on schema public: only on the throw-away server")

    url = normalise_storage_url(pg_url)
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    with engine.connect() as conn:  # PostgreSQL >= 15: only the owner may create in schema public
        conn.execute(sqlalchemy.text("DROP ROLE IF EXISTS vs_reader"))
        conn.execute(sqlalchemy.text("CREATE ROLE vs_reader LOGIN"))
        conn.execute(sqlalchemy.text("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
        conn.commit()
    engine.dispose()
    reader = pg_url.replace("vramsweep@", "vs_reader@")
    line = _refused(tmp_path, capsys, reader)
    assert "may not create Optuna's tables" in line
    with pytest.raises(ConfigError, match="may not create"):
        check_storage(normalise_storage_url(reader))
