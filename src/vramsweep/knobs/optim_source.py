"""An optimizer's class and constructor keywords read from its source file, without importing it.

A sweep's parent process must never import torch (CUDA can only be initialised in the trial processes),
yet a bad ``optimizer._target_`` or ``optimizer.kwargs`` must be refused there once, before any trial,
not once per trial. :func:`read_target` finds the module of ``_target_`` on ``sys.path`` the way the
import system would (:func:`importlib.util.find_spec` on the top-level package only: a dotted
``find_spec`` imports the parents), parses it with :mod:`ast`, follows ``from x import Name`` re-exports
and single inheritance to the ``__init__`` that ``inspect.signature(cls.__init__)`` reads at run time
(:func:`vramsweep.knobs.optim.optimizer_kwargs`), and gives its parameter names.

Anything it cannot read for certain answers ``None`` and is left to the trial's own check: a top-level
package that is not installed (a machine matter: such points are recorded ``unsupported``), a module that
builds its names at run time (``__getattr__``, ``sys.modules``, ``globals()``, star imports), a name bound
conditionally or more than once, a decorated class or ``__init__``, several bases, an extension module.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: How many re-exports and base classes are followed before giving up (``None``).
MAX_HOPS = 16

#: Source text that means a module's names are not all written as statements.
_DYNAMIC = ("__getattr__", "sys.modules", "globals()", "import *")


@dataclass(frozen=True)
class Found:
    """What ``_target_`` names: ``kind`` is ``class``, ``function`` or ``missing`` (no such name, or a
    module or value: not a class). For a class, ``name`` is its ``__name__`` and ``params`` the names
    of its ``__init__``'s parameters (``None``: it takes ``**kwargs``)."""

    kind: str
    name: str = ""
    params: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _Module:
    name: str
    path: Path
    package: bool
    tree: ast.Module
    dynamic: bool


@functools.lru_cache(maxsize=256)
def read_target(target: str) -> Found | None:
    """What ``optimizer._target_`` (``package.module.Name``) names, read from source; ``None``: unknown."""
    return _read(str(target), MAX_HOPS)


def _read(target: str, hops: int) -> Found | None:
    module, _, name = target.rpartition(".")
    if not module or not name:
        return Found("missing")
    mod = _load(module)
    if mod is None or hops <= 0:
        return None
    if isinstance(mod, str):
        return Found("missing")
    return _name_in(mod, name, hops - 1)


