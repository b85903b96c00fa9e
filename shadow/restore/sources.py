"""Where a restore can come from: the :class:`RestoreSource` protocol and the checkpoints
it offers (:class:`Candidate`). A live cluster's memory is
:class:`~shadow.restore.memory.MemorySource`, a persisted tier
:class:`~shadow.restore.storage_source.TierSource`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from shadow.core.snapshot import Snapshot

COMPLETE, SUPERSEDED, INCOMPLETE, UNREADABLE = "complete", "superseded", "incomplete", "unreadable"
DIVERGED = "diverged"  # superseded after the shadow diverged from the trainer: listed, never restorable


@dataclass(frozen=True)
class Candidate:
    """One checkpoint a source lists: restorable (``complete``; ``superseded``: a later
    generation went on from an older iteration, so never the newest) or not (``incomplete``:
    a torn write; ``unreadable``: its manifest is damaged, ``error`` says how)."""

    job: str
    iteration: int | None
    tier: str
    path: str
    state: str = COMPLETE
    generation: int | None = 0  # None where the source does not know it (memory)
    time: float | None = None
    bytes: int | None = None
    raw_bytes: int | None = None
    error: str = ""
    handle: Any = field(default=None, repr=False, compare=False)  # what the source's load() reads

    @property
    def loadable(self) -> bool:
        return self.state in (COMPLETE, SUPERSEDED)


class RestoreSource(Protocol):
    """Something a restore reads checkpoints from.

    Call order: 0. :meth:`candidates` lists what it holds for ``job`` (every job if None),
    restorable ones oldest first (the newest last); 1. :meth:`load` reads one of them
    (``progress(done_bytes, total_bytes)`` as it arrives). A damaged checkpoint raises
    :class:`~shadow.core.errors.CheckpointError` (try the next older one); a live
    cluster that moved on raises :class:`~shadow.restore.memory.MovedOn` (ask again).
    Timeouts are the source's own (see each)."""

    name: str  # the tier: "memory", "local", "remote"

    @property
    def root(self) -> str:
        """Where it is, as a person named it (an address, a directory, a URL)."""
        ...

    def candidates(self, job: str | None) -> list[Candidate]: ...

    def load(self, candidate: Candidate, progress=None) -> Snapshot: ...
