"""Load a sweep's trial results from a sweep folder or an Optuna storage, tolerating partial data.

A sweep folder (docs/CONTRACTS.md) holds ``sweep.json``, ``trials/<NNNN>.json`` (result JSON) and usually
``study.db``. Result JSONs are the primary record; trials that exist only in the study (still running, or
killed before their JSON was written) are filled in from the study so a partial or multi-worker sweep
shows every trial. A storage URL + study name is read the same way from the trials' user attrs
(``result`` dict or ``result_path``), falling back to ``trial.params``/``trial.values``.

Every result dict is read through :meth:`vramsweep.record.schema.TrialResult.from_json` (the contract,
docs/CONTRACTS.md). One that fails it (an old, hand-written or damaged file) is still read, key by key
and tolerantly, with the schema error kept in :attr:`TrialRecord.problem` and noted.

Nothing here raises on bad *data* (missing keys, NaN, unreadable files become notes); bad *input*
(missing folder, unknown study) raises :class:`ReportError`, which the CLI turns into exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramsweep.config.errors import ConfigError
from vramsweep.config.paths import check_path_names
from vramsweep.config.urls import mask_secret, mask_url, normalise_storage_url
from vramsweep.record import feasibility
from vramsweep.record.metrics import SCALAR_METRICS, direction
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import loads_json, read_json_file
from vramsweep.record.schema import ResultSchemaError, TrialResult
from vramsweep.record.status import Status
from vramsweep.record.units import GIB

#: Report-only status of a study trial without a result JSON (still running, or killed before writing).
RUNNING = "running"
#: Objectives used when ``sweep.json`` names none.
DEFAULT_OBJECTIVES: tuple[tuple[str, str], ...] = tuple(
    (m, direction(m)) for m in (M.PEAK_MEMORY_BYTES, M.TOKENS_PER_S, M.EVAL_LOSS)
)
#: Override keys that never describe a knob of the trial itself.
_IGNORED_KEYS = ("sweep", "hydra", "experiment")
#: Keys ignored when deciding whether two trials ran the same design point (seed repeats differ here).
REPEAT_KEYS = ("train.seed",)


class ReportError(Exception):
    """Bad input for ``report``/``pick`` (missing folder, unknown study, bad argument): exit code 2."""


def num(value: Any) -> float | None:
    """``value`` as a finite float, else None (bools, strings, NaN and inf are not measurements)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def parse_override(text: str) -> tuple[str, str] | None:
    """Split a Hydra override ``[+|++]key=value`` into ``(key, value)``; None for deletions/garbage.

    Sweep selection and ``hydra.*`` settings are not knobs and return None too.
    """
    text = str(text).strip()
    if not text or text.startswith("~") or "=" not in text:
        return None
    key, value = text.split("=", 1)
    key = key.lstrip("+").strip()
    if key.startswith("override "):
        key = key[len("override ") :].strip()
    key = key.lstrip("/")
    if not key or key.split(".")[0].split("/")[0] in _IGNORED_KEYS:
        return None
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return key, value


def override_dict(overrides: Iterable[str]) -> dict[str, str]:
    """Overrides as ``{key: value}`` (last one wins), knobs only."""
    out: dict[str, str] = {}
    for text in overrides or ():
        kv = parse_override(text)
        if kv is not None:
            out[kv[0]] = kv[1]
    return out


def norm_value(value: Any) -> str:
    """Canonical string for comparing a knob value across overrides and configs (16 == "16" == 16.0)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(float(value))
    if isinstance(value, list | tuple):
        return "[" + ",".join(norm_value(v) for v in value) + "]"
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    low = text.lower()
    if low in ("true", "false", "null", "none"):
        return "null" if low in ("null", "none") else low
    try:
        return repr(float(text))
    except ValueError:
        return text


def display_value(value: Any) -> str:
    """Short human form of a knob value for tables and labels."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(display_value(v) for v in value) + "]"
    return str(value)


def _default_direction(metric: str) -> str:
    """The registry's direction of ``metric``; ``minimize`` for a metric the registry does not know."""
    try:
        return direction(metric)
    except KeyError:
        return "minimize"


