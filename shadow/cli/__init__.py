"""The ``shadow`` command line."""
from shadow.cli.main import main

__all__ = ["main"]
