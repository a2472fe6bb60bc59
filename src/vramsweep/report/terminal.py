"""What ``vramsweep report`` prints: the main table narrowed to the columns that answer the question.

``ablation.md`` / ``ablation.csv`` keep every column (each metric's value, Δ, Δ %, standard error, p-value).
On the terminal an ablation or stacking table shows, per row, the marked Δ of the headline metrics — memory
%, tokens/s %, eval loss, fact accuracy, and any other objective of the sweep — with their noise marks;
a trials table (grid and search sweeps) shows its values. Columns with no information (null in every row,
or the same value in every row) are left out and named in one note line, and the table is narrowed to
``width`` characters: first the standard errors go, then the right-most metric columns (named in the
note), then long row labels are clipped.
"""

from __future__ import annotations

import textwrap
from typing import Any

from vramsweep.record.metrics import column, view_metrics
from vramsweep.report.tables import Column, Table, _clip

#: Terminal width the report fits (the issue's "fits 120 columns").
WIDTH = 120


def headline() -> tuple[str, ...]:
    """The metrics an ablation/stacking row shows on the terminal, in order: the registry's headline and
    ``terminal`` view (raw-row keys: :func:`~vramsweep.record.metrics.column`, ``peak_gib`` for memory)."""
    return tuple(column(m) for m in view_metrics("terminal"))


def _raw(row: dict[str, Any], metric: str) -> Any:
    return row.get(f"{metric}_mean", row.get(metric))


def _same_value(values: list[Any]) -> bool:
    nums = [round(v, 9) if isinstance(v, float) else v for v in values]
    return len(set(map(repr, nums))) == 1


def uninformative(table: Table) -> dict[str, str]:
    """Metrics whose value is null in every row, or the same in every row (with more than one row):
    ``{metric: why}``, e.g. ``{"task_score": "0 in every row"}``."""
    out: dict[str, str] = {}
    for metric in dict.fromkeys(c.metric for c in table.columns if c.metric):
        values = [_raw(r, metric) for r in table.rows]
        present = [v for v in values if v is not None]
        if not present:
            out[metric] = "null in every row"
        elif len(table.rows) > 1 and len(present) == len(values) and _same_value(present):
            v = present[0]
            out[metric] = f"{v:.4g} in every row" if isinstance(v, float | int) else f"{v} in every row"
    return out


def _render(table: Table, columns: list[Column], rows: list[dict[str, Any]]) -> str:
    return Table(table.name, table.title, columns, rows).markdown()


def _width(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _variant(columns: list[Column], which: str) -> list[Column]:
    """The columns with their ``terminal`` or ``brief`` cell where they have one."""
    out = []
    for c in columns:
        cell = getattr(c, which)
        out.append(Column(c.header, cell, c.numeric, c.metric, c.kind) if cell else c)
    return out


def _clip_labels(table: Table, columns: list[Column], rows: list[dict[str, Any]], width: int) -> list[Column]:
    """Clip the widest label column's cells until the table fits (never below 12 characters)."""
    labels = [c for c in columns if c.kind == "label" and not c.numeric]
    if not labels:
        return columns
    widest = max(labels, key=lambda c: max((len(c.cell(r)) for r in rows), default=0))
    over = _width(_render(table, columns, rows)) - width
    cur = max((len(widest.cell(r)) for r in rows), default=0)
    keep = max(12, cur - over)
    clipped = Column(
        widest.header, (lambda f: lambda r: _clip(f(r), keep))(widest.cell), widest.numeric, widest.metric
    )
    return [clipped if c is widest else c for c in columns]


def terminal_view(
    table: Table, objectives: list[str] | tuple[str, ...] = (), width: int = WIDTH
) -> tuple[str, list[str]]:
    """The table as printed on the terminal (at most ``width`` characters a line where it can be) and
    the note lines that say what was left out.

    Args:
        table: the report's main table (ablation, stacking or trials).
        objectives: the sweep's objective metrics (result-metric names); shown beside :func:`headline`.
        width: terminal width to fit.
    """
    empty = uninformative(table)
    rows = table.rows
    first = headline()
    wanted = list(first) + [column(m) for m in objectives if column(m) not in first]
    if table.name in ("ablation", "stacking"):
        keep = [c for c in table.columns if c.kind == "label"]
        by_metric = {c.metric: c for c in table.columns if c.kind == "delta"}
        chosen = [by_metric[m] for m in wanted if m in by_metric and m not in empty]
        hidden = [c for c in table.columns if c.kind != "label" and c not in chosen]
        briefs = _variant(chosen, "brief")
        metric_cols = _variant(chosen, "terminal")
    else:
        keep = [c for c in table.columns if c.kind == "label"]
        metric_cols = [c for c in table.columns if c.kind == "value" and c.metric not in empty]
        hidden = [c for c in table.columns if c.kind != "label" and c not in metric_cols]
        briefs = metric_cols
    notes: list[str] = []
    if empty:
        notes.append(
            "Left out (no information): " + "; ".join(f"{m} ({why})" for m, why in empty.items()) + "."
        )

    def columns() -> list[Column]:
        return keep + metric_cols

    cols = columns()
    dropped: list[str] = []
    if _width(_render(table, cols, rows)) > width:
        if briefs is not metric_cols:
            metric_cols = briefs
            cols = columns()
            notes.append("Standard errors left out to fit the terminal.")
    while _width(_render(table, cols, rows)) > width and len(metric_cols) > 2:
        dropped.append(metric_cols.pop().header)
        cols = columns()
    if _width(_render(table, cols, rows)) > width:
        cols = _clip_labels(table, cols, rows, width)
    more = [c.header for c in hidden if c.metric not in empty or c.metric is None]
    more = [h for h in dropped + more if h]
    if more:
        listed = ", ".join(dict.fromkeys(more))
        notes.append(f"Also in ablation.md / ablation.csv: {listed}.")
    return _render(table, cols, rows), notes


def compact(table: Table, width: int = WIDTH) -> tuple[str, list[str]]:
    """A short table (``pick``'s candidates) as printed on the terminal: metric columns with no information
    (null, or the same, in every row: :func:`uninformative`) left out, then derived (``detail``) columns
    if it is wider than ``width``, then the widest label column clipped. Returns the table and the notes
    that say what was left out (the file written beside it keeps every column)."""
    empty = uninformative(table)
    cols = [c for c in table.columns if c.metric not in empty]
    notes = []
    if empty:
        notes.append(
            "Left out (no information): " + "; ".join(f"{m} ({why})" for m, why in empty.items()) + "."
        )
    details = [c for c in cols if c.kind == "detail"]
    if details and _width(_render(table, cols, table.rows)) > width:
        cols = [c for c in cols if c.kind != "detail"]
        notes.append(f"Left out to fit the terminal: {', '.join(c.header for c in details)}.")
    if _width(_render(table, cols, table.rows)) > width:
        cols = _clip_labels(table, cols, table.rows, width)
    return _render(table, cols, table.rows), notes


def wrap(line: str, width: int = WIDTH, indent: str = "  ") -> str:
    """A printed line wrapped at ``width`` (continuation lines indented)."""
    if len(line) <= width:
        return line
    return "\n".join(
        textwrap.wrap(
            line, width=width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )
    )
