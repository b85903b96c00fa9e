"""Restore: find a consistent checkpoint (:class:`Snapshot`) wherever it lives."""

from shadow.restore.resolve import resolve
from shadow.snapshot import Snapshot

__all__ = ["Snapshot", "resolve"]
