"""The contract in production: statuses and the main metric names are spelled once, in ``record/``.

AST scans of ``src/vramsweep`` (issue 30.1): a bare status string (``"ok"``, ``"oom"``, ...) compared with,
assigned to or passed as a status, or a main metric name as a string literal, outside ``record/`` fails
with the file and line; code names them through :class:`~vramsweep.record.status.Status` and
:data:`~vramsweep.record.metrics.MetricName`. And no function in ``trial.py`` is over 80 lines
(issue 30.3: the trial reads straight through).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vramsweep.record.status import STATUSES

SRC = Path(__file__).resolve().parents[1] / "src" / "vramsweep"

#: Files whose metric names are checked (the rest of src/ still spells some; issue 30.1 continues).
METRIC_CHECKED = ("trial.py", "sweeper/maxctx.py", "sweeper/progress.py")
#: The main metric names: the ones every table, progress line and objective uses.
MAIN_METRICS = ("peak_memory_bytes", "tokens_per_s", "step_time_s", "eval_loss", "train_loss", "mfu")


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "record" not in p.relative_to(SRC).parts)


def _strings(node: ast.AST) -> list[ast.Constant]:
    """String constants of ``node`` itself or of a tuple/list/set literal."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [n for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_status_target(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "status" in node.id
    if isinstance(node, ast.Attribute):
        return "status" in node.attr
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "status"
    return False


def _mentions_status(node: ast.AST) -> bool:
    """A status value: ``status``, ``x.status``, ``r["status"]``, ``r.get("status")``, ``str(status)``."""
    if _is_status_target(node):
        return True
    if isinstance(node, ast.Call):
        args = [a for a in node.args if isinstance(a, ast.Constant)]
        return any(a.value == "status" for a in args) or any(_mentions_status(a) for a in node.args)
    return False


def _status_literals(tree: ast.AST) -> list[ast.Constant]:
    """Status strings in comparisons, in assignments to a status, as ``status=`` and ``{"status": ...}``."""
    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_mentions_status(side) for side in sides):
                found += [c for side in sides for c in _strings(side)]
        elif isinstance(node, ast.IfExp) and _mentions_status(node.test):
            found += _strings(node.body) + _strings(node.orelse)
        elif isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            if len(targets) == len(values):
                found += [
                    c
                    for t, v in zip(targets, values, strict=True)
                    if _is_status_target(t)
                    for c in _strings(v)
                ]
        elif isinstance(node, ast.keyword) and node.arg and "status" in node.arg:
            found += _strings(node.value)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == "status" and v is not None:
                    found += _strings(v)
    return [c for c in found if c.value in STATUSES]


def test_no_bare_status_string_outside_record():
    bad = []
    for path in _files():
        for c in _status_literals(ast.parse(path.read_text(), str(path))):
            bad.append(f"{path.relative_to(SRC)}:{c.lineno}: {c.value!r} (use Status.{c.value.upper()})")
    assert not bad, "bare status strings:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", METRIC_CHECKED)
def test_no_main_metric_name_literal(name):
    path = SRC / name
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    bad = [
        f"{name}:{n.lineno}: {n.value!r} (use MetricName.{n.value.upper()})"
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in MAIN_METRICS and id(n) not in docstrings
    ]
    assert not bad, "metric names spelled outside the registry:\n" + "\n".join(bad)


def _long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(SRC)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_function_in_trial_over_80_lines():
    assert not _long_functions(SRC / "trial.py", 80)


def test_train_steps_reads_straight_through():
    tree = ast.parse((SRC / "trial.py").read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train_steps"]
    assert fn.end_lineno - fn.lineno + 1 <= 60
