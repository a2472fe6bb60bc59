"""A loaded sweep -> its report (tables + importances): below ``sweep_report`` (the ``report`` verb) and
``wandb_summary``, which both build one."""

from __future__ import annotations

from vramsweep.report.importance import Importances, compute_importances
from vramsweep.report.load import SweepData
from vramsweep.report.tables import Column, Report, Table, build_tables


def importance_table(imps: Importances) -> Table | None:
    """Params × objectives table of importances (None when there are none)."""
    if not imps.values:
        return None
    metrics = list(imps.values)
    params: dict[str, None] = {}
    for m in metrics:
        for p in imps.values[m]:
            params.setdefault(p)
    rows = [{"param": p, **{m: imps.values[m].get(p) for m in metrics}} for p in params]
    cols = [Column("param", lambda r: r["param"], False)]
    for m in metrics:
        cols.append(Column(m, (lambda key: lambda r: "" if r[key] is None else f"{r[key]:.3f}")(m)))
    return Table(
        "importances",
        "Parameter importances",
        cols,
        rows,
        intro="Optuna `get_param_importances` (PED-ANOVA) per objective over the ok trials; "
        "each column sums to 1.",
    )


def build_report(sweep: SweepData, *, importances: bool = True) -> Report:
    """Tables (and importances) of a loaded sweep; see :mod:`vramsweep.report.tables`."""
    report = build_tables(sweep)
    if importances:
        imps = compute_importances(sweep)
        table = importance_table(imps)
        if table is not None:
            table.notes = list(imps.notes)
            report.tables["importances"] = table
        else:
            report.notes += ["Importances skipped: " + n for n in imps.notes] or ["Importances skipped."]
        report.importances = imps
    return report
