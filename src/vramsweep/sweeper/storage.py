"""Study storage: create once, trial slots, exact resume, heartbeat and stale-trial reconciliation.

Why slots: ``n_trials`` is the study *total*. Before any worker starts, the sweep tops the study up with
WAITING trials carrying a ``vramsweep:slot`` number (0..n_trials-1) until every slot exists; workers
only ever *pop* WAITING slots (never ``study.ask()`` a fresh trial), so N workers on M machines run
exactly the remainder and never overshoot. A search slot has no params (the sampler fills them when
it is popped); a design slot carries its point as fixed params.

Why our own heartbeat: Optuna's heartbeat only runs inside ``Study.optimize``; we use ask/tell. Each
worker stamps ``vramsweep:heartbeat`` on its RUNNING trials and records its owner (host, pid, process
start time). A RUNNING trial is stale when its owner process on this host is gone (detected at once)
or its heartbeat is older than ``grace_s`` (other hosts). A stale trial whose result JSON exists is
told from that JSON (no re-run, no duplicate); otherwise it is failed with status ``error`` (marked
``vramsweep:lost``) and its config re-enqueued into the same slot (``retry_of``), up to
``hydra.sweeper.retry_stale`` times per point (``vramsweep:retries`` counts them); a later run with a
higher bound retries a point that ran out (:func:`requeue_lost`).

All of this runs under a storage-wide lock (SQLite: a lock file next to the DB; PostgreSQL:
``pg_advisory_lock``; MySQL: ``GET_LOCK``), which also removes the create-study race (two workers creating one
study at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.preflight import sqlite_path  # noqa: F401 - re-exported (storage.sqlite_path)

log = logging.getLogger("vramsweep.sweeper")

SLOT = "vramsweep:slot"
RETRY_OF = "vramsweep:retry_of"
RETRIES = "vramsweep:retries"
OWNER = "vramsweep:owner"
HEARTBEAT = "vramsweep:heartbeat"
FINGERPRINT = "vramsweep:fingerprint"
#: On a trial that copied an earlier trial's outcome (a re-proposed point): not counted toward n_trials.
COPY_OF = "vramsweep:copy_of"
#: On a trial recorded from the memory estimate alone by ``sweep.edge_screen`` (no trial process): not
#: counted toward n_trials either (:mod:`vramsweep.sweeper.edge`).
SCREENED = "vramsweep:screened"
LOST = "vramsweep:lost"  # the trial's worker died (or Ctrl-C stopped it): its point is retried
#: On a lost trial whose launcher job was lost (cancelled, preempted, node lost, not submitted): every run
#: retries it again (up to ``retry_stale`` times within the run); the value says how it was lost.
JOB_LOST = "vramsweep:job_lost"
#: study attr: the lost trials whose recorded launcher job a re-run made sure is gone (each asked once)
JOB_STOPPED = "vramsweep:job_stopped"

_thread_lock = threading.RLock()
_engines: dict[str, Any] = {}


def make_storage(url: str, *, child: bool = False) -> Any:
    """An Optuna ``RDBStorage`` with settings that survive several processes on one DB.

    Args:
        url: storage URL.
        child: a trial process reporting intermediate values (tables already exist: skip creation).
    """
    import optuna

    engine_kwargs: dict[str, Any] = {}
    path = sqlite_path(url)
    if path is not None:
        engine_kwargs["creator"] = lambda: _sqlite_connect(path)
    elif url.startswith("sqlite"):
        engine_kwargs["connect_args"] = {"timeout": 120}
    else:
        engine_kwargs["pool_pre_ping"] = True
    return optuna.storages.RDBStorage(
        url, engine_kwargs=engine_kwargs, skip_table_creation=child, skip_compatibility_check=child
    )


def _sqlite_connect(path: Path) -> Any:
    """A SQLite connection in WAL mode with ``synchronous=NORMAL``.

    Each Optuna write is its own transaction; with the default rollback journal every one of them
    fsyncs (~20-30 ms on our machines, ~0.4 s per told trial). WAL + NORMAL commits without waiting for
    the disk (a power cut may lose the last commits, never corrupt the file), and readers (the
    dashboard, trial processes reporting) no longer block the writer. WAL needs a local disk: on a
    shared filesystem use PostgreSQL.
    """
    import sqlite3

    conn = sqlite3.connect(str(path), timeout=120, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def storage_lock(url: str, study_name: str) -> Iterator[None]:
    """A lock shared by every process using this storage and study (re-entrant within a thread)."""
    with _thread_lock:
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(str(path) + ".lock", "a+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
            return
        if url.startswith(("postgresql", "mysql")):
            import sqlalchemy

            engine = _engines.get(url)
            if engine is None:
                engine = _engines[url] = sqlalchemy.create_engine(
                    url, pool_pre_ping=True, poolclass=sqlalchemy.pool.NullPool
                )
            key = _lock_key(f"vramsweep:{study_name}")
            with engine.connect() as conn:
                if url.startswith("postgresql"):
                    conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
                    conn.commit()
                    try:
                        yield
                    finally:
                        conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                        conn.commit()
                else:
                    name = f"vramsweep:{key}"
                    conn.execute(sqlalchemy.text("SELECT GET_LOCK(:n, 600)"), {"n": name})
                    try:
                        yield
                    finally:
                        conn.execute(sqlalchemy.text("SELECT RELEASE_LOCK(:n)"), {"n": name})
            return
        yield


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """``{host, pid, ctime}`` of a process (ctime tells a recycled pid apart)."""
    import psutil

    pid = os.getpid() if pid is None else pid
    try:
        ctime = psutil.Process(pid).create_time()
    except psutil.Error:
        ctime = None
    return {"host": socket.gethostname(), "pid": pid, "ctime": ctime}


def owner_alive(owner: dict[str, Any]) -> bool | None:
    """``True``/``False`` for an owner on this host; ``None`` when it lives elsewhere (use the heartbeat)."""
    import psutil

    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(owner["pid"]))
        if owner.get("ctime") is not None and abs(proc.create_time() - float(owner["ctime"])) > 1e-3:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def is_stale(trial: Any, grace_s: float, now: float | None = None) -> bool:
    """Whether a RUNNING trial's worker is gone."""
    now = time.time() if now is None else now
    attrs = trial.system_attrs
    alive = owner_alive(attrs.get(OWNER))
    if alive is not None:
        return not alive
    beat = attrs.get(HEARTBEAT)
    if beat is None:
        start = trial.datetime_start.timestamp() if trial.datetime_start else now
        beat = start
    return now - float(beat) > grace_s


