"""Assembling iterations from frames: preallocated gradient slots, per-rank accounting,
and the PREPARED rule (all bytes of the range plus every rank's commit)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadow.wire.frames import Field, FrameError, Kind


@dataclass
class Slot:
    iteration: int
    kind: Kind
    buf: int  # index into the gradient pool (-1 for STATE iterations)
    world: int
    received: np.ndarray = field(init=False)  # elements per rank
    field_elems: dict = field(default_factory=dict)  # STATE: elements per field
    commits: list = field(init=False)  # replay part per rank
    blobs: dict = field(default_factory=dict)  # rank -> opaque commit blob

    def __post_init__(self) -> None:
        self.received = np.zeros(self.world, dtype=np.int64)
        self.commits = [None] * self.world


class Inbox:
    """Slots for the iterations in flight on one worker."""

    def __init__(
        self, size: int, world: int, nslots: int, expected_grad, state_fields: tuple[Field, ...]
    ) -> None:
        self.size, self.world = size, world
        self.pool = [np.empty(size, dtype=np.float32) for _ in range(nslots)]
        self.free = list(range(nslots))
        self.slots: dict[int, Slot] = {}
        self.next_seq = [0] * world
        self.expected_grad = expected_grad  # skipped param indices -> elements that need a gradient
        self.state_fields = state_fields

    def check_seq(self, rank: int, seq: int) -> None:
        want = self.next_seq[rank]
        if seq != want:
            reason = "duplicate" if seq < want else "gap"
            raise FrameError(reason, f"rank {rank} sent sequence {seq}, expected {want}")
        self.next_seq[rank] = want + 1

    def slot(self, iteration: int, kind: Kind) -> Slot:
        s = self.slots.get(iteration)
        if s is not None:
            if s.kind != kind:
                raise FrameError("mixed_kinds", f"iteration {iteration} carries both {s.kind.name} and {kind.name} frames")
            return s
        if kind == Kind.STATE:
            s = Slot(iteration, Kind.STATE, -1, self.world)
        elif kind == Kind.GRAD:
            if not self.free:
                raise FrameError("overflow", f"no free gradient slot for iteration {iteration} ({len(self.pool)} in flight)")
            s = Slot(iteration, Kind.GRAD, self.free.pop(), self.world)
        else:
            raise ValueError(f"slots hold GRAD or STATE iterations, not {kind.name}")
        self.slots[iteration] = s
        return s

    def grad_buffer(self, slot: Slot) -> np.ndarray:
        return self.pool[slot.buf]

    def complete(self, slot: Slot) -> bool:
        """Every rank's commit is in, each rank's byte count matches what it says it
        sent, and every element the step will touch has a gradient (or, for STATE,
        every field of the range is covered)."""
        if any(c is None for c in slot.commits):
            return False
        sent = np.asarray([c["sent"] for c in slot.commits], dtype=np.int64)
        if not np.array_equal(sent, slot.received):
            return False
        if slot.kind == Kind.STATE:
            return all(slot.field_elems.get(int(f), 0) == self.size for f in self.state_fields)
        return int(slot.received.sum()) >= self.expected_grad(slot.commits[0]["skipped"])

    def release(self, iteration: int) -> Slot:
        slot = self.slots.pop(iteration)
        if slot.buf >= 0:
            self.free.append(slot.buf)
        return slot

    def clear(self) -> None:
        for it in list(self.slots):
            self.release(it)
