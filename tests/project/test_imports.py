"""The package has no import cycles between its parts, counting lazy (function-level) imports too.

A part is a top-level module or subpackage of ``vramsweep`` (``vramsweep.knobs``, ``vramsweep.config``,
...). A cycle between parts (config -> build -> config) means a change on one floor can break the
other's import, and lazy imports only hide it until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in (SRC / "vramsweep").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
        part = _part(module)
        graph.setdefault(part, set()).update(
            _part(d) for d in deps if d.startswith("vramsweep.") and _part(d) != part
        )
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if state.get(m) is None and (cyc := visit(m)):
                return cyc
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None and (cyc := visit(n)):
            return cyc
    return None


@pytest.mark.torchfree
def test_no_import_cycles_between_parts():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.torchfree
def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.torchfree
def test_lower_floors_do_not_import_upper_ones():
    """record/ and data/ and measure/ and longctx/ are the floor: they import no other vramsweep part except
    record (result contract); report/ reads results, never the trial or the build."""
    g = import_graph()
    for low in ("vramsweep.data", "vramsweep.measure", "vramsweep.longctx", "vramsweep.record"):
        assert g.get(low, set()) <= {"vramsweep.record"}, (low, g.get(low))
    assert not g.get("vramsweep.report", set()) & {"vramsweep.trial", "vramsweep.knobs"}


def module_graph() -> dict[str, set[str]]:
    """Module -> the vramsweep modules it imports (a package and its own submodules are not edges)."""
    mods: dict[str, Path] = {}
    for path in (SRC / "vramsweep").rglob("*.py"):
        mods[".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[module] = {
            d
            for d in deps
            if d in mods and d != module and not module.startswith(d + ".") and not d.startswith(module + ".")
        }
    return graph


@pytest.mark.torchfree
def test_no_import_cycles_between_modules():
    """Within a part too: e.g. build.model <-> build.kernels, config.compose <-> config.rules."""
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cpu_config_rules_do_not_import_torch():
    """Checking a CPU config (every rule, machine rules included) needs no torch: its import costs seconds
    of a pre-flight meant to answer in one (only a CUDA profile asks torch whether CUDA is there)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from vramsweep.config import compose\n"
        "compose(['adapter.dropout=0.1', 'attention=sdpa'], rules='all')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
