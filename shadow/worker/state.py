"""What a worker knows and counts, in one place: :class:`WorkerState`.

Every part of the worker (:mod:`data`, :mod:`apply`, :mod:`fetches`, :mod:`peer`, and the
control routes of :mod:`server`) reads and changes this one object and what it was handed
in its constructor, nothing else; what they tell the coordinator goes through an
:class:`~shadow.worker.outbox.Outbox`. Imports no torch."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shadow.config.tuning import Tuning

if TYPE_CHECKING:
    from shadow.worker.assignment import Assignment
    from shadow.worker.outbox import Outbox

logger = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """One worker's identity, the shard it holds, and its counters.

    Owned by the worker process's main thread (:meth:`shadow.worker.server.Worker.run`):
    every part reads and writes it there. The metrics endpoint's HTTP thread reads fields
    without a lock and never writes."""

    tuning: Tuning = field(default_factory=Tuning.load)  # the knobs every part reads
    worker_id: int = -1  # the slot the coordinator gave (``registered``), or the one asked for
    assignment: Assignment | None = None  # the current attach epoch's shard (``configure``)
    # the previous epoch's shard, served to restores until the new epoch has its base: a
    # trainer killed during a (re-)attach bootstrap restores from it
    retired: Assignment | None = None
    awaiting_copy: bool = False  # a replacement replica: leave data frames queued until its peer copy
    stopping: bool = False  # ``shutdown`` heard or :meth:`Worker.stop` called: the loop ends
    rejected: Counter[str] = field(default_factory=Counter)  # refused or failed inputs, by reason
    configures: int = 0  # epochs configured: the first bootstrap, then every resync or peer copy
    replay_s: float = 0.0  # time in the apply kernels
    replayed: int = 0  # iterations applied by the kernels
    persisted: dict[str, list[Any]] = field(default_factory=dict)  # tier -> [seconds, shards, bytes, failures]
    started: float = field(default_factory=time.monotonic)


def go_stale(state: WorkerState, outbox: Outbox, reason: str) -> None:
    """Stop trusting the current assignment (a frame lost or changed, an apply or a peer
    copy that failed, a control message half carried out): its frames are ignored and the
    coordinator is told, once, so that it resyncs this replica."""
    s = state.assignment
    if s is None or s.stale:
        return
    s.stale = reason
    logger.error("worker %d is stale in epoch %d: %s", state.worker_id, s.epoch, reason)
    outbox.to_coord("stale", epoch=s.epoch, reason=reason)
