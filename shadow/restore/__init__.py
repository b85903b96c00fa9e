"""Restore: find a consistent checkpoint (:class:`Snapshot`) wherever it lives -- a live
cluster's memory or a persisted tier, each a :class:`RestoreSource`.

:class:`TierSource` loads on first use: a restore from memory never loads the tiers'
readers and codecs (numba, zstandard, fsspec)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shadow.core.snapshot import Snapshot
from shadow.restore.memory import MemorySource, MovedOn, ParamSink, fetch_memory, restore_info
from shadow.restore.resolve import find_checkpoint, holds_job, is_endpoint, open_source, pick, resolve
from shadow.restore.sources import Candidate, RestoreSource

if TYPE_CHECKING:
    from shadow.restore.storage_source import TierSource

__all__ = [
    "Candidate",
    "MemorySource",
    "MovedOn",
    "ParamSink",
    "RestoreSource",
    "Snapshot",
    "TierSource",
    "fetch_memory",
    "find_checkpoint",
    "holds_job",
    "is_endpoint",
    "open_source",
    "pick",
    "resolve",
    "restore_info",
]


def __getattr__(name: str) -> Any:
    if name == "TierSource":
        from shadow.restore.storage_source import TierSource

        return TierSource
    raise AttributeError(f"module 'shadow.restore' has no attribute {name!r}")
