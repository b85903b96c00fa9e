"""Assembling iterations from frames: gradient slots (the received payload frames
themselves, applied where they lie), per-rank accounting, and the PREPARED rule (all
bytes of the range plus every rank's commit)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadow.wire.frames import Field, FrameError, Kind
from shadow.worker.commit import merge


@dataclass
class Slot:
    iteration: int
    kind: Kind
    world: int
    received: np.ndarray = field(init=False)  # elements per rank
    field_elems: dict = field(default_factory=dict)  # STATE: elements per field
    commits: list = field(init=False)  # replay part per rank
    blobs: dict = field(default_factory=dict)  # rank -> opaque commit blob
    extras: dict = field(default_factory=dict)  # key -> chunk of model state outside the optimizer
    extra_count: list = field(init=False)  # EXTRA chunks received per rank
    kept: dict = field(default_factory=dict)  # STATE kept by proof: field -> [(lo, hi) local runs proved]
    #: GRAD: ``(local_dst, float32 array)`` per received run; the arrays are views of the
    #: zmq frames (no copy into a separate gradient buffer)
    parts: list = field(default_factory=list)
    merged: dict | None = None  # every rank's commit joined (:meth:`Inbox.replay`)

    def __post_init__(self) -> None:
        self.received = np.zeros(self.world, dtype=np.int64)
        self.commits = [None] * self.world
        self.extra_count = [0] * self.world


class Inbox:
    """Slots for the iterations in flight on one worker."""

    def __init__(self, size: int, world: int, nslots: int, expected_grad, state_fields: tuple[Field, ...]) -> None:
        self.size, self.world = size, world
        self.nslots = nslots  # GRAD iterations in flight at most (bounds the frames held)
        self.slots: dict[int, Slot] = {}
        self.next_seq = [0] * world
        self.expected_grad = expected_grad  # skipped param indices -> elements that need a gradient
        self.state_fields = state_fields

    def check_seq(self, rank: int, seq: int, window: int) -> None:
        """Whether ``seq`` is the next sequence number of ``rank`` (taken by :meth:`advance`
        once the message checks out). Behind it: a duplicate. Ahead by at most ``window``:
        a gap (messages were lost; the replica is stale). Further ahead: no message of this
        session could carry it, so it is dropped as out of window and changes nothing (lost
        messages are still found by the per-rank sent counts the trainers report to the
        coordinator)."""
        want = self.next_seq[rank]
        if seq != want:
            if seq > want + window:
                raise FrameError(
                    "out_of_window", f"rank {rank} sent sequence {seq}, expected {want} (more than {window} ahead)"
                )
            reason = "duplicate" if seq < want else "gap"
            raise FrameError(reason, f"rank {rank} sent sequence {seq}, expected {want}")

    def advance(self, rank: int) -> None:
        """Take ``rank``'s next sequence number (its message checked out whole)."""
        self.next_seq[rank] += 1

    def slot(self, iteration: int, kind: Kind) -> Slot:
        s = self.slots.get(iteration)
        if s is not None:
            if s.kind != kind:
                raise FrameError(
                    "mixed_kinds", f"iteration {iteration} carries both {s.kind.name} and {kind.name} frames"
                )
            return s
        if kind == Kind.STATE:
            s = Slot(iteration, Kind.STATE, self.world)
        elif kind == Kind.GRAD:
            if sum(x.kind == Kind.GRAD for x in self.slots.values()) >= self.nslots:
                raise FrameError(
                    "overflow", f"no free gradient slot for iteration {iteration} ({self.nslots} in flight)"
                )
            s = Slot(iteration, Kind.GRAD, self.world)
        else:
            raise ValueError(f"slots hold GRAD or STATE iterations, not {kind.name}")
        self.slots[iteration] = s
        return s

    @staticmethod
    def grad_parts(slot: Slot) -> list:
        """The slot's gradient parts in flat order."""
        return sorted(slot.parts, key=lambda p: p[0])

    def complete(self, slot: Slot) -> bool:
        """Every rank's commit is in, each rank's byte count (and EXTRA chunk count)
        matches what it says it sent, and every element the step will touch has a
        gradient (or, for STATE, every field of the range is covered)."""
        if any(c is None for c in slot.commits):
            return False
        sent = np.asarray([c["sent"] for c in slot.commits], dtype=np.int64)
        if not np.array_equal(sent, slot.received):
            return False
        if any(n != c.get("extras", 0) for n, c in zip(slot.extra_count, slot.commits, strict=True)):
            return False
        if slot.kind == Kind.STATE:
            return all(slot.field_elems.get(int(f), 0) == self.size for f in self.state_fields)
        return int(slot.received.sum()) >= self.expected_grad(self.replay(slot)["skipped"])

    @staticmethod
    def replay(slot: Slot) -> dict:
        """The iteration's replay record, every rank's commit joined (``shadow.worker.commit.merge``:
        pipeline stages each speak for their part); ``ValueError`` when they leave a part out."""
        if slot.merged is None:
            slot.merged = merge(slot.commits)
        return slot.merged

    def release(self, iteration: int) -> Slot:
        return self.slots.pop(iteration)

    def clear(self) -> None:
        for it in list(self.slots):
            self.release(it)