@functools.lru_cache(maxsize=256)
def _load(module: str) -> _Module | str | None:
    """The parsed source of ``module``; ``"missing"`` when it cannot be imported, ``None`` when unknown."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None  # not installed here: the trial says so (recorded unsupported)
    origin, locations = spec.origin, spec.submodule_search_locations
    path = Path(origin) if origin and origin.endswith(".py") else None
    for i, part in enumerate(rest):
        if path is None:
            return None
        # a plain module has no submodules; a package's are files (unless it makes them at run time)
        found = _submodule(part, list(locations)) if locations is not None else None
        if found is None:
            return (
                None if _parse(".".join([top, *rest[:i]]), path, locations is not None).dynamic else "missing"
            )
        path, locations = found
    if path is None:
        return None
    return _parse(module, path, locations is not None)


def _submodule(part: str, locations: list[str]) -> tuple[Path | None, list[str] | None] | None:
    """Where ``part`` is under a package's ``locations``, as the path finder looks: a package folder,
    then an extension or source file (``(None, ...)``: found but not readable here); ``None``: absent."""
    namespace = False
    for loc in locations:
        folder = Path(loc) / part
        if (folder / "__init__.py").is_file():
            return folder / "__init__.py", [str(folder)]
        if any(folder.glob("__init__.*")):  # a compiled package
            return None, None
        if any((Path(loc) / f"{part}{s}").exists() for s in importlib.machinery.EXTENSION_SUFFIXES):
            return None, None
        if (Path(loc) / f"{part}.py").is_file():
            return Path(loc) / f"{part}.py", None
        if (Path(loc) / f"{part}.pyc").exists():
            return None, None
        namespace = namespace or folder.is_dir()
    return (None, None) if namespace else None


@functools.lru_cache(maxsize=256)
def _parse(name: str, path: Path, package: bool) -> _Module:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return _Module(name, path, package, ast.Module(body=[], type_ignores=[]), True)
    return _Module(name, path, package, tree, any(s in text for s in _DYNAMIC))


def _stores(node: ast.AST | None, name: str) -> bool:
    """``node`` assigns or deletes ``name`` (a target, ``:=``, a ``match`` capture)."""
    return node is not None and any(
        (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del)))
        or (isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name == name)
        or (isinstance(n, ast.MatchMapping) and n.rest == name)
        for n in ast.walk(node)
    )


_COMPOUND = (
    ast.If,
    ast.Try,
    getattr(ast, "TryStar", ast.Try),
    ast.With,
    ast.AsyncWith,
    ast.For,
    ast.AsyncFor,
)
_COMPOUND += (ast.While, ast.Match)


def _bindings(body: list[ast.stmt], name: str, conditional: bool = False) -> list[tuple[ast.AST, bool]]:
    """The statements of ``body`` (not of nested scopes) that bind ``name``, each with whether it may not
    run (inside an ``if``, ``try``, loop, ``with`` or ``match``)."""
    out: list[tuple[ast.AST, bool]] = []
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name == name:
                out.append((stmt, conditional))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name or a.name == "*" for a in stmt.names):
                out.append((stmt, conditional))
        elif isinstance(stmt, _COMPOUND):
            for block in ("body", "orelse", "finalbody"):
                out += _bindings(getattr(stmt, block, None) or [], name, True)
            for part in [*(getattr(stmt, "handlers", None) or []), *(getattr(stmt, "cases", None) or [])]:
                out += _bindings(part.body, name, True)
            heads = [getattr(stmt, f, None) for f in ("target", "iter", "test", "subject")]
            heads += getattr(stmt, "items", None) or []
            heads += [x for c in getattr(stmt, "cases", None) or [] for x in (c.pattern, c.guard)]
            handlers = getattr(stmt, "handlers", None) or []
            if any(_stores(h, name) for h in heads) or any(h.name == name for h in handlers):
                out.append((stmt, True))
        elif _stores(stmt, name):
            out.append((stmt, conditional))  # an assignment or `del`
    return out


def _name_in(mod: _Module, name: str, hops: int) -> Found | None:
    if any(isinstance(n, ast.Global) and name in n.names for n in ast.walk(mod.tree)):
        return None
    found = _bindings(mod.tree.body, name)
    if not found:
        return None if mod.dynamic else Found("missing")  # a submodule of that name is a module: not a class
    if len(found) > 1 or found[0][1]:
        return None
    node = found[0][0]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Found("function", node.name)
    if isinstance(node, ast.ClassDef):
        return _class(mod, node, hops)
    if isinstance(node, ast.ImportFrom):
        alias = next((a for a in node.names if (a.asname or a.name) == name), None)
        source = _absolute(mod, node)
        if alias is None or source is None:  # `from x import *`
            return None
        if source == mod.name:  # `from . import name` in a package: a submodule
            return Found("missing")
        return _read(f"{source}.{alias.name}", hops)
    if isinstance(node, ast.Import):
        return Found("missing")  # a module
    return None


def _absolute(mod: _Module, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    parts = mod.name.split(".")
    base = parts if mod.package else parts[:-1]
    if node.level - 1 > len(base) - 1:
        return None
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _class(mod: _Module, node: ast.ClassDef, hops: int) -> Found | None:
    """The class's ``__init__`` parameters: its own, else its single base's (``object``: ``**kwargs``)."""
    if node.decorator_list or node.keywords:
        return None
    inits = _bindings(node.body, "__init__")
    if inits:
        init = inits[0][0]
        if len(inits) > 1 or inits[0][1] or not isinstance(init, ast.FunctionDef) or init.decorator_list:
            return None
        a = init.args
        params = None if a.kwarg else tuple(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        return Found("class", node.name, params)
    if not node.bases:
        return Found("class", node.name, None)  # object.__init__(self, /, *args, **kwargs)
    if len(node.bases) > 1 or hops <= 0:
        return None
    base = _dotted(mod, node.bases[0], hops)
    if base is None:
        return None
    inherited = _read(base, hops - 1) if "." in base else _name_in(mod, base, hops - 1)
    if inherited is None or inherited.kind != "class":
        return None
    return Found("class", node.name, inherited.params)


def _dotted(mod: _Module, expr: ast.expr, hops: int) -> str | None:
    """A base-class expression as a name of ``mod`` (``Adam``) or a dotted target (``torch.optim.Adam``)."""
    attrs: list[str] = []
    while isinstance(expr, ast.Attribute):
        attrs.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    if not attrs:
        return expr.id
    found = _bindings(mod.tree.body, expr.id)
    if len(found) != 1 or found[0][1]:
        return None
    node = found[0][0]
    if isinstance(node, ast.Import):
        alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == expr.id)
        root = alias.name if alias.asname else expr.id
        return ".".join([root, *attrs])
    if isinstance(node, ast.ImportFrom):
        alias = next((a for a in node.names if (a.asname or a.name) == expr.id), None)
        source = _absolute(mod, node)
        return None if alias is None or source is None else ".".join([source, alias.name, *attrs])
    return None
