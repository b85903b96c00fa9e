"""Optimizer-specific names live in the optimizer registry alone: its specs
(``shadow/core/optimizers/``), the kernel modules and their kernel sets, and the trainer's
optimizer package. Everywhere else asks the registry, so the next optimizer is one spec
module and one kernel module, not edits across the service."""

from __future__ import annotations

import re

from tests.conftest import ROOT

NAMES = re.compile(
    r"momentum_buffer|exp_avg_sq|exp_inf\b|AdamGroup|SgdGroup|AdamaxGroup|amsgrad_any|momentum_any"
    r"|[\"'](?:adam|sgd|adamax)[\"']"
)
ALLOWED = (
    "shadow/core/optimizers/",
    "shadow/kernels/adam",  # adam.py and the modules of its kernels (adam_rules.py, adam_loops.py, ...)
    "shadow/kernels/sgd.py",
    "shadow/kernels/adamax.py",
    "shadow/kernels/sets.py",
    "trainer_hooks/optim/",
)


def test_optimizer_names_appear_only_in_the_registry():
    found = []
    for pkg in ("shadow", "trainer_hooks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                m = NAMES.search(line)
                if m:
                    found.append(f"{rel}:{n}: {m.group(0)}")
    assert not found, "optimizer-specific names outside the registry (ask shadow.core.optimizers):\n" + "\n".join(found)
