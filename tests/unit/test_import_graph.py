"""The product's import graph has no circles (import-linter's contracts in pyproject.toml hold the
layering; this holds the acyclicity). Every import counts, also one inside a function or under
TYPE_CHECKING: a circle hidden that way is still a circle a reader has to untangle."""

from __future__ import annotations

import grimp

PRODUCT = ("sie", "sidecar", "xds_server", "node_host")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    modules = sorted(m for m in graph.modules if m.split(".")[0] in PRODUCT)
    edges = {
        m: sorted(d for d in graph.find_modules_directly_imported_by(m) if d.split(".")[0] in PRODUCT) for m in modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_the_product_has_no_import_circles():
    graph = grimp.build_graph(*PRODUCT, include_external_packages=False)
    assert len(graph.modules) > 100  # the whole product was read
    assert _cycles(graph) == []


def test_the_check_finds_a_circle():
    graph = grimp.ImportGraph()
    for m in ("sie", "sie.a", "sie.b", "sie.c"):
        graph.add_module(m)
    graph.add_import(importer="sie.a", imported="sie.b")
    graph.add_import(importer="sie.b", imported="sie.c")
    graph.add_import(importer="sie.c", imported="sie.a")
    assert _cycles(graph) == [["sie.a", "sie.b", "sie.c"]]
