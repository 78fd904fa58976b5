"""No import circles among the modules of `src/fedtrain`.

The graph is read from the source with `ast` (nothing is imported): an edge for every import
at module level, relative imports resolved, and `from pkg import name` counted as an import
of `pkg.name` when that is a module. Three graphs are checked:

- at run time: without the `if TYPE_CHECKING:` blocks. A circle here makes the import
  order matter; there must be none, with no exception.
- with the type-only imports of ordinary modules too: two modules that name each other's
  types know each other, a circle all the same. Left out are the `TYPE_CHECKING` blocks of
  package `__init__`s, which only declare the names the package exports lazily (PEP 562).
- with the imports inside functions too: an import deferred into a function still makes two
  modules know each other, and a circle hidden that way is a circle all the same.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fedtrain"

#: Circles allowed in the second graph (counting type-only imports): none. An entry that is no
#: longer a circle fails the test too, so that the set cannot go stale.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()

Graph = dict[str, set[str]]


def modules_under(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the package at `src`: dotted name -> (file, is a package)."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt], type_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported (and, with `type_only`, those under
    `if TYPE_CHECKING:`): in nested blocks and class bodies, never in functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if type_only or not _is_type_checking(node):
                found += _module_level_imports(node.body, type_only)
            found += _module_level_imports(node.orelse, type_only)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _module_level_imports(block, type_only)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found += _module_level_imports(node.body, type_only)
    return found


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import may load: the module, and each `from` name as a submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports inside the functions (and methods) of a module, at any depth."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def import_graph(src: Path, *, type_only: bool, in_functions: bool = False) -> Graph:
    """Module -> the modules of the same package it imports at module level (see the docstring);
    `type_only` adds the `TYPE_CHECKING` imports of every module but the package `__init__`s,
    `in_functions` the imports inside functions."""
    known = modules_under(src)
    graph: Graph = {}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = _module_level_imports(tree.body, type_only and not is_package)
        if in_functions:
            nodes += _function_imports(tree)
        graph[name] = {m for node in nodes for m in _imported(node, package) if m in known and m != name}
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one circle through it
    (`a -> b -> a`), in a stable order (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted((_circle_through(graph, c) for c in components), key=lambda c: c[0])


def _circle_through(graph: Graph, component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself, inside it."""
    start = min(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def _named(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in found)


def test_no_import_circles_at_run_time() -> None:
    found = circles(import_graph(SRC, type_only=False))
    assert found == [], f"import circles: {_named(found)}"


def test_no_import_circles_but_the_known_ones() -> None:
    found = circles(import_graph(SRC, type_only=True))
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert new == [], f"import circles (counting TYPE_CHECKING imports): {_named(new)}"
    gone = {frozenset(c) for c in found}
    stale = sorted(sorted(c) for c in KNOWN_CYCLES if c not in gone)
    assert stale == [], f"no longer circles, remove them from KNOWN_CYCLES: {stale}"


def test_no_import_circles_counting_the_imports_inside_functions() -> None:
    found = circles(import_graph(SRC, type_only=True, in_functions=True))
    assert found == [], f"import circles (counting imports inside functions): {_named(found)}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_check_finds_circles_and_names_them(tmp_path: Path) -> None:
    src = _write(tmp_path, {
        "pkg/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "pkg/a.py": "from . import b\nA = 1\n",  # `from package import submodule`, relative
        "pkg/b.py": "import pkg.a\n",
        "pkg/c.py": "def late():\n    from pkg import d\n",  # inside a function: not an edge
        "pkg/d.py": "from pkg.c import late\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..f import F\n",
        "pkg/f.py": "from pkg.sub.e import TYPE_CHECKING\nF = 1\n",
    })
    assert circles(import_graph(src, type_only=False)) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert circles(import_graph(src, type_only=True)) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.f", "pkg.sub.e", "pkg.f"],
    ]
    assert circles(import_graph(src, type_only=True, in_functions=True)) == [  # c's late import counts here
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.c", "pkg.d", "pkg.c"],
        ["pkg.f", "pkg.sub.e", "pkg.f"],
    ]
