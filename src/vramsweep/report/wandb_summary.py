"""A W&B sweep-summary run: every report table as a ``wandb.Table`` and every plot as a ``wandb.Image``.

Online only when ``WANDB_API_KEY`` is set (or ``WANDB_MODE`` says so); offline otherwise, so the run
lands under ``<out_dir>/wandb/offline-run-*`` and can be synced later with ``wandb sync``. Any W&B
failure is returned as a warning: it never takes the report down.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vramsweep.report.tables import Report, Table


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


def _project(report: Report) -> str:
    for t in report.sweep.trials:
        logger = t.config.get("logger") if isinstance(t.config, dict) else None
        if isinstance(logger, dict) and logger.get("project"):
            return str(logger["project"])
    return "vramsweep"


def log_summary(
    report: Report, plots: Iterable[Path], out_dir: Path, *, project: str | None = None
) -> tuple[str | None, str | None]:
    """Log the report as one W&B run.

    Returns:
        ``(where, warning)``: the run's local folder or URL, and a warning when W&B failed (else None).
    """
    run = None
    try:
        import wandb

        mode = wandb_mode()
        sweep = report.sweep
        kwargs: dict[str, Any] = {
            "project": project or _project(report),
            "name": f"{sweep.name}-summary",
            "group": sweep.name,
            "job_type": "sweep-summary",
            "dir": str(out_dir),
            "config": {
                "sweep": sweep.settings,
                "budget_gib": sweep.budget_gib,
                "n_trials": len(sweep.trials),
            },
            "reinit": "create_new",
        }
        settings = wandb.Settings(
            silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True
        )
        attempts = [mode, "offline"] if mode == "online" else [mode]
        for i, attempt in enumerate(attempts):  # online failing (no network, bad key) -> offline
            try:
                run = wandb.init(mode=attempt, settings=settings, **kwargs)  # type: ignore[arg-type]
                mode = attempt
                break
            except Exception:
                if i == len(attempts) - 1:
                    raise
        payload: dict[str, Any] = {}
        for name, table in report.tables.items():
            cols, data = table_data(table)
            payload[f"table/{name}"] = wandb.Table(columns=cols, data=data, allow_mixed_types=True)
        for p in plots:
            if p.suffix == ".png":
                payload[f"plot/{p.stem}"] = wandb.Image(str(p))
        run.log(payload)
        best = report.tables.get("best")
        if best is not None:
            for r in best.rows:
                if r.get("trial") is not None:
                    run.summary[f"best/{r['objective']}/trial"] = r["trial"]
                    run.summary[f"best/{r['objective']}/value"] = r["value"]
        where = (
            getattr(run, "url", None)
            if mode == "online"
            else getattr(getattr(run, "settings", None), "sync_dir", None)
        )
        run.finish()
        run = None
        return (str(where) if where else mode), None
    except Exception as exc:  # W&B must never break the report
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:
                pass
        return None, f"W&B summary run not logged: {exc.__class__.__name__}: {exc}"