def _lookup(config: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def as_status(value: Any) -> Status | str:
    """A recorded status as its :class:`Status` member (missing: ``error``). The report-only
    :data:`RUNNING` and a status outside the contract (a hand-written or damaged file) stay plain strings."""
    if not value:
        return Status.ERROR
    try:
        return Status(str(value))
    except ValueError:
        return str(value)


@dataclass
class TrialRecord:
    """One trial's result (docs/CONTRACTS.md), normalised: every accessor tolerates missing data.

    ``status`` is a :class:`Status` member (a ``str`` enum: ``t.status == "ok"`` still holds), or a plain
    string for :data:`RUNNING` and for a status outside the contract. ``problem`` is the schema error of
    a result that fails :meth:`TrialResult.from_json` (read tolerantly instead), else None.
    """

    number: int
    status: Status | str
    reason: str | None = None
    overrides: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    estimate: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "json"  # json | storage
    path: str | None = None
    problem: str | None = None
    #: the config re-run alone on a GPU by the sweep's confirm stage (``confirm/trials``), when its own
    #: throughput was measured on a shared GPU (:attr:`gpu_shared`)
    alone: TrialRecord | None = None

    @classmethod
    def from_result(
        cls,
        result: dict[str, Any],
        *,
        number: int | None = None,
        source: str = "json",
        path: str | None = None,
    ) -> TrialRecord:
        """Build from a result dict; ``number`` is used when the dict has no integer ``trial``. The dict is
        read through :meth:`TrialResult.from_json`; one that fails it is read key by key (``problem``)."""
        try:
            typed = TrialResult.from_json(result)
        except ResultSchemaError as exc:
            return cls._tolerant(result, number=number, source=source, path=path, problem=str(exc))
        trial = typed.trial if typed.trial is not None else number
        reason = typed.reason
        if typed.status != Status.OK and not reason:
            reason = "no reason recorded"
        return cls(
            number=int(trial) if trial is not None else -1,
            status=typed.status,
            reason=reason,
            overrides=list(typed.overrides),
            config=typed.config,
            metrics=typed.metrics.to_json(),
            estimate=typed.estimate.to_json() if typed.estimate is not None else None,
            meta=typed.meta.to_json(),
            source=source,
            path=path,
        )

    @classmethod
    def _tolerant(
        cls, result: Any, *, number: int | None, source: str, path: str | None, problem: str
    ) -> TrialRecord:
        """A result that fails the schema, read key by key: whatever has the right shape is kept."""
        if not isinstance(result, dict):
            result = {}
        trial = result.get("trial")
        if isinstance(trial, bool) or not isinstance(trial, int):
            trial = number if number is not None else -1
        status = as_status(result.get("status"))
        reason = result.get("reason")
        if status != Status.OK and not reason:
            reason = "no reason recorded"
        return cls(
            number=int(trial),
            status=status,
            reason=str(reason) if reason is not None else None,
            overrides=[str(o) for o in (result.get("overrides") or []) if o is not None],
            config=result.get("config") if isinstance(result.get("config"), dict) else {},
            metrics=result.get("metrics") if isinstance(result.get("metrics"), dict) else {},
            estimate=result.get("estimate") if isinstance(result.get("estimate"), dict) else None,
            meta=result.get("meta") if isinstance(result.get("meta"), dict) else {},
            source=source,
            path=path,
            problem=problem,
        )

    # -- measurements -------------------------------------------------------------------------
    def metric(self, name: str) -> float | None:
        """A finite numeric metric, else None."""
        return num(self.metrics.get(name))

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def peak_bytes(self) -> float | None:
        return self.metric(M.PEAK_MEMORY_BYTES)

    @property
    def peak_gib(self) -> float | None:
        b = self.peak_bytes
        return None if b is None else b / GIB

    @property
    def tokens_per_s(self) -> float | None:
        return self.metric(M.TOKENS_PER_S)

    @property
    def eval_loss(self) -> float | None:
        return self.metric(M.EVAL_LOSS)

    @property
    def eval_ppl(self) -> float | None:
        return self.metric(M.EVAL_PPL)  # only when measured: never derived here

    @property
    def task_score(self) -> float | None:
        return self.metric(M.TASK_SCORE)

    @property
    def memory_kind(self) -> str | None:
        kind = self.metrics.get(M.MEMORY_KIND)
        return str(kind) if kind else None

    @property
    def breakdown(self) -> dict[str, float]:
        raw = self.metrics.get(M.MEMORY_BREAKDOWN_BYTES)
        if not isinstance(raw, dict):
            return {}
        return {str(k): v for k, v in ((k, num(v)) for k, v in raw.items()) if v is not None}

    @property
    def estimate_bytes(self) -> float | None:
        if not self.estimate:
            return None
        return num(self.estimate.get(M.PEAK_MEMORY_BYTES))  # the estimate's key of the same name

    @property
    def estimate_gib(self) -> float | None:
        b = self.estimate_bytes
        return None if b is None else b / GIB

    @property
    def estimate_error_pct(self) -> float | None:
        """(estimate − measured) / measured × 100; positive = the estimator over-predicts."""
        est, peak = self.estimate_bytes, self.peak_bytes
        if est is None or peak is None or peak <= 0:
            return None
        return (est - peak) / peak * 100.0

    @property
    def timing_disturbed(self) -> str | None:
        """Why this trial's throughput was measured under load (``meta.timing_conditions``), else None.

        Under load: the 1-minute load average at the trial's start exceeds the CPU count, or at its end
        exceeds the CPU count plus the trial's own torch threads, or other processes used the GPU, or another
        trial of the sweep shared its GPU (:attr:`gpu_shared`, first).
        The start figure includes the sweep's previous trial as it decays (up to about one trial's
        threads), so the rule flags load on top of the sweep itself.
        """
        tc = self.meta.get("timing_conditions")
        if not isinstance(tc, dict):
            return self.gpu_shared
        why = []
        cpus = num(tc.get("cpu_count"))
        threads = num(tc.get("torch_threads")) or 0.0
        for key, own in (("loadavg", 0.0), ("loadavg_end", threads)):
            la = tc.get(key)
            first = num(la[0]) if isinstance(la, list | tuple) and la else None
            if cpus and first is not None and first - own > cpus:
                when = "start" if key == "loadavg" else "end"
                why.append(
                    f"load average {first:g} at {when} > {cpus:g} CPUs"
                    + (f" + {own:g} own threads" if own else "")
                )
        gpu = num(tc.get("other_gpu_processes"))
        if gpu and not self.gpu_shared:  # the sweep's own trials beside it: said once, as shared
            why.append(f"{gpu:g} other GPU process(es)")
        if self.gpu_shared:
            why.insert(0, self.gpu_shared)
        return "; ".join(why) or None

    @property
    def gpu_shared(self) -> str | None:
        """``shared ...`` when another trial of the sweep ran on this trial's GPU while it ran
        (``meta.gpu_share``, ``hydra.sweeper.trials_per_gpu``): its tokens/s, MFU and step times are not the
        card's own (memory figures are: the cap and the peaks are per process). Else None."""
        gs = self.meta.get("gpu_share")
        if not isinstance(gs, dict) or not gs.get("shared"):
            return None
        others = [int(n) for n in gs.get("with") or [] if isinstance(n, int | float)]
        if gs.get("exact") and others:
            return f"shared GPU {gs.get('device')} with trial(s) {', '.join(str(n) for n in others)}"
        return (
            f"shared GPU {gs.get('device')} with up to {gs.get('trials_per_gpu')} trials (who is not known: "
            "the sweeper stopped before it could say)"
        )

    # -- design and knobs ---------------------------------------------------------------------
    @property
    def design(self) -> dict[str, Any] | None:
        d = self.meta.get("design")
        return d if isinstance(d, dict) and d.get("kind") else None

    @property
    def override_map(self) -> dict[str, str]:
        return override_dict(self.overrides)

    @property
    def recorded_budget_gib(self) -> float | None:
        """``config.hardware.budget_gib`` as recorded (0 = no budget), None when not recorded."""
        return feasibility.recorded_budget_gib(self.config)

    def knob_value(self, key: str) -> Any:
        """The value this trial ran with for knob ``key`` (``quant`` -> its option name, ``adapter.r``)."""
        found, v = _lookup(self.config, key)
        if found:
            if isinstance(v, dict):
                return v.get("name", self.override_map.get(key))
            return v
        return self.override_map.get(key)


@dataclass
class SweepData:
    """Every trial of one sweep plus its settings; ``notes`` collects what was skipped and why."""

    name: str
    folder: Path | None
    settings: dict[str, Any]
    trials: list[TrialRecord]
    notes: list[str] = field(default_factory=list)
    storage: str | None = None
    study_name: str | None = None

    # -- budget and feasibility ---------------------------------------------------------------
    @property
    def budget_gib(self) -> float | None:
        """The budget shared by the trials (plot line, summary); None when none or when they differ."""
        budgets = {self.trial_budget_gib(t) for t in self.trials}
        budgets.discard(None)
        if not self.trials:
            b = num(self.settings.get("budget_gib"))
            return b if b is not None and b > 0 else None
        return budgets.pop() if len(budgets) == 1 else None

    def trial_budget_gib(self, trial: TrialRecord) -> float | None:
        """The trial's own ``hardware.budget_gib`` when recorded, else ``sweep.json`` budget_gib; None for 0
        (:func:`vramsweep.record.feasibility.budget_gib`, the rule the sweeper's constraint uses)."""
        return feasibility.budget_gib(trial.config, self.settings.get("budget_gib"))

    def fits(self, trial: TrialRecord) -> bool | None:
        """Peak within the budget; None when there is no budget to compare with."""
        return feasibility.fits(trial.peak_bytes, self.trial_budget_gib(trial))

    def feasible(self, trial: TrialRecord) -> bool:
        """Status ok and (no budget, or peak ≤ budget). Only feasible trials can be best."""
        return feasibility.feasible(trial.status, trial.peak_bytes, self.trial_budget_gib(trial))

    # -- objectives and knobs -----------------------------------------------------------------
    @property
    def objectives(self) -> list[tuple[str, str]]:
        out = []
        for obj in self.settings.get("objectives") or []:
            if isinstance(obj, dict) and obj.get("metric"):
                metric = str(obj["metric"])
                d = str(obj.get("direction") or _default_direction(metric)).lower()
                out.append((metric, "maximize" if d.startswith("max") else "minimize"))
        return out or list(DEFAULT_OBJECTIVES)

    def _design_overrides(self) -> list[str]:
        out: list[str] = []
        for key in ("baseline", "stack"):
            out += [str(o) for o in self.settings.get(key) or []]
        for change in self.settings.get("factors") or []:
            out += [str(o) for o in (change if isinstance(change, list | tuple) else [change])]
        return out

    def candidate_knobs(self) -> list[str]:
        """Every key any trial or the design overrides, in first-seen order."""
        keys: dict[str, None] = {}
        for t in self.trials:
            for k in t.override_map:
                keys.setdefault(k)
        for k in override_dict(self._design_overrides()):
            keys.setdefault(k)
        return list(keys)

    def varying_knobs(self) -> list[str]:
        """Knobs whose value differs between trials; all candidate knobs when none varies."""
        candidates = self.candidate_knobs()
        varying = [k for k in candidates if len({norm_value(t.knob_value(k)) for t in self.trials}) > 1]
        return varying or candidates

    def config_groups(self, trials: Iterable[TrialRecord]) -> dict[str, list[TrialRecord]]:
        """``trials`` grouped by config (the varying knobs' values, seeds ignored): label -> trials, in
        first-seen order. Seed repeats of one config land in one group, so a group's spread is its noise."""
        keys = [k for k in self.varying_knobs() if k not in REPEAT_KEYS]
        out: dict[str, list[TrialRecord]] = {}
        for t in trials:
            label = " ".join(f"{k}={display_value(t.knob_value(k))}" for k in keys) or "(one config)"
            out.setdefault(label, []).append(t)
        return out

    def knob_label(
        self, trial: TrialRecord, keys: list[str] | None = None, *, values_only: bool = False
    ) -> str:
        """``quant=nf4 adapter.r=64`` (or ``nf4 64`` with ``values_only``) for the given/varying knobs."""
        keys = self.varying_knobs() if keys is None else keys
        if values_only:
            return " ".join(display_value(trial.knob_value(k)) for k in keys if k not in REPEAT_KEYS)
        return " ".join(f"{k}={display_value(trial.knob_value(k))}" for k in keys)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def safe_url(url: str) -> str:
    """A storage URL with any password masked (for messages)."""
    return mask_url(url)


def _read_json(path: Path) -> Any:
    return read_json_file(path)  # too-deep nesting: ValueError, a note like any unreadable file


def _load_result_files(folder: Path, notes: list[str]) -> dict[int, TrialRecord]:
    trials_dir = folder / "trials"
    out: dict[int, TrialRecord] = {}
    if not trials_dir.is_dir():
        return out
    for path in sorted(trials_dir.glob("*.json")):
        if path.name.startswith("."):
            continue  # temp files of an atomic write in progress
        try:
            data = _read_json(path)
        except (OSError, ValueError) as exc:
            notes.append(f"skipped {path.name}: unreadable ({exc.__class__.__name__}: {exc})")
            continue
        if not isinstance(data, dict):
            notes.append(f"skipped {path.name}: not a result object")
            continue
        stem_number = int(path.stem) if path.stem.isdigit() else None
        rec = TrialRecord.from_result(data, number=stem_number, path=str(path))
        if stem_number is not None and rec.number != stem_number:
            # the sweeper names each file by its trial: the name wins, the field is a note (never a second
            # count of trial <field>, nor the real trial <field> dropped)
            notes.append(
                f'{path.name} says "trial": {data.get("trial")!r}; counted as trial {stem_number:04d}, '
                "its file name"
            )
            rec.number = stem_number
        if rec.number < 0:
            notes.append(f"skipped {path.name}: no trial number")
            continue
        if rec.number in out:
            notes.append(f"trial {rec.number:04d}: duplicate result {path.name} ignored")
            continue
        out[rec.number] = rec
    return out


def _sqlite_path(url: str) -> Path | None:
    if url.startswith("sqlite:///"):
        return Path(url[len("sqlite:///") :])
    return None


SQLITE_MAGIC = b"SQLite format 3\x00"


def _sqlite_ro_uri(path: Path) -> str:
    """A SQLite URI that cannot write: ``immutable=1`` for a closed database (no lock, no ``-wal``/``-shm``
    files created); while a writer's ``-wal``/``-journal`` exists (a sweep still running: its last commits
    are in the ``-wal``), a snapshot of the database and that file (:func:`_snapshot`) is read instead, since
    even a ``mode=ro`` reader writes the live ``-shm`` (the WAL index that readers mark)."""
    from urllib.parse import quote

    live = any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal"))
    if live:
        return f"file:{quote(str(_snapshot(path)))}"
    return f"file:{quote(str(path.resolve()))}?immutable=1"


#: temporary folders of live-database snapshots (removed when the process exits)
_SNAPSHOTS: list[Any] = []


def _snapshot(path: Path, tries: int = 5) -> Path:
    """A private copy of a live database with its ``-wal``/``-journal`` (no ``-shm``: the copy rebuilds its
    own index), taken when neither file changed during the copy (a writer may commit meanwhile)."""
    import shutil
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="vramsweep-report-")
    _SNAPSHOTS.append(tmp)
    copy = Path(tmp.name) / path.name
    sides = ("-wal", "-journal")

    def stamp() -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for p in [path, *(Path(f"{path}{s}") for s in sides)]:
            try:
                st = p.stat()
                out.append((st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                out.append(None)
        return out

    for _ in range(tries):
        before = stamp()
        for s in sides:
            Path(f"{copy}{s}").unlink(missing_ok=True)
            if Path(f"{path}{s}").exists():
                try:
                    shutil.copyfile(f"{path}{s}", f"{copy}{s}")
                except FileNotFoundError:  # checkpointed and removed meanwhile
                    pass
        shutil.copyfile(path, copy)
        if stamp() == before:
            break
    return copy


def _check_sqlite_study(path: Path, url: str) -> None:
    """Raise unless ``path`` is a SQLite file holding Optuna's tables (read without writing a byte)."""
    import sqlite3

    if path.stat().st_size == 0:
        raise ReportError(f"storage {safe_url(url)} holds no study (the file is empty)")
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ReportError(f"cannot open storage {safe_url(url)}: {exc.strerror or exc}") from None
    if head != SQLITE_MAGIC:
        raise ReportError(f"cannot open storage {safe_url(url)}: not a SQLite database")
    try:
        conn = sqlite3.connect(_sqlite_ro_uri(path), uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            conn.close()
    except sqlite3.Error as exc:  # torn copy: "database disk image is malformed"
        raise ReportError(f"cannot open storage {safe_url(url)}: {exc}") from None
    if not {"studies", "trials", "version_info"} <= tables:
        raise ReportError(f"storage {safe_url(url)} holds no study (no Optuna tables)")


def readonly_storage(url: str) -> Any:
    """An Optuna ``RDBStorage`` over ``url`` that cannot write: no table creation, no version stamp, no
    migration (Optuna's own ``RDBStorage(url)`` writes its schema into an empty database). SQLite is opened
    through a read-only URI (:func:`_sqlite_ro_uri`), PostgreSQL in read-only transactions."""
    import optuna

    kwargs: dict[str, Any] = {}
    path = _sqlite_path(url)
    if path is not None:
        import sqlite3

        uri = _sqlite_ro_uri(path)
        kwargs["creator"] = lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    elif url.startswith("postgresql"):
        kwargs["connect_args"] = {"options": "-c default_transaction_read_only=on", "connect_timeout": 5}
    elif url.startswith("mysql"):
        kwargs["connect_args"] = {"init_command": "SET SESSION TRANSACTION READ ONLY", "connect_timeout": 5}
    # a bare postgresql:// is psycopg 3 to SQLAlchemy 2.1; the sweeper wrote it with the driver installed
    return optuna.storages.RDBStorage(
        normalise_storage_url(url), engine_kwargs=kwargs, skip_table_creation=True
    )


def _open_study(url: str, study: str | None) -> Any:
    """Load an Optuna study read-only: never create, stamp or migrate a storage or study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = _sqlite_path(url)
    if path is not None:
        if not path.is_file():
            raise ReportError(f"no such study database: {path}")
        _check_sqlite_study(path, url)
    try:
        storage = readonly_storage(url)
        names = optuna.get_all_study_names(storage=storage)
    except Exception as exc:  # driver missing, server down, not an optuna DB, ...
        why = mask_secret(" ".join(str(exc).split()), url)[:300]
        raise ReportError(f"cannot open storage {safe_url(url)}: {exc.__class__.__name__}: {why}") from None
    if study is None:
        if len(names) == 1:
            study = names[0]
        elif not names:
            raise ReportError(f"storage {safe_url(url)} holds no study")
        else:
            raise ReportError(
                f"storage {safe_url(url)} holds several studies; pick one with --study "
                f"(studies: {', '.join(sorted(names))})"
            )
    elif study not in names:
        raise ReportError(
            f"unknown study {study!r} in {safe_url(url)} (studies: {', '.join(sorted(names)) or 'none'})"
        )
    try:
        return optuna.load_study(study_name=study, storage=storage)
    # broad on purpose: any storage error (sqlalchemy, optuna) becomes one ReportError line
    except Exception as exc:
        why = mask_secret(str(exc), url)
        raise ReportError(f"cannot load study {study!r}: {exc.__class__.__name__}: {why}") from None


def _metric_names(study: Any, settings: dict[str, Any]) -> list[str]:
    names = getattr(study, "metric_names", None)
    if names and all(names):
        return [str(n) for n in names]
    objs = [o.get("metric") for o in settings.get("objectives") or [] if isinstance(o, dict)]
    return [str(o) for o in objs if o]


def _frozen_result(ua: dict[str, Any], base_folder: Path | None) -> tuple[Any, str | None]:
    """The result a trial's user attrs hold: ``result`` (a dict, or JSON text of one; unreadable text is
    None), else when that is no dict the file ``result_path`` names, or the file of that name in
    ``base_folder/trials`` (the first that is a readable JSON file).

    Returns:
        ``(result, path)``: ``path`` the file read, else None with ``result`` what the ``result`` attr gave
        (parsed when text); the caller rebuilds the record when ``result`` is no dict.
    """
    result = ua.get("result")
    if isinstance(result, str):
        try:
            result = loads_json(result)
        except ValueError:
            result = None
    path = None
    if not isinstance(result, dict) and ua.get("result_path"):
        candidates = [Path(str(ua["result_path"]))]
        if base_folder is not None:
            candidates.append(base_folder / "trials" / Path(str(ua["result_path"])).name)
        for p in candidates:
            try:
                if p.is_file():
                    result, path = _read_json(p), str(p)
                    break
            except (OSError, ValueError):
                continue
    return result, path


def _frozen_status(trial: Any, ua: dict[str, Any]) -> tuple[Status | str, Any]:
    """A trial's status from its Optuna state (complete: the ``status`` user attr, else ok; pruned;
    failed: the ``status`` user attr, else error; any other state: running), and the reason: the
    ``reason`` user attr or the ``fail_reason`` system attr, else for a status other than ok one naming
    the state."""
    from optuna.trial import TrialState

    state = trial.state
    status: Status | str
    if state == TrialState.COMPLETE:
        status = as_status(ua.get("status") or Status.OK)
    elif state == TrialState.PRUNED:
        status = Status.PRUNED
    elif state == TrialState.FAIL:
        status = as_status(ua.get("status"))
    else:
        status = RUNNING
    reason = ua.get("reason") or (trial.system_attrs or {}).get("fail_reason")
    if status == RUNNING:
        reason = reason or f"no result yet (state {state.name})"
    elif status != Status.OK:
        reason = reason or f"optuna state {state.name}"
    return status, reason


def record_from_frozen(trial: Any, metric_names: list[str], base_folder: Path | None = None) -> TrialRecord:
    """A :class:`TrialRecord` from an Optuna ``FrozenTrial`` (user attrs ``result``/``result_path``)."""
    ua = dict(trial.user_attrs or {})
    result, path = _frozen_result(ua, base_folder)
    if isinstance(result, dict):
        rec = TrialRecord.from_result(result, number=trial.number, source="storage", path=path)
        rec.number = trial.number
        return rec
    # Fallback: rebuild what the study itself knows.
    status, reason = _frozen_status(trial, ua)
    metrics: dict[str, Any] = {}
    values = trial.values or []
    for name, value in zip(metric_names, values):
        metrics[name] = value
    for key in SCALAR_METRICS:  # the sweeper stores these as user attrs (outcome.ATTR_METRICS)
        if key in ua:
            metrics[key] = ua[key]
    meta = {"design": ua["design"]} if isinstance(ua.get("design"), dict) else {}
    if isinstance(ua.get("overrides"), list):
        overrides = [str(o) for o in ua["overrides"]]
    else:  # fixed designs store "(default)" for keys a point leaves alone
        overrides = [f"{k}={v}" for k, v in (trial.params or {}).items() if v != "(default)"]
    return TrialRecord(
        number=trial.number,
        status=status,
        reason=str(reason) if reason else None,
        overrides=overrides,
        config=ua.get("config") if isinstance(ua.get("config"), dict) else {},
        metrics=metrics,
        meta=meta,
        source="storage",
    )


def _set_aside_lost_jobs(records: dict[int, TrialRecord], notes: list[str]) -> None:
    """Drop the records of launcher jobs lost to the infrastructure (``meta.lost``: cancelled, preempted,
    never submitted; the sweeper retries their point as another trial): not results, so never counted as an
    ``error`` beside the retry's own record. One note names them and whether their point has a result."""
    gone = {n: records.pop(n) for n in sorted(records) if records[n].meta.get("lost") is True}
    if not gone:
        return
    lost = list(gone)
    points = {tuple(sorted(r.overrides)) for r in records.values()}
    open_ = [n for n, r in gone.items() if tuple(sorted(r.overrides)) not in points]
    notes.append(
        f"{len(lost)} launcher job(s) lost to the infrastructure, not results, left out "
        f"(trial {', '.join(f'{n:04d}' for n in lost)})"
        + (
            f"; point(s) of trial {', '.join(f'{n:04d}' for n in open_)} not run yet: re-run the same "
            "command to retry them"
            if open_
            else "; each point was retried"
        )
    )


def _note_schema_problems(records: dict[int, TrialRecord], notes: list[str]) -> None:
    """One note per trial whose result fails the schema (read tolerantly: its figures may be partial)."""
    for n in sorted(records):
        rec = records[n]
        if rec.problem:
            where = Path(rec.path).name if rec.path else "result in the study"
            notes.append(
                f"trial {n:04d}: {where} does not follow the result schema ({rec.problem}); "
                "read what could be read"
            )


def _records_from_study(study: Any, settings: dict[str, Any], folder: Path | None) -> dict[int, TrialRecord]:
    names = _metric_names(study, settings)
    try:
        trials = study.get_trials(deepcopy=False)
    except Exception as exc:  # e.g. a locked SQLite file while workers write
        raise ReportError(
            f"cannot read the trials of study {study.study_name!r}: {exc.__class__.__name__}: {exc}"
        ) from exc
    return {t.number: record_from_frozen(t, names, folder) for t in trials}


def load_sweep(target: str, *, study: str | None = None) -> SweepData:
    """Load a sweep from a folder, its ``sweep.json``/``study.db``, or a storage URL (+ study name).

    Raises:
        ReportError: the target does not exist, is not a sweep, or names an unknown study.
    """
    target = str(target)
    if "://" in target:
        return _load_storage(target, study)
    try:
        check_path_names(target, "the report target", f"{target[:80]}{'...' if len(target) > 80 else ''}")
    except ConfigError as exc:  # a name over 255 bytes: exists() would raise "File name too long"
        raise ReportError(str(exc)) from None
    path = Path(target).expanduser()
    if not path.exists():
        raise ReportError(f"no such sweep folder: {path}")
    if path.is_file():
        if path.name == "sweep.json":
            path = path.parent
        elif path.suffix in (".db", ".sqlite", ".sqlite3"):
            return _load_storage(f"sqlite:///{path.resolve()}", study, folder=path.parent)
        else:
            raise ReportError(f"{path} is not a sweep folder, sweep.json or study database")
    return _load_folder(path, study)


def _attach_confirmed(folder: Path, records: dict[int, TrialRecord], notes: list[str]) -> None:
    """The confirm stage's results (``<folder>/confirm/trials``, ``meta.design = {kind: confirm, of: N}``):
    each ok one becomes :attr:`TrialRecord.alone` of trial N (its throughput alone on a GPU)."""
    if not (folder / "confirm" / "trials").is_dir():
        return
    confirm_notes: list[str] = []
    attached = []
    for rec in _load_result_files(folder / "confirm", confirm_notes).values():
        design = rec.meta.get("design") if isinstance(rec.meta.get("design"), dict) else {}
        of = design.get("of")
        if design.get("kind") != "confirm" or not isinstance(of, int) or of not in records or not rec.ok:
            continue
        if rec.gpu_shared:  # never: the stage runs one trial per GPU; a shared figure confirms nothing
            continue
        records[of].alone = rec
        attached.append(of)
    if attached:
        notes.append(
            f"Throughput re-measured alone on a GPU (sweep.confirm) for trial(s) "
            f"{', '.join(str(n) for n in sorted(attached))}: pick ranks on the alone figure."
        )


def _load_settings(folder: Path, notes: list[str]) -> dict[str, Any]:
    p = folder / "sweep.json"
    if not p.is_file():
        return {}
    try:
        data = _read_json(p)
    except (OSError, ValueError) as exc:
        notes.append(f"sweep.json unreadable ({exc}); design and budget derived from the trials")
        return {}
    return data if isinstance(data, dict) else {}


def _load_folder(folder: Path, study: str | None) -> SweepData:
    notes: list[str] = []
    settings = _load_settings(folder, notes)
    records = _load_result_files(folder, notes)
    storage = settings.get("storage") if isinstance(settings.get("storage"), str) else None
    study_name = study or (
        settings.get("study_name") if isinstance(settings.get("study_name"), str) else None
    )
    db = folder / "study.db"
    url = None
    if db.is_file():
        url = f"sqlite:///{db.resolve()}"
    elif storage and _sqlite_path(storage) is not None and _sqlite_path(storage).is_file():  # type: ignore[union-attr]
        recorded = _sqlite_path(storage).resolve()  # type: ignore[union-attr]
        if recorded.parent == folder.resolve():
            url = storage
        else:  # a copied or moved folder: never read another folder's database behind the user's back
            notes.append(
                f"sweep.json names the database {recorded} outside this folder; not read (this folder has no "
                "study.db): pass it as the target to report from it"
            )
            storage = None
    elif storage and "://" in storage:
        notes.append(
            f"sweep.json names storage {safe_url(storage)}; pass it as the target (with --study) "
            "to include trials recorded by other machines"
        )
    if url is not None:
        try:
            st = _open_study(url, study_name)
            from_study = _records_from_study(st, settings, folder)
            study_name = st.study_name
            added = [n for n in from_study if n not in records]
            for n in added:
                records[n] = from_study[n]
            if added:
                notes.append(
                    f"{len(added)} trial(s) without a result JSON taken from the study "
                    f"({', '.join(f'{n:04d}' for n in sorted(added))})"
                )
            storage = url
        except ReportError as exc:
            if study is not None:
                raise
            if str(exc).startswith("cannot open storage"):  # not a database at all (garbage, torn copy)
                raise ReportError(
                    f"{db if db.is_file() else safe_url(url)} is not a readable Optuna study "
                    f"database ({exc}); move it aside to report from the result JSONs alone"
                ) from exc
            notes.append(f"study database not used: {exc}")
    elif study is not None:
        raise ReportError(f"--study {study!r} given but {folder} has no study database")
    _set_aside_lost_jobs(records, notes)
    _note_schema_problems(records, notes)
    _attach_confirmed(folder, records, notes)
    name = str(settings.get("name") or folder.name)
    return SweepData(
        name=name,
        folder=folder,
        settings=settings,
        trials=[records[n] for n in sorted(records)],
        notes=notes,
        storage=storage,
        study_name=study_name,
    )


def _load_storage(url: str, study: str | None, folder: Path | None = None) -> SweepData:
    notes: list[str] = []
    st = _open_study(url, study)
    if folder is None:
        sqlite = _sqlite_path(url)
        if sqlite is not None:
            folder = sqlite.resolve().parent
    settings = _load_settings(folder, notes) if folder is not None else {}
    if not settings and isinstance(st.user_attrs.get("sweep"), dict):
        settings = dict(st.user_attrs["sweep"])
    records = _records_from_study(st, settings, folder)
    if folder is None:
        # A result_path points into <sweep folder>/trials/: reports go next to them.
        for rec in records.values():
            if rec.path:
                folder = Path(rec.path).resolve().parent.parent
                break
    if folder is not None and not settings:
        settings = _load_settings(folder, notes)
    _set_aside_lost_jobs(records, notes)
    _note_schema_problems(records, notes)
    name = str(settings.get("name") or st.study_name)
    return SweepData(
        name=name,
        folder=folder,
        settings=settings,
        trials=[records[n] for n in sorted(records)],
        notes=notes,
        storage=url,
        study_name=st.study_name,
    )
