"""The house's shape, checked on every run: no module over 400 lines, at most four modules at the
top of ``actors/``, no import circle between modules (imports at module level, outside
``TYPE_CHECKING``), and no test module importing another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "specroll"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The specroll modules ``path`` imports when it is imported (module level, not TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(_module_name(path))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (module → modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_actors_has_at_most_four_top_level_modules() -> None:
    top = sorted(p.name for p in (SRC / "actors").glob("*.py"))
    assert len(top) <= 4, top


def test_no_import_circle() -> None:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    graph = {name: _module_imports(path, modules) for name, path in paths.items()}
    # A package's __init__ importing its own submodules is not a circle through the package.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_test_module_imports_another() -> None:
    tests = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    offenders = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.rpartition(".")[2] in tests for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def _specroll_imports_at_any_depth() -> list[tuple[str, int, str, str]]:
    """Each ``from specroll… import name`` in the project's Python (functions' bodies included, where a
    benchmark's lazy import fails only when its code path runs): (file, line, module, name)."""
    found = []
    for folder in ("src", "benchmarks", "examples", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specroll"):
                    found += [(str(path.relative_to(ROOT)), node.lineno, node.module or "", a.name) for a in node.names]
    return found


def test_every_name_imported_from_specroll_exists() -> None:
    import importlib
    import importlib.util

    missing = []
    for where, line, module, name in _specroll_imports_at_any_depth():
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:  # an optional extra this machine lacks (flashinfer, vllm) is not ours
            if (e.name or "").startswith("specroll"):
                missing.append(f"{where}:{line}: no module {module}")
            continue
        submodule = hasattr(found, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
        if not hasattr(found, name) and not submodule:
            missing.append(f"{where}:{line}: {module} has no {name}")
    assert not missing, missing
