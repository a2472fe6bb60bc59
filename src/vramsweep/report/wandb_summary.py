"""The W&B sweep-summary run: one run per sweep (``job_type="sweep-summary"``), kept up to date.

* ``trials``: a ``wandb.Table`` with one row per trial -- the varied knobs (typed), status, design role,
  peak memory, tokens/s, eval loss/ppl, task score, MFU, the estimate and its error, and the trial's
  W&B run name -- the data of a parallel-coordinates view in one place;
* every report table (``table/ablation``, ``table/best``, ...) as a ``wandb.Table``;
* the Pareto plot (and the memory-breakdown plot) as ``wandb.Image``;
* summary: trial counts per status and the best trial per objective.

One ``wandb`` folder per sweep: the summary run and the trial runs
(:mod:`vramsweep.report.wandb_run`) both live in ``<sweep dir>/wandb``. The run id is stored in
``<sweep dir>/wandb/summary_run.json``; every update resumes that run, so the sweeper can call
:func:`update_sweep_summary` after each finished trial and ``vramsweep report <dir> --wandb`` adds the
full report to the same run. Offline, each update writes a complete snapshot and the snapshots it
supersedes (same run id) are removed, so ``wandb sync <dir>/wandb/offline-run-*`` uploads one summary run.

Online only when ``WANDB_API_KEY`` is set (or ``WANDB_MODE`` says so); offline otherwise. Any W&B
failure is returned as a warning: it never takes the report or the sweep down.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vramsweep.record.metrics import column, view_metrics
from vramsweep.record.result import atomic_write_text
from vramsweep.report.build import build_report
from vramsweep.report.load import SweepData, TrialRecord, load_sweep, safe_url
from vramsweep.report.plots import pareto_figure
from vramsweep.report.tables import Report, Table, metric_cells, pareto_front
from vramsweep.report.wandb_run import design_role

STATE_FILE = "summary_run.json"
LOCK_FILE = ".summary.lock"


def wandb_mode() -> str:
    """``WANDB_MODE`` when set, else online with an API key and offline without."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("online", "offline", "disabled"):
        return mode
    if mode == "dryrun":
        return "offline"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _cell(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, dict):
        return str(value)
    return value


def table_data(table: Table) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a table's raw values (lists flattened to strings)."""
    cols = table.raw_columns()
    return cols, [[_cell(r.get(c)) for c in cols] for r in table.rows]


def _project(report_or_sweep: Report | SweepData) -> str:
    sweep = report_or_sweep.sweep if isinstance(report_or_sweep, Report) else report_or_sweep
    for t in sweep.trials:
        logger = t.config.get("logger") if isinstance(t.config, dict) else None
        if isinstance(logger, dict) and logger.get("project"):
            return str(logger["project"])
    return "vramsweep"


def _masked(settings: dict[str, Any]) -> dict[str, Any]:
    """Sweep settings with any storage password masked (a PostgreSQL URL must not reach W&B)."""
    out = dict(settings)
    if isinstance(out.get("storage"), str):
        out["storage"] = safe_url(out["storage"])
    return out


def _role(t: TrialRecord) -> str | None:
    return design_role(t.design)


def trial_rows(sweep: SweepData) -> tuple[list[str], list[list[Any]]]:
    """The ``trials`` table: one row per trial, knobs (typed values) + metrics + status.

    Knob columns are the knobs that vary across the sweep, so a parallel-coordinates view has one axis
    per knob. ``estimate_error`` is estimate/measured − 1 (> 0: the estimator over-predicts).
    """
    knobs = sweep.varying_knobs()
    front = {t.number for t in pareto_front([t for t in sweep.trials if sweep.feasible(t)], sweep.objectives)}
    cols = ["trial", "status", "design"] + knobs
    names = view_metrics("wandb")  # the registry's headline and ``wandb`` view, in registry order
    cols += [column(m) for m in names]
    cols += [
        "estimate_gib",
        "estimate_error",
        "budget_gib",
        "feasible",
        "pareto",
        "reason",
        "wandb_run",
    ]
    rows = []
    for t in sweep.trials:
        est, peak = t.estimate_bytes, t.peak_bytes
        wb = t.meta.get("wandb") if isinstance(t.meta.get("wandb"), dict) else {}
        row = [t.number, t.status, _role(t)] + [_cell(t.knob_value(k)) for k in knobs]
        row += list(metric_cells(t, names).values())
        row += [
            t.estimate_gib,
            (est / peak - 1.0) if est is not None and peak else None,
            sweep.trial_budget_gib(t),
            sweep.feasible(t),
            t.number in front,
            (t.reason or "")[:300] or None,
            wb.get("name") or wb.get("run_id"),
        ]
        rows.append(row)
    return cols, rows


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One summary update at a time per sweep (several workers may finish trials together)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as fh:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield


def _new_id() -> str:
    """A fresh W&B run id (8 lowercase letters/digits, as W&B makes them)."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_state(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / STATE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    atomic_write_text(folder / STATE_FILE, json.dumps(state, indent=1, sort_keys=True) + "\n")


def _prune_snapshots(folder: Path, run_id: str, keep: str | None) -> None:
    """Remove older offline snapshots of the summary run (the newest holds every trial)."""
    keep_path = Path(keep).resolve() if keep else None
    for d in folder.glob(f"offline-run-*-{run_id}*"):
        if d.is_dir() and (keep_path is None or d.resolve() != keep_path):
            shutil.rmtree(d, ignore_errors=True)


def log_summary(
    report: Report,
    plots: Iterable[Path],
    out_dir: Path,
    *,
    project: str | None = None,
    fingerprint: str | None = None,
) -> tuple[str | None, str | None]:
    """Log the report to the sweep's summary run (resumed when it exists, created otherwise).

    The run lives in ``<sweep folder>/wandb`` (``<out_dir>/wandb`` for a sweep without a folder).

    Returns:
        ``(where, warning)``: the run's local folder or URL, and a warning when W&B failed (else None).
    """
    run = None
    try:
        import wandb

        mode = wandb_mode()
        sweep = report.sweep
        root = Path(sweep.folder) if sweep.folder is not None else Path(out_dir)
        wdir = root / "wandb"
        with _locked(wdir):
            state = _read_state(wdir)
            run_id = str(state.get("run_id") or _new_id())
            kwargs = _init_kwargs(report, project or state.get("project") or _project(report), run_id, root)
            run, mode = _init_run(wandb, mode, kwargs)
            _log_report(wandb, run, report, plots)
            sync_dir = getattr(getattr(run, "settings", None), "sync_dir", None)
            where = getattr(run, "url", None) if mode == "online" else sync_dir
            run.finish()
            run = None
            if mode == "offline":
                _prune_snapshots(wdir, run_id, sync_dir)
            state.update(
                {
                    "run_id": run_id,
                    "project": kwargs["project"],
                    "name": kwargs["name"],
                    "mode": mode,
                    "n_trials": len(sweep.trials),
                    "updated": datetime.now(UTC).isoformat(),
                    "fingerprint": fingerprint if fingerprint is not None else state.get("fingerprint"),
                }
            )
            _write_state(wdir, state)
        return (str(where) if where else mode), None
    except Exception as exc:  # W&B must never break the report
        if run is not None:
            try:
                run.finish(exit_code=1)
            # broad on purpose: finishing a failed W&B run is best effort; the failure is reported
            except Exception:
                pass
        return None, f"W&B summary run not logged: {exc.__class__.__name__}: {exc}"


def _init_kwargs(report: Report, project: str, run_id: str, root: Path) -> dict[str, Any]:
    """``wandb.init``'s keywords for the sweep's summary run ``run_id`` (resumed if it exists) under
    ``root``: name, group, job type and tags, and the sweep's settings (masked) as its config."""
    sweep = report.sweep
    return {
        "project": project,
        "id": run_id,
        "resume": "allow",
        "name": f"{sweep.name}-summary",
        "group": sweep.name,
        "job_type": "sweep-summary",
        "tags": ["sweep-summary"]
        + ([f"design:{sweep.settings['design']}"] if sweep.settings.get("design") else []),
        "dir": str(root),
        "config": {
            "sweep": _masked(sweep.settings),
            "sweep_name": sweep.name,
            "budget_gib": sweep.budget_gib,
            "objectives": [f"{m}:{d}" for m, d in sweep.objectives],
        },
        "reinit": "create_new",
    }


def _init_run(wandb: Any, mode: str, kwargs: dict[str, Any]) -> tuple[Any, str]:
    """Start the run in ``mode``, falling back to offline when online fails (no network, bad key); returns
    the run and the mode it runs in. Raises what the last attempt raised."""
    settings = wandb.Settings(
        silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True
    )
    attempts = [mode, "offline"] if mode == "online" else [mode]
    for attempt in attempts[:-1]:
        try:
            return wandb.init(mode=attempt, settings=settings, **kwargs), attempt  # type: ignore[arg-type]
        except Exception:
            pass  # online failing (no network, bad key) -> offline
    return wandb.init(mode=attempts[-1], settings=settings, **kwargs), attempts[-1]  # type: ignore[arg-type]


