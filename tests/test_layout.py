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


def _run_imports(tree: ast.AST):
    """The import statements a module runs: at the top or inside a function alike (a function-level
    import still makes two modules depend on each other), but not those under ``if TYPE_CHECKING:``,
    which only name a type for annotations and never run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _run_imports(ast.Module(body=[child], type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _run_imports(node)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it runs."""

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _run_imports(ast.parse(path.read_text())):
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


def test_imports_for_type_annotations_only_are_not_edges_and_function_level_ones_are():
    code = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from xlatrain.train.trainer import Trainer
def f():
    from xlatrain.data import shards
"""
    found = [ast.unparse(n) for n in _run_imports(ast.parse(code))]
    assert found == ["from typing import TYPE_CHECKING", "from xlatrain.data import shards"]


def test_no_module_of_the_package_imports_itself_back_through_others():
    graph = import_graph(_modules())
    assert "xlatrain.data.webdataset" in graph["xlatrain.data.shards"]  # the graph sees real edges
    assert cycles(graph) == []


def _outside_modules(tree: ast.AST) -> set[str]:
    """The modules outside the package that a module imports when it runs (``from torch import
    distributed`` is ``torch.distributed``), and the ``torch.distributed`` it reaches as an attribute."""
    found = set()
    for node in _run_imports(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif not node.level and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    if any(isinstance(n, ast.Attribute) and ast.unparse(n) == "torch.distributed" for n in ast.walk(tree)):
        found.add("torch.distributed")
    return found


def _modules_using(packages: tuple[str, ...], allowed) -> list[str]:
    """The package's files, outside those ``allowed`` (a test of the path under src/xlatrain/),
    that use one of ``packages`` or a module in one."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        used = _outside_modules(ast.parse(path.read_text()))
        if not allowed(rel) and any(n == p or n.startswith(f"{p}.") for n in used for p in packages):
            found.append(rel)
    return found


def test_the_outside_module_finder_sees_a_function_level_import_and_an_attribute():
    code = """
import torch
def f():
    from torch import distributed
def g():
    return torch.distributed.get_rank()
"""
    assert _outside_modules(ast.parse(code)) == {"torch", "torch.distributed"}
    assert _outside_modules(ast.parse("import torch\nx = torch.nn")) == {"torch"}


def test_only_the_backend_and_the_dcp_storage_touch_torch_distributed():
    strays = _modules_using(("torch.distributed",), lambda rel: rel.startswith("backend/") or rel == "storage/dcp.py")
    assert strays == [], (f"{strays} use torch.distributed: only backend/ does (and storage/dcp.py, DCP's storage); "
                          "take the collective from the Strategy")


def test_torch_xla_is_imported_in_the_backend_the_diagnostics_and_the_doctor_alone():
    strays = _modules_using(("torch_xla",), lambda rel: rel.startswith(("backend/", "diagnostics/", "doctor/")))
    assert strays == [], f"{strays} import torch_xla: only backend/, diagnostics/ and doctor/ do"


def test_only_storage_imports_the_object_store_libraries():
    strays = _modules_using(("fsspec", "gcsfs"), lambda rel: rel.startswith("storage/"))
    assert strays == [], f"{strays} import fsspec or gcsfs: where bytes live is storage/"


def test_the_core_never_imports_a_recipe_except_the_command_line():
    graph = import_graph(_modules())
    strays = sorted(name for name, edges in graph.items()
                    if not name.startswith("xlatrain.recipes") and name != "xlatrain.cli"
                    and any(e == "xlatrain.recipes" or e.startswith("xlatrain.recipes.") for e in edges))
    assert strays == [], f"{strays} import xlatrain.recipes: recipes import the core, never the reverse"


def test_where_bytes_live_is_one_folder():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    strays = sorted(n for n in top if "storage" in n or n in ("run_lock", "shard_storage"))
    assert strays == [], f"storage modules outside src/xlatrain/storage/: {strays}"
    assert {"emulator", "cache", "remote_run", "lock", "dcp"} <= {p.stem for p in (PACKAGE / "storage").glob("*.py")}


def test_the_training_loop_reads_on_one_screen():
    path = PACKAGE / "train" / "trainer.py"
    text = path.read_text()
    assert len(text.splitlines()) < 900, "trainer.py grew past 900 lines: move what is not the loop beside it"
    trainer = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    loop = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_fit")
    assert loop.end_lineno - loop.lineno + 1 <= 80
    # One function holds the epochs, the steps within them, the step, the deferred read and the
    # checkpoints: the loop a reader wants to see, top to bottom.
    body = ast.unparse(loop)
    epochs = next(n for n in ast.walk(loop) if isinstance(n, ast.For))
    assert any(isinstance(n, ast.For) for n in ast.walk(epochs) if n is not epochs), "the step loop is not inside the epoch loop"
    for call in ("self._train_step(", "rt.defer(", "resumable.save_checkpoint(", "self._validate(", "self._finish_epoch("):
        assert call in body, call


def test_the_layout_page_names_every_module_of_the_package():
    """docs/guides/layout.md is where a newcomer looks for a file: a module it does not name in its
    folder's entry (or, for a recipe and the script check's rules, whose folder that entry does not
    name) cannot be found there."""
    import re

    page = (SRC.parent / "docs" / "guides" / "layout.md").read_text()
    block = page.split("```")[1]
    entries: dict[str, str] = {}  # each entry of src/xlatrain/ by its first word ("backend/", "cli.py,")
    head = None
    for line in block.splitlines():
        if re.match(r"^  \S", line):
            head = line.split()[0].rstrip(",")
            entries[head] = line
        elif head is not None and line.startswith("    "):
            entries[head] += " " + line
        else:
            head = None  # configs/, docs/, ...: outside the package
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:  # a module at the top: named in any top entry
            text = " ".join(entries.values())
            found = path.name in re.findall(r"[\w.]+", text)
        else:
            text = entries.get(f"{parts[0]}/", "")
            words = re.findall(r"[\w.]+", text)
            found = path.name in words if len(parts) == 2 else (f"{parts[1]}/" in text or path.stem in words)
        if not found:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"docs/guides/layout.md does not name {missing} in its folder's entry"