def load_or_create_study(plan: Any, sampler: Any, pruner: Any) -> Any:
    """Create the study once (under the storage lock) or load it; check it matches this sweep.

    Raises:
        ConfigError: the study exists with other objectives (use another ``study_name``).
    """
    import optuna

    directions = [o.direction for o in plan.goals]
    names = [o.metric for o in plan.goals]
    with storage_lock(plan.storage_url, plan.study_key):
        storage = make_storage(plan.storage_url)
        study = optuna.create_study(
            storage=storage,
            study_name=plan.study_key,
            directions=directions,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
        existing = [d.name.lower() for d in study.directions]
        stored_names = study.metric_names
        if existing != directions or (stored_names is not None and list(stored_names) != names):
            raise ConfigError(
                f"study '{plan.study_key}' in {plan.storage_url.split('@')[-1]} already exists with "
                f"objectives {stored_names or '?'} {existing}, not {names} {directions}: pick another "
                "hydra.sweeper.study_name or delete the study",
                key="hydra.sweeper.study_name",
            )
        if stored_names is None:
            study.set_metric_names(names)
    return study


def trial_counts(study: Any) -> dict[str, int]:
    """Counts by state over the trials that count toward ``n_trials`` (retried stale trials, copies of
    re-proposed points and points screened by ``sweep.edge_screen`` do not)."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs.get(RETRY_OF) for t in trials} - {None}
    out: dict[str, int] = {}
    for t in trials:
        if t.number in retried or t.system_attrs.get(COPY_OF) is not None or t.system_attrs.get(SCREENED):
            continue
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def requeue_lost(study: Any) -> list[Any]:
    """The lost trials (``LOST``: dead worker, Ctrl-C) that are the *last* trial of their slot, i.e. whose
    point has no retry yet: candidates for another retry when the bound allows. Call under the lock."""
    from optuna.trial import TrialState

    last: dict[int, Any] = {}
    for t in study.get_trials(deepcopy=False):
        slot = t.system_attrs.get(SLOT)
        if slot is None:
            continue
        if int(slot) not in last or t.number > last[int(slot)].number:
            last[int(slot)] = t
    return [t for t in last.values() if t.state == TrialState.FAIL and t.system_attrs.get(LOST)]


def top_up(study: Any, n_total: int, slot_attrs: Any) -> int:
    """Enqueue a WAITING trial for every slot in ``range(n_total)`` that has none. Call under the lock.

    Args:
        slot_attrs: ``callable(slot) -> (system_attrs, user_attrs)`` for a new slot.

    Returns:
        How many slots were added.
    """
    from optuna.trial import TrialState, create_trial

    present = {t.system_attrs.get(SLOT) for t in study.get_trials(deepcopy=False)}
    added = 0
    for k in range(n_total):
        if k in present:
            continue
        system_attrs, user_attrs = slot_attrs(k)
        study.add_trial(
            create_trial(
                state=TrialState.WAITING, system_attrs={**system_attrs, SLOT: k}, user_attrs=user_attrs
            )
        )
        added += 1
    return added


def pop_slot(study: Any, n_total: int, claim: Callable[[int], None] | None = None) -> int | None:
    """Atomically take the lowest WAITING slot below ``n_total``; its trial id, or ``None``.

    ``claim(trial_id)`` runs *before* the trial turns RUNNING (it stamps the owner and heartbeat): a sweeper
    killed between the two writes leaves a WAITING trial with an owner (harmless: the next pop stamps its
    own), never a RUNNING trial without one (which no re-run could tell from a live one for ``grace_s``)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage
    waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
    for t in sorted(waiting, key=lambda t: t.number):
        slot = t.system_attrs.get(SLOT)
        if slot is None or int(slot) >= n_total:
            continue
        try:
            if claim is not None:
                claim(t._trial_id)
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t._trial_id
        except UpdateFinishedTrialError:
            continue
    return None


def remaining_slots(study: Any, n_total: int) -> tuple[int, int]:
    """``(waiting, running)`` among the counted slots below ``n_total``."""
    from optuna.trial import TrialState

    waiting = running = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)):
        slot = t.system_attrs.get(SLOT)
        if slot is None or int(slot) >= n_total:
            continue
        if t.state == TrialState.WAITING:
            waiting += 1
        else:
            running += 1
    return waiting, running
