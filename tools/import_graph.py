"""Print the import graph between shadow's packages (and trainer_hooks), and module sizes.

    python tools/import_graph.py            # package edges, module-level and lazy
    python tools/import_graph.py --sizes    # lines per module, largest first
    python tools/import_graph.py --cycles   # package cycles through module-level imports

An edge ``a -> b`` means a module of package ``a`` imports one of package ``b``; ``(lazy)``
marks edges made only by imports inside functions. Reads source with :mod:`ast`, imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("shadow", "trainer_hooks")


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "trainer_hooks":
        return "trainer_hooks"
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, lazy) for each import of this project's modules in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports under `if TYPE_CHECKING:` or try: at module level count as module level
        if isinstance(node, ast.If | ast.Try):
            top_level.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level if path.name != "__init__.py" else len(module.split("."))]
                names = [".".join([*base, node.module] if node.module else base)]
            elif node.module:
                names = [node.module]
        for n in names:
            if n.split(".")[0] in TOPS:
                found.append((n, id(node) not in top_level))
    return found


def edges() -> dict[tuple[str, str], bool]:
    """(from package, to package) -> lazy only."""
    out: dict[tuple[str, str], bool] = {}
    for mod, path in modules().items():
        src = package_of(mod)
        for target, lazy in imports(path, mod):
            dst = package_of(target)
            if dst != src:
                out[(src, dst)] = out.get((src, dst), True) and lazy
    return out


def cycles(graph: dict[tuple[str, str], bool]) -> list[tuple[str, str]]:
    strict = {(a, b) for (a, b), lazy in graph.items() if not lazy}
    return sorted((a, b) for a, b in strict if (b, a) in strict and a < b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", action="store_true", help="lines per module, largest first")
    p.add_argument("--cycles", action="store_true", help="package pairs importing each other at module level")
    args = p.parse_args(argv)
    if args.sizes:
        rows = sorted(((len(path.read_text().splitlines()), m) for m, path in modules().items()), reverse=True)
        for n, m in rows:
            sys.stdout.write(f"{n:5d}  {m}\n")
        return 0
    graph = edges()
    if args.cycles:
        for a, b in cycles(graph):
            sys.stdout.write(f"{a} <-> {b}\n")
        return 0
    for (a, b), lazy in sorted(graph.items()):
        sys.stdout.write(f"{a} -> {b}{'  (lazy)' if lazy else ''}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
