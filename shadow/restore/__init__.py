"""Restore: fetch a consistent checkpoint (:class:`Snapshot`) from wherever it lives."""
from shadow.restore.snapshot import Snapshot, fetch_snapshot

__all__ = ["Snapshot", "fetch_snapshot"]
