"""The import graph: no module imports itself through others (imports inside functions and
under ``TYPE_CHECKING`` count), and the packages import each other only in the direction
docs/architecture.md draws (the ``[tool.importlinter]`` contracts in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest

from tests.conftest import ROOT

PACKAGES = ("shadow", "trainer_hooks")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever is installed
    try:
        return grimp.build_graph(*PACKAGES, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each strongly connected set of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        part.append(m)
                        if m == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return found


def test_the_cycle_finder_finds_a_cycle():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a")
    g.add_import(importer="p.c", imported="p.d")
    assert cycles(g) == [["p.a", "p.b", "p.c"]]


def test_no_module_imports_itself_through_others(graph):
    found = cycles(graph)
    chains = []
    for part in found:
        first, *rest = part
        for other in rest:  # one chain each way shows where to cut
            there = graph.find_shortest_chain(importer=first, imported=other)
            back = graph.find_shortest_chain(importer=other, imported=first)
            if there and back:
                chains.append(" -> ".join(there) + " -> " + " -> ".join(back[1:]))
                break
    assert not found, "import cycles (lazy and TYPE_CHECKING imports included):\n" + "\n".join(chains)


def test_packages_import_each_other_only_in_the_documented_direction():
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "Contracts:" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]  # the contracts ran
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def _modules():
    for top in PACKAGES:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_module_is_over_450_lines():
    """Past that a module holds more than one thing; split it where its parts meet."""
    long = {}
    for path in _modules():
        n = len(path.read_text().splitlines())
        if n > 450:
            long[path.relative_to(ROOT).as_posix()] = n
    assert not long, long


def test_each_package_says_what_it_is_for():
    import ast

    silent = [
        p.relative_to(ROOT).as_posix()
        for p in _modules()
        if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not silent, silent
