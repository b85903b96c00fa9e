"""The coordinator's storage lane: tier I/O run off the loop thread, in order.

The coordinator's loop answers every peer one message at a time; storage calls made there
(a manifest written and fsynced, retention deleting checkpoint directories, listing a tier
for a ``catalog``) silence it for as long as the storage takes: milliseconds on a local
disk, seconds to minutes on an object store that is slow or retrying, or on a disk busy
with other writers. Long enough, and trainers and clients take the coordinator for lost.

:class:`StorageLane` runs such work on one thread of its own, one piece after another in
the order submitted (a catalog asked after a commit lists that commit's manifest; a
retention runs after the manifest it follows). What a piece leads to (``then``: recording
the checkpoint, replying, sending the follow-ups) runs back on the loop thread when the
loop drains the lane (:meth:`StorageLane.drain`; :meth:`fileno` wakes its poll), so the
state stays the loop thread's alone. The rare steps that read a tier synchronously (the
scans of an attach) first :meth:`~StorageLane.flush` it: they see every earlier write, as
before.

Until :meth:`StorageLane.start` (the coordinator's ``run``), the lane runs each piece and its
``then`` at once, on the caller's thread: a coordinator driven message by message (unit
tests) behaves as one without a lane."""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: ``then(result, error)``: what a piece of work leads to, on the loop thread (``error``: what it raised)
Then = Callable[[Any, BaseException | None], None]


class StorageLane:
    """Storage work in order on a thread of its own (see the module's docstring)."""

    def __init__(self) -> None:
        self._work: queue.Queue[tuple[str, Callable[[], Any], Then] | None] = queue.Queue()
        self._done: collections.deque[tuple[str, Then, Any, BaseException | None]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # (read, write) ends of the pipe that wakes the loop's poll
        self.current: tuple[str, float] | None = None  # (work, monotonic start) on the lane now
        self.failed: Callable[[str], None] = lambda what: logger.exception("%s failed", what)

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Run work on the lane's thread from now on (called by the loop thread)."""
        if self._thread is not None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake = (r, w)
        self._thread = threading.Thread(target=self._run, name="coordinator-storage", daemon=True)
        self._thread.start()

    def fileno(self) -> int | None:
        """Readable when finished work waits for :meth:`drain` (None before :meth:`start`)."""
        return None if self._wake is None else self._wake[0]

    def pending(self) -> int:
        """Pieces submitted whose ``then`` has not run yet."""
        return self._work.unfinished_tasks + len(self._done)

    def submit(self, what: str, work: Callable[[], Any], then: Then) -> None:
        """Run ``work()`` on the lane, then ``then(result, error)`` on the loop thread; ``what``
        names it in logs. Before :meth:`start`, both run now."""
        if self._thread is None:
            try:
                result, error = work(), None
            except Exception as exc:
                result, error = None, exc
            self._then(what, then, result, error)
            return
        self._work.put((what, work, then))

    def drain(self) -> int:
        """Run the ``then`` of every piece finished (loop thread); how many ran."""
        if self._wake is not None:
            try:
                while os.read(self._wake[0], 4096):
                    pass
            except BlockingIOError:
                pass
        n = 0
        while self._done:
            what, then, result, error = self._done.popleft()
            self._then(what, then, result, error)
            n += 1
        return n

    def flush(self) -> None:
        """Wait for every piece submitted (and those their ``then`` submits) and run their
        ``then``s (loop thread): for a step that reads the tiers synchronously."""
        if self._thread is None:
            return
        t0 = time.monotonic()
        while True:
            self._work.join()
            if not self.drain() and not self._work.unfinished_tasks:
                break
        took = time.monotonic() - t0
        if took >= 1.0:
            logger.warning("coordinator: waited %.1f s for the storage lane's earlier work", took)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the work already submitted (within ``timeout`` s)."""
        if self._thread is None:
            return
        self._work.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the coordinator's storage lane did not finish its work within %.0f s", timeout)
        self._thread = None
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def _then(self, what: str, then: Then, result: Any, error: BaseException | None) -> None:
        try:
            then(result, error)
        except Exception:  # a bug meeting a result: counted by the coordinator, the loop goes on
            self.failed(what)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            what, work, then = item
            self.current = (what, time.monotonic())
            try:
                result, error = work(), None
            except Exception as exc:
                result, error = None, exc
            took = time.monotonic() - self.current[1]
            self.current = None
            if took >= 5.0:
                logger.warning("coordinator storage lane: %s took %.1f s (the loop answered meanwhile)", what, took)
            self._done.append((what, then, result, error))
            self._work.task_done()
            wake = self._wake
            if wake is not None:
                try:
                    os.write(wake[1], b"x")
                except (BlockingIOError, OSError):  # a full pipe already wakes the loop
                    pass
