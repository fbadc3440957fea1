"""The package's shape, as DESIGN.md draws it: no import circles in src/, where bytes live in
one folder, and the training loop short enough to read on a screen."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "xlatrain"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at the top or inside a function alike (a
    function-level import still makes two modules depend on each other)."""

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {owner(a.name) for a in node.names if a.name.startswith("xlatrain")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.startswith("xlatrain"):
                    edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else owner(base) for a in node.names}
        graph[name] = edges - {name, ""}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back_through_others():
    graph = import_graph(_modules())
    assert "xlatrain.data.webdataset" in graph["xlatrain.data.shards"]  # the graph sees real edges
    assert cycles(graph) == []


def test_where_bytes_live_is_one_folder():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    strays = sorted(n for n in top if "storage" in n or n in ("run_lock", "shard_storage"))
    assert strays == [], f"storage modules outside src/xlatrain/storage/: {strays}"
    assert {"emulator", "cache", "remote_run", "lock", "dcp"} <= {p.stem for p in (PACKAGE / "storage").glob("*.py")}
