"""The ``shadow`` command line, and the config composition it uses (for scripts that
want the same ``key=value`` / ``--config-name`` / ``--cfg job`` handling)."""

from shadow.cli._compose import UsageError, compose_typed, split
from shadow.cli.main import main

__all__ = ["UsageError", "compose_typed", "main", "split"]
