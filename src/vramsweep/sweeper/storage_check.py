"""Storage pre-flight: the study storage can be reached and written, checked before anything is made.

``hydra.sweeper.storage=sqlite:////proc/x/study.db`` used to fail with a long traceback after the sweep
folder was created, and an unreachable PostgreSQL server with a longer one. :func:`check_storage` runs in
the sweep's pre-flight (:func:`vramsweep.preflight.preflight_sweep`) and raises one
:class:`~vramsweep.config.compose.ConfigError` naming the URL (password masked) and the cause:

* SQLite: the URL names a file; the file, if it exists, is a writable file (not a folder); the folder
  that will hold it (and its ``-wal``/``-shm``/``.lock`` files) accepts files. A probe file is created and
  removed in the nearest folder that exists; no folder is created.
* PostgreSQL / MySQL: the driver is installed and the server answers within :data:`CONNECT_TIMEOUT_S`
  (``SELECT 1``); on PostgreSQL the user may also create Optuna's tables (or write them, when they exist).
"""

from __future__ import annotations

import os
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.preflight import check_writable, sqlite_path
from vramsweep.sweeper.settings import mask_secret, mask_url

#: Seconds to wait for a database server before the sweep is refused (libpq/pymysql ``connect_timeout``).
CONNECT_TIMEOUT_S = 5
KEY = "hydra.sweeper.storage"
ALLOWED = ["sqlite:///<writable folder>/study.db", "postgresql://user@host:5432/db (a server that answers)"]


def _cause(exc: BaseException, secret: str | None, url: str = "") -> str:
    """The driver's first line (``connection ... failed: Connection refused``), never the password."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(line.strip() for line in str(orig).strip().splitlines()[:2] if line.strip())
    text = text or type(orig).__name__
    if secret:
        text = text.replace(secret, "***")
    return mask_secret(text, url)[:300]


def check_storage(url: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`ConfigError` unless the study storage ``url`` can be reached (or created) and written.

    Writes nothing that stays: a probe file in the nearest existing folder of a SQLite path, a read-only
    query on a server.
    """
    if url.startswith("sqlite"):
        _check_sqlite(url)
    elif url.startswith(("postgresql", "mysql")):
        _check_server(url, timeout_s)


def _check_sqlite(url: str) -> None:
    path = sqlite_path(url)
    shown = mask_url(url)
    if path is None:
        raise ConfigError(
            f"{KEY}={shown!r} names no database file (an in-memory study cannot be shared with "
            "trial processes or resumed)",
            key=KEY,
            allowed=ALLOWED[:1],
        )
    if path.is_dir():
        raise ConfigError(
            f"{KEY}={shown!r}: {path} is a folder, not a database file", key=KEY, allowed=ALLOWED[:1]
        )
    folder = path.parent
    # the folder holds the database's -wal/-shm files and the sweep's lock file: it must take new files
    check_writable(folder, key=KEY, label=f"{KEY}={shown!r}: the folder {folder}")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ConfigError(f"{KEY}={shown!r}: {path} is not writable", key=KEY, allowed=ALLOWED[:1])


def _check_server(url: str, timeout_s: float) -> None:
    import sqlalchemy

    shown = mask_url(url)
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's URL
        raise ConfigError(
            f"{KEY}={shown!r} is not a valid URL: {_cause(exc, None)}", key=KEY, allowed=ALLOWED
        ) from None
    secret = parsed.password
    try:
        engine = sqlalchemy.create_engine(
            url, poolclass=sqlalchemy.pool.NullPool, connect_args={"connect_timeout": int(max(1, timeout_s))}
        )
    except (ImportError, sqlalchemy.exc.NoSuchModuleError) as exc:
        raise ConfigError(
            f"{KEY}={shown!r}: the database driver is not installed ({_cause(exc, secret, url)})",
            key=KEY,
            allowed=["pip install psycopg2-binary (PostgreSQL)", "pip install pymysql (MySQL)"],
        ) from None
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
            if parsed.get_backend_name() == "postgresql":
                _check_pg_privileges(conn, shown)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - refused, timed out, unknown host, bad password, no such db
        raise ConfigError(
            f"{KEY}: cannot connect to {shown}: {_cause(exc, secret, url)}",
            key=KEY,
            allowed=ALLOWED,
        ) from None
    finally:
        engine.dispose()


def _check_pg_privileges(conn: Any, shown: str) -> None:
    """Optuna creates its tables on first use and inserts trials: the user must be allowed to."""
    import sqlalchemy

    exists = conn.execute(sqlalchemy.text("SELECT to_regclass('studies') IS NOT NULL")).scalar()
    if exists:
        ok = conn.execute(sqlalchemy.text("SELECT has_table_privilege('studies', 'INSERT')")).scalar()
        what = "insert into Optuna's tables"
    else:
        ok = conn.execute(
            sqlalchemy.text(
                "SELECT current_schema() IS NOT NULL AND has_schema_privilege(current_schema(), 'CREATE')"
            )
        ).scalar()
        what = "create Optuna's tables (no CREATE privilege on the current schema)"
    if not ok:
        raise ConfigError(f"{KEY}: the user of {shown} may not {what}", key=KEY, allowed=ALLOWED)
