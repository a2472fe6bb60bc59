"""Lazy imports only where they earn their place.

An import of a ``vramsweep`` module inside a function is allowed when moving it to the top of the file
would (a) pull a heavy dependency (torch, transformers, peft, bitsandbytes, wandb, optuna, ...) into a module
that does not import it yet, (b) make a module-level import cycle, or (c) it sits in a ``try`` that catches
``ImportError`` (a verb's friendly message). Anything else belongs at the top, where a reader sees what
the module depends on. The graph is static (module-level imports, transitively, package ``__init__`` s
included), so the check is fast and does not import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchfree

SRC = Path(__file__).resolve().parents[2] / "src"
#: Third-party packages whose import costs seconds or touches the GPU driver.
HEAVY = frozenset(
    "torch transformers peft bitsandbytes wandb optuna liger_kernel unsloth triton accelerate matplotlib "
    "pandas scipy sqlalchemy psycopg2 safetensors tokenizers numpy".split()
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{a.name}" for a in node.names]


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (module and class bodies, ``try``/``if`` blocks, but
    not ``if TYPE_CHECKING``)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.Import | ast.ImportFrom):
                out.append(n)
            elif isinstance(n, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(n.test):
                    walk(n.body)
                    walk(n.orelse)
            elif isinstance(n, ast.Try):
                walk(n.body + n.orelse + n.finalbody + [s for h in n.handlers for s in h.body])
            elif isinstance(n, ast.With | ast.ClassDef):
                walk(n.body)

    walk(tree.body)
    return out


def _graph() -> tuple[dict[str, Path], dict[str, set[str]], dict[str, set[str]]]:
    files = {_module(p): p for p in sorted((SRC / "vramsweep").rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in files}
    heavy: dict[str, set[str]] = {m: set() for m in files}
    for m, path in files.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            for t in _targets(node, m, path.name == "__init__.py"):
                if t.split(".")[0] in HEAVY:
                    heavy[m].add(t.split(".")[0])
                parts = t.split(".")
                edges[m] |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(files) - {m}
        parts = m.split(".")
        edges[m] |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(files)
    return files, edges, heavy


def _closure(m: str, edges: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    stack = [m]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(edges[x])
    return seen


def _lazy_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    guarded = {
        id(y)
        for t in ast.walk(tree)
        if isinstance(t, ast.Try)
        and any(h.type is not None and "ImportError" in ast.unparse(h.type) for h in t.handlers)
        for x in t.body
        for y in ast.walk(x)
    }
    return [
        n
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(fn)
        if id(n) not in guarded
        and (
            (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").startswith("vramsweep"))
            or (isinstance(n, ast.Import) and any(a.name.startswith("vramsweep") for a in n.names))
        )
    ]


def unearned_lazy_imports() -> list[str]:
    files, edges, heavy = _graph()
    heavy_of = {m: set().union(*(heavy[x] for x in _closure(m, edges))) for m in files}
    bad = []
    for m, path in files.items():
        for n in _lazy_imports(ast.parse(path.read_text())):
            target = max((t for t in _targets(n, m, False) if t in files), key=len, default=None)
            if target is None:
                continue
            if m in _closure(target, edges) or heavy_of[target] - heavy_of[m]:
                continue  # a cycle, or a heavy dependency kept off this module's import
            bad.append(f"{path.relative_to(SRC)}:{n.lineno}: {ast.unparse(n)}")
    return bad


def test_every_lazy_internal_import_keeps_a_heavy_dependency_or_a_cycle_away():
    bad = unearned_lazy_imports()
    assert not bad, "lazy imports with no reason (move them to the top of the file):\n" + "\n".join(bad)


def test_the_check_fails_on_a_light_lazy_import(tmp_path, monkeypatch):
    pkg = tmp_path / "vramsweep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "light.py").write_text("X = 1\n")
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "user.py").write_text(
        "def f():\n    from vramsweep.light import X\n    return X\n\n"
        "def g():\n    from vramsweep.heavy import torch\n    return torch\n"
    )
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    assert unearned_lazy_imports() == ["vramsweep/user.py:2: from vramsweep.light import X"]


def test_the_cli_and_the_estimator_stay_light():
    """What the lazy imports are for: ``vramsweep --help`` and the estimator import no torch."""
    files, edges, heavy = _graph()
    for m in ("vramsweep.cli", "vramsweep.estimate", "vramsweep.sweeper.settings"):
        assert not set().union(*(heavy[x] for x in _closure(m, edges))) & {
            "torch",
            "transformers",
            "wandb",
        }, m
