"""The docs say what the code does: the generated reference is current, links resolve,
every CLI command and every metric is documented."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_api_reference_is_current():
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_api_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"docs/api.md is stale: run python tools/gen_api_docs.py\n{res.stdout}{res.stderr}"


def test_reference_covers_commands_metrics_and_public_names():
    import trainer_hooks
    from shadow.cli._compose import CONFIGS
    from shadow.metrics import ALL

    text = (ROOT / "docs" / "api.md").read_text()
    for name in CONFIGS:
        assert f"### `shadow {name}`" in text
    for name in ALL:
        assert f"`{name}`" in text
    for name in trainer_hooks.__all__:
        assert f"trainer_hooks.{name}" in text or name.endswith("Error")


def test_relative_links_resolve():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


TOP = ("shadow/", "trainer_hooks/", "examples/", "benchmarks/", "tools/", "scripts/", "tests/", "deploy/", "configs/")


def test_the_architecture_module_table_names_modules_that_exist():
    """Each path in the first column of docs/architecture.md's module table exists: a full
    path (``shadow/worker/files.py``) sets the directory and package that the short names
    after it in the same cell (``peer.py``, ``session/audit.py``) are read against."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## 2. Where the code is", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n|", 1)[1].split("\n\n", 1)[0]  # the first table of the section
    rows = [ln for ln in ("|" + table).splitlines() if ln.startswith("| `")]
    assert len(rows) > 20, "the module table was not found"
    missing = []
    for row in rows:
        base = pkg = ""
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if name.startswith(TOP):
                path = name
                base = name.rstrip("/") if name.endswith("/") else name.rsplit("/", 1)[0]
                pkg = name.split("/", 1)[0]
                if not (ROOT / path).exists():
                    missing.append(name)
                continue
            if not name.endswith((".py", "/", ".sh")):
                continue  # a name of something, not a path
            found = [d for d in (base, pkg) if d and (ROOT / d / name).exists()]
            if not found:
                missing.append(f"{name} (after {base})")
            elif "/" in name.rstrip("/"):  # a path within the package: the names after it are beside it
                base = f"{found[0]}/{name.rstrip('/').rsplit('/', 1)[0]}"
    assert not missing, f"docs/architecture.md's module table names what does not exist: {missing}"
