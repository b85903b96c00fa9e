"""shadow: per-iteration checkpoints of PyTorch training, replayed on CPU workers.

The packages, following a gradient: ``transport`` and ``wire`` carry it from the trainer
(``trainer_hooks``) to a ``worker``, which replays the optimizer step (``kernels``) and
``persist``s to ``storage``; the ``coordinator`` decides what is committed; ``restore`` and
``export`` read it back. ``config``, ``security``, ``core``, ``metrics``, ``planner`` and
``cli`` serve them all; ``testing`` is what tests and benchmarks share.

Modules that moved into packages keep their old import paths (``shadow.tuning`` is
``shadow.config.tuning``, the same module object)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

#: old import path -> where the module lives now
MOVED = {
    "shadow.choices": "shadow.config.choices",
    "shadow.client": "shadow.transport.client",
    "shadow.config_security": "shadow.config.security",
    "shadow.errors": "shadow.core.errors",
    "shadow.jobs": "shadow.core.jobs",
    "shadow.keyset": "shadow.security.keyset",
    "shadow.layout": "shadow.core.layout",
    "shadow.logs": "shadow.config.logs",
    "shadow.optim_groups": "shadow.core.optimizers",
    "shadow.private": "shadow.security.private",
    "shadow.snapshot": "shadow.core.snapshot",
    "shadow.sqrttab": "shadow.core.sqrttab",
    "shadow.tuning": "shadow.config.tuning",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module it moved to (the same object in ``sys.modules``)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())
