"""The commit protocol: the messages of one checkpoint, typed, in the order they pass.

1. **prepared** (worker → coordinator, :class:`Prepared`; :mod:`shadow.worker.data`): the
   worker holds every rank's buckets and commit record of iteration k.
2. **the cut** (:meth:`shadow.coordinator.cut.Cut.advance`): committed = the smallest
   iteration the live workers have prepared. Each live worker is told to **apply**
   (:class:`ApplyCut`) through it, ``persist=True`` for the writers of a checkpoint when the
   local tier is due (:meth:`shadow.coordinator.persistence.Persistence.local_due`).
3. **apply** (:meth:`shadow.worker.apply.Apply.through`): the worker replays through the
   cut; a writer snapshots it in that same pass and writes its shard file in the
   background (:mod:`shadow.persist.writer`).
4. **persisted** (worker → coordinator, :class:`Persisted`): one report per shard copy:
   written, failed, or skipped (every image still being written).
5. **settle** (:meth:`~shadow.coordinator.persistence.Persistence.on_report`): once every
   copy asked for is in, the checkpoint is committed by writing its **manifest**, then
   retention runs; a failed or skipped one is discarded and due again.
6. **follow-ups** (:data:`FollowUp`, sent by :meth:`shadow.coordinator.cut.Cut.send`):
   :class:`Upload` the newest complete local checkpoint when the remote tier is due, and
   :class:`Forget` the directories retention dropped (or a failed checkpoint left) on
   every worker's disk.

Each message is a frozen dataclass; :meth:`fields` is what goes on the wire (the schemas of
:mod:`shadow.wire.schemas` check it on arrival) and ``from_msg`` reads a checked message
back. The wire format is unchanged by the types: they are the same maps, named."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


class _Message:
    kind: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        """The message's fields as they are encoded (:func:`shadow.wire.messages.encode`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Prepared(_Message):
    """Worker → coordinator: iteration ``iteration`` of ``epoch`` is complete on the worker
    (``tokens``: the rank-summed token count its commit records carry, if any)."""

    kind: ClassVar[str] = "prepared"
    epoch: int
    iteration: int
    tokens: int | None = None


@dataclass(frozen=True)
class ApplyCut(_Message):
    """Coordinator → worker: apply through ``iteration`` (the cut); ``persist``: this
    worker writes its shard's copy of that iteration to the local tier."""

    kind: ClassVar[str] = "apply"
    epoch: int
    iteration: int
    persist: bool = False


@dataclass(frozen=True)
class Persisted(_Message):
    """Worker → coordinator: one shard copy of ``iteration`` on tier ``tier``.

    ``ok``: written (``file``, ``bytes`` and ``checksum`` describe the file as the tier
    stores it, ``raw_bytes`` the plain image); else ``error`` says why, and ``skipped``
    marks a request the worker could not take (not a failure). ``worker`` is filled in by
    the coordinator from the connection (never trusted from the message)."""

    kind: ClassVar[str] = "persisted"
    epoch: int
    iteration: int
    tier: str
    shard: int
    ok: bool
    error: str = ""
    file: str = ""
    start: int = 0
    stop: int = 0
    bytes: int = 0
    checksum: str = ""
    seconds: float = 0.0
    commit: dict | None = None
    blob_ranks: list = field(default_factory=list)
    raw_bytes: int = 0
    compress: str = "none"
    skipped: bool = False
    disk: dict | None = None
    worker: int = -1

    def fields(self) -> dict[str, Any]:
        out = super().fields()
        del out["worker"]
        if out["disk"] is None:  # optional on the wire: absent, not null
            del out["disk"]
        return out

    @classmethod
    def from_msg(cls, msg: dict[str, Any], worker: int) -> Persisted:
        """A checked ``persisted`` message from worker ``worker``; an older worker's report
        without ``raw_bytes`` counts its stored bytes."""
        return cls(
            epoch=msg["epoch"],
            iteration=msg["iteration"],
            tier=msg["tier"],
            shard=msg["shard"],
            ok=msg["ok"],
            error=msg["error"],
            file=msg["file"],
            start=msg["start"],
            stop=msg["stop"],
            bytes=msg["bytes"],
            checksum=msg["checksum"],
            seconds=msg["seconds"],
            commit=msg["commit"],
            blob_ranks=msg["blob_ranks"],
            raw_bytes=msg.get("raw_bytes", msg["bytes"]),
            compress=msg.get("compress", "none"),
            skipped=msg.get("skipped", False),
            disk=msg.get("disk"),
            worker=worker,
        )


@dataclass(frozen=True)
class Upload(_Message):
    """Coordinator → worker: copy your shard file of ``iteration`` (``bytes``, ``checksum``:
    as the local tier stores it) to the remote tier."""

    kind: ClassVar[str] = "upload"
    epoch: int
    iteration: int
    bytes: int
    checksum: str


@dataclass(frozen=True)
class Forget(_Message):
    """Coordinator → worker: delete these checkpoint directories of ``job`` from your disk
    (retention dropped them, or a failed checkpoint left them)."""

    kind: ClassVar[str] = "forget"
    job: str
    dirs: list[str]


@dataclass(frozen=True)
class UploadCopies:
    """Persistence → cut: the remote tier is due; upload ``copies`` (shard → the report of the
    local copy that goes up) of ``iteration``."""

    iteration: int
    copies: dict[int, Persisted]


@dataclass(frozen=True)
class ForgetDirs:
    """Persistence → cut: checkpoint directories (``dirs``, names under the job) to delete
    from every worker's disk, for ``iteration``'s settling."""

    iteration: int
    dirs: list[str]


#: What settling a checkpoint asks the cut to send next.
FollowUp = UploadCopies | ForgetDirs
