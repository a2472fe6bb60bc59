"""Reports on sweeps: ablation/stacking/failure/estimate tables, Pareto and importance plots, W&B summary,
and ``pick`` (the pinned production config that fits a memory budget).

CLI entry points (wired into ``vramsweep report`` / ``vramsweep pick``): :func:`run_report`, :func:`run_pick`.
Library: :func:`load_sweep` -> :class:`SweepData`; :func:`build_report` -> :class:`Report` (tables by name).
"""

from vramsweep.report.load import ReportError, SweepData, TrialRecord, load_sweep
from vramsweep.report.pick import run_pick
from vramsweep.report.sweep_report import build_report, render_markdown, run_report
from vramsweep.report.tables import Report, Table

__all__ = [
    "Report",
    "ReportError",
    "SweepData",
    "Table",
    "TrialRecord",
    "build_report",
    "load_sweep",
    "render_markdown",
    "run_pick",
    "run_report",
]
