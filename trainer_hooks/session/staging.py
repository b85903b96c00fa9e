"""The staging ring: one preallocated fp32 buffer, carved FIFO into per-bucket slots.

The comm hook copies this rank's stripe of each reduced bucket into a slot; the sender
thread sends straight from the slot (zero-copy) and frees it once ZeroMQ is done with
it. Nothing is allocated per step. When the ring is full, ``alloc`` waits (bounded).

Slots are carved in allocation order, and space is reclaimed from the oldest slot on:
a slot released early (hooks running on several threads may queue their slots out of
allocation order) is reclaimed once every older slot is released too.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch


class RingFullError(TimeoutError):
    pass


class RingInterrupted(RuntimeError):
    """The session stopped streaming (degraded) while a hook waited for ring space."""


class StagingRing:
    """One fp32 buffer carved into slots in allocation order.

    Threads: :meth:`alloc` runs on the thread running the comm hook (the training thread,
    or DDP's reducer threads), :meth:`release` on the sender thread once ZeroMQ is done
    with a slot, :meth:`interrupt` on whichever thread degrades the session; every field
    is guarded by one condition variable, on which ``alloc`` waits for space."""

    def __init__(self, capacity: int, pin: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"staging ring capacity must be positive, got {capacity}")
        self.tensor = torch.empty(capacity, dtype=torch.float32, pin_memory=pin)
        self.array = self.tensor.numpy()
        self.capacity = capacity
        self._head = 0  # next free element
        self._live: deque[list] = deque()  # [offset, n, released] in allocation order
        self._used = 0
        self._cond = threading.Condition()
        self.blocked_s = 0.0
        self.high_water = 0
        self._interrupted = False

    def _fits(self, n: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0 if n <= self.capacity else None
        tail = self._live[0][0]
        wrapped = self._live[-1][0] < tail
        if not wrapped:  # free space: [head, capacity) and [0, tail)
            if self._head + n <= self.capacity:
                return self._head
            if n <= tail:
                return 0
            return None
        return self._head if self._head + n <= tail else None

    def alloc(self, n: int, timeout: float) -> int:
        """Offset of ``n`` contiguous elements; waits up to ``timeout`` seconds."""
        if n > self.capacity:
            raise ValueError(
                f"a bucket stripe of {n} elements exceeds the staging ring ({self.capacity}); "
                "raise SHADOW_RING_ITERATIONS"
            )
        with self._cond:
            off = self._fits(n)
            if off is None:
                t0 = time.monotonic()
                ok = self._cond.wait_for(lambda: self._fits(n) is not None or self._interrupted, timeout)
                self.blocked_s += time.monotonic() - t0
                if self._interrupted:
                    raise RingInterrupted("the session stopped streaming while waiting for ring space")
                if not ok:
                    raise RingFullError(f"staging ring stayed full for {timeout:.0f} s (the sender is stuck)")
                off = self._fits(n)
                assert off is not None  # the wait ended on room, and the lock is still held
            self._live.append([off, n, False])
            self._head = off + n
            self._used += n
            self.high_water = max(self.high_water, self._used)
            return off

    def interrupt(self) -> None:
        """Wake and fail any wait for space (the session no longer streams)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def release(self, off: int, n: int) -> None:
        """Free the slot at ``off`` (its space returns once every older slot is free too)."""
        with self._cond:
            for slot in self._live:
                if slot[0] == off and slot[1] == n and not slot[2]:
                    slot[2] = True
                    break
            else:
                raise RuntimeError(f"staging ring released {(off, n)}, which is not a live slot")
            while self._live and self._live[0][2]:
                self._used -= self._live.popleft()[1]
            self._cond.notify_all()

    @property
    def occupancy(self) -> float:
        return self._used / self.capacity
