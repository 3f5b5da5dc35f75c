"""No module of the package imports one that imports it back: the package's import graph,
read from the source (every import statement, those inside functions too), has no cycle.
A cycle makes a module's names depend on which of the two is imported first."""

import ast
import graphlib
import pathlib

from hypothesis import given, settings, strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "wide_moe_triton"


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Each module of the package by its dotted name (a folder's ``__init__`` by the
    folder's name)."""
    names = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name a ``from ... import`` statement reads from."""
    if not node.level:
        return node.module or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    here = here[:len(here) - (node.level - 1)]
    return ".".join(here + ([node.module] if node.module else []))


def imports_of(module: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports: ``from X import n`` reads module
    ``X.n`` where that is one, else ``X``; modules outside the package are left out."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path.name == "__init__.py", node)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}
    return (found & modules) - {module}


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    names = module_names(root, package)
    return {m: imports_of(m, path, set(names)) for m, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as its modules in order (the first repeated at the end), or
    None where there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT, PACKAGE)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


MODULES = ["a", "b", "c", "sub", "sub.d"]


def _source(module: str, targets: set[str], style: int) -> str:
    """Import statements for ``targets``, written from ``module`` in one of the forms the
    reader must understand (absolute, relative, ``from package import module``), inside
    a function for odd styles, as the package's lazy imports are."""
    lines = []
    for t in sorted(targets):
        head, _, tail = f"pkg.{t}".rpartition(".")
        lines.append([f"import pkg.{t}", f"from {head} import {tail}",
                      f"from .{'.' if module.startswith('sub') else ''}{t} import name"
                      ][style % 3])
    if style % 2:
        return "def lazy():\n" + "".join(f"    {line}\n" for line in lines) + "    pass\n"
    return "".join(f"{line}\n" for line in lines)


def _write(root: pathlib.Path, edges: dict[str, set[str]], style: int) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    for m in MODULES:
        path = root / "pkg" / (m.replace(".", "/") + ("/__init__.py" if m == "sub" else ".py"))
        path.write_text(_source(m, edges.get(m, set()), style))


@settings(max_examples=60, deadline=None)
@given(edges=st.dictionaries(st.sampled_from(MODULES), st.sets(st.sampled_from(MODULES))),
       style=st.integers(0, 5))
def test_the_reader_finds_each_import_and_each_cycle(tmp_path_factory, edges, style):
    """A package written from a random graph reads back as that graph, and a cycle is
    found exactly where the graph has one (checked against a depth-first search)."""
    root = tmp_path_factory.mktemp("tree")
    _write(root, edges, style)
    graph = import_graph(root, "pkg")
    want = {f"pkg.{m}": {f"pkg.{t}" for t in edges.get(m, set()) if t != m} for m in MODULES}
    want["pkg"] = set()
    assert graph == want
    cycle = find_cycle(graph)
    assert (cycle is not None) == _has_cycle(want)
    if cycle:
        assert cycle[0] == cycle[-1]
        assert all(b in graph[a] for a, b in zip(cycle[1:], cycle))


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    """Depth-first search with three colours: a grey node met again closes a cycle."""
    colour = dict.fromkeys(graph, "white")

    def visit(n):
        colour[n] = "grey"
        for m in graph[n]:
            if colour[m] == "grey" or (colour[m] == "white" and visit(m)):
                return True
        colour[n] = "black"
        return False

    return any(colour[n] == "white" and visit(n) for n in graph)
