"""Function sizes of the packages, for measuring a restructuring before and after.

    python tools/code_metrics.py [--over 60] [--top 10] [--json PATH] [PACKAGE ...]

For each package (default ``shadow`` and ``trainer_hooks``): its modules and lines, how many
functions and methods span more than ``--over`` lines (``def`` to the last line of the body,
decorators and docstring included), and the ``--top`` longest, with where they are."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((int(child.end_lineno or child.lineno) - start + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def measure(package: str, over: int, top: int) -> dict:
    files = sorted((ROOT / package).rglob("*.py"))
    sized = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        sized += [(n, f"{rel}:{name}") for n, name in functions(f)]
    sized.sort(reverse=True)
    return {
        "modules": len(files),
        "lines": sum(len(f.read_text().splitlines()) for f in files),
        "functions": len(sized),
        f"over_{over}": sum(1 for n, _ in sized if n > over),
        "longest": [{"lines": n, "where": w} for n, w in sized[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("packages", nargs="*", default=["shadow", "trainer_hooks"])
    ap.add_argument("--over", type=int, default=60)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    doc = {p: measure(p, args.over, args.top) for p in args.packages}
    for p, m in doc.items():
        print(
            f"{p}: {m['modules']} modules, {m['lines']} lines, {m['functions']} functions, "
            f"{m[f'over_{args.over}']} over {args.over} lines"
        )
        for e in m["longest"]:
            print(f"  {e['lines']:4d}  {e['where']}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
