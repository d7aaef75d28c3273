"""The package's modules import each other without circles.

Every import counts: module-level ones, those under ``if TYPE_CHECKING:`` and those inside functions (a
circle deferred to call time is still one in the design). Optional kernel libraries (triton, flashinfer,
lm_eval, ...) are outside the package and never an edge, whether their importers are imported lazily or
not. An import of ``a.b`` is an edge to ``a.b``, not to the packages above it.

An outside tool agrees: grimp (the import-graph library behind import-linter) builds its own graph of the
package, which must have the same edges and no circle by its own chain search.
"""
from __future__ import annotations

import ast
from pathlib import Path

import attnzoo

ROOT = Path(__file__).resolve().parents[1] / "attnzoo"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_imports(tree: ast.Module):
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _all_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_known_edges():
    g = import_graph()
    assert "attnzoo.attention.reference" in g["attnzoo.attention.nsa"]
    assert "attnzoo.attention.backends.base" in g["attnzoo.attention.layer"]
    assert "attnzoo.engine.tensor_parallel" in g["attnzoo.engine.llm"]  # in load_model
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)



def grimp_graph():
    import grimp  # the test extra installs it

    # grimp reads the attnzoo that Python imports; the walk above reads this checkout's.
    assert Path(attnzoo.__file__).resolve().parent == ROOT, f"attnzoo is imported from {attnzoo.__file__}, not {ROOT}"
    return grimp.build_graph("attnzoo", cache_dir=None)  # its own packages only; every import, lazy ones too


def grimp_cycles(graph) -> list[list[str]]:
    """Circles by grimp's own search: an import a -> b closes one when grimp finds a chain b -> ... -> a.
    Each circle once, as its sorted modules."""
    found: set[tuple[str, ...]] = set()
    for a in graph.modules:
        for b in graph.find_modules_directly_imported_by(a):
            chain = graph.find_shortest_chain(importer=b, imported=a)
            if chain is not None:
                found.add(tuple(sorted(set(chain))))
    return [list(c) for c in sorted(found)]


def test_grimp_finds_a_synthetic_circle():
    import grimp

    g = grimp.ImportGraph()
    for importer, imported in (("a", "b"), ("b", "c"), ("c", "a"), ("d", "a"), ("d", "e")):
        g.add_import(importer=importer, imported=imported)
    assert grimp_cycles(g) == [["a", "b", "c"]]
    g.remove_import(importer="c", imported="a")
    assert grimp_cycles(g) == []


def test_grimp_sees_the_same_edges_and_no_circle():
    g = grimp_graph()
    theirs = {(m, t) for m in g.modules for t in g.find_modules_directly_imported_by(m)}
    ours = {(m, t) for m, targets in import_graph().items() for t in targets}
    # No normalising needed: both resolve `from p import x` to the module p.x where x is one, else to p,
    # and neither adds package -> child edges that no import statement makes.
    assert theirs == ours, f"only grimp: {sorted(theirs - ours)}; only ours: {sorted(ours - theirs)}"
    assert ("attnzoo.engine.llm", "attnzoo.engine.tensor_parallel") in theirs  # an import inside a function
    found = grimp_cycles(g)
    assert not found, "import circles (grimp): " + "; ".join(" <-> ".join(c) for c in found)