def _log_report(wandb: Any, run: Any, report: Report, plots: Iterable[Path]) -> None:
    """Log the trials table, every report table and the PNG plots, and set the run's summary: the number
    of trials, the count per status and the best trial (and value) per objective."""
    sweep = report.sweep
    statuses = Counter(t.status for t in sweep.trials)
    cols, rows = trial_rows(sweep)
    payload: dict[str, Any] = {
        "trials": wandb.Table(columns=cols, data=rows, allow_mixed_types=True),
        "n_trials": len(sweep.trials),
    }
    for name, table in report.tables.items():
        tcols, data = table_data(table)
        payload[f"table/{name}"] = wandb.Table(columns=tcols, data=data, allow_mixed_types=True)
    for p in plots:
        if p.suffix == ".png":
            payload[f"plot/{p.stem}"] = wandb.Image(str(p))
    run.log(payload)
    summary: dict[str, Any] = {"n_trials": len(sweep.trials)}
    summary.update({f"status/{s}": n for s, n in sorted(statuses.items())})
    best = report.tables.get("best")
    if best is not None:
        for r in best.rows:
            if r.get("trial") is not None:
                summary[f"best/{r['objective']}/trial"] = r["trial"]
                summary[f"best/{r['objective']}/value"] = r["value"]
    run.summary.update(summary)


def _fingerprint(sweep_dir: Path) -> str:
    """Names, sizes and mtimes of the trial result files (cheap: no file is read)."""
    h = hashlib.sha256()
    trials = sweep_dir / "trials"
    if trials.is_dir():
        for p in sorted(trials.glob("*.json")):
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def _live_plots(sweep: SweepData, out: Path) -> list[Path]:
    """The Pareto plot as PNG only (the SVGs and the other plots are ``vramsweep report``'s job: a live
    update must stay cheap)."""
    try:
        fig = pareto_figure(sweep)
        if fig is None:
            return []
        path = out / "pareto.png"
        fig.savefig(path)
        return [path]
    except Exception:  # a plot is never worth a failed update
        return []


def update_sweep_summary(
    sweep_dir: str | os.PathLike, *, project: str | None = None, force: bool = False
) -> str | None:
    """Bring the sweep-summary run of ``sweep_dir`` up to date with its trial results.

    Cheap and idempotent: nothing happens when no trial result changed since the last update (unless
    ``force``); otherwise the stored run is resumed with a fresh trials table, the report tables and
    the Pareto plot (no importances or SVGs: those are for ``vramsweep report``). Never raises. About
    1-3 s when something changed (matplotlib + a W&B init/finish); use :class:`SummaryUpdater` to keep
    it off the sweeper's critical path.

    Returns:
        A one-line warning when W&B (or loading the sweep) failed, else None.
    """
    try:
        folder = Path(sweep_dir)
        wdir = folder / "wandb"
        fp = _fingerprint(folder)
        if not force and _read_state(wdir).get("fingerprint") == fp:
            return None

        sweep = load_sweep(str(folder))
        if not sweep.trials:
            return None
        report = build_report(sweep, importances=False)
        with tempfile.TemporaryDirectory(prefix="vramsweep-summary-") as tmp:
            plots = _live_plots(sweep, Path(tmp))
            _, warning = log_summary(report, plots, folder, project=project, fingerprint=fp)
        return warning
    # broad on purpose: the W&B summary must never break the sweep; said as a warning
    except Exception as exc:
        return f"W&B summary run not updated: {exc.__class__.__name__}: {exc}"


class SummaryUpdater:
    """Keeps a sweep's summary run current from a background thread.

    ``poke()`` after each finished trial returns at once; pokes that arrive while an update runs
    coalesce into one more update. ``close()`` runs the final update and waits for it. Each distinct
    warning is passed to ``on_warning`` once (default: printed to stderr). Never raises.
    """

    def __init__(
        self,
        sweep_dir: str | os.PathLike,
        *,
        project: str | None = None,
        on_warning: Callable[[str], None] | None = None,
    ):
        self.sweep_dir = Path(sweep_dir)
        self.project = project
        self.on_warning = on_warning
        self.updates = 0
        self.warnings: list[str] = []
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """Ask for an update (non-blocking)."""
        with self._lock:  # the loop decides to exit under the same lock: a poke is never lost
            self._wake.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="wandb-summary", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            warning = update_sweep_summary(self.sweep_dir, project=self.project)
            self.updates += 1
            if warning and warning not in self.warnings:
                self.warnings.append(warning)
                try:
                    if self.on_warning is not None:
                        self.on_warning(warning)
                    else:
                        print(f"warning: {warning}", file=sys.stderr)
                # broad on purpose: a failing warning callback must not stop the summary thread
                except Exception:
                    pass
            with self._lock:
                if self._stop and not self._wake.is_set():
                    self._thread = None
                    return

    def close(self, timeout: float = 120.0) -> None:
        """Final update, then wait for the thread (at most ``timeout`` seconds)."""
        self._stop = True
        self.poke()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
