"""Restore: find a consistent checkpoint (:class:`Snapshot`) wherever it lives."""

from shadow.restore.resolve import resolve
from shadow.restore.snapshot import Snapshot

__all__ = ["Snapshot", "resolve"]
