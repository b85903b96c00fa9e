"""What the coordinator knows, in one place: :class:`ClusterState`.

Every component (:mod:`membership`, :mod:`cut`, :mod:`replicas`, :mod:`rebuild`,
:mod:`attach`, :mod:`trainers`, :mod:`queries`) reads and changes this one object and
nothing else of the coordinator's; what they send goes through an
:class:`~shadow.coordinator.outbox.Outbox`. The methods here only read, but for
:meth:`ClusterState.new_data_key`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shadow.config import check_shape
from shadow.config.tuning import Tuning
from shadow.coordinator.records import Health, JobRec, JobStatus, WorkerRec
from shadow.security import Peer
from shadow.wire import tags

logger = logging.getLogger(__name__)


class Rejections(dict[str, int]):
    """Messages and steps the coordinator refused or failed, by reason (status ``rejected``,
    metric ``shadow_rejected_frames{worker="coordinator"}``)."""

    def __init__(self) -> None:
        super().__init__()
        self._logged: dict[str, float] = {}  # reason -> when its failure was last logged

    def add(self, reason: str) -> None:
        self[reason] = self.get(reason, 0) + 1

    def failed(self, reason: str, what: str) -> None:
        """Count a failure (an exception inside a handler or step) under ``reason``, and log
        it with its traceback once a minute per reason at most. Call from an ``except`` block."""
        self.add(reason)
        now = time.monotonic()
        if now - self._logged.get(reason, float("-inf")) >= 60.0:
            self._logged[reason] = now
            logger.exception("%s failed (%d times so far); the coordinator carries on", what, self[reason])


@dataclass
class ClusterState:
    """The cluster as the coordinator knows it: worker slots, the attached job, held attaches.

    Owned by the coordinator's loop thread (see :class:`~shadow.coordinator.server.Coordinator`);
    the metrics endpoint's HTTP thread reads it without a lock and never writes."""

    expected: int  # worker slots
    replicas: int = 1
    tuning: Tuning = field(default_factory=Tuning.load)
    workers: list[WorkerRec] = field(default_factory=list)  # registered, sorted by id
    job: JobRec | None = None
    # job name -> {"ranks": {rank: (ident, msg)}, "bytes": {rank: size held}, "held": their sum,
    #              "since": t, "told": n, "deadline": t}: attaches waiting for their other ranks
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejected: Rejections = field(default_factory=Rejections)
    # (role, reason) -> messages refused because of who sent them ("peer": no authentication)
    refused: dict[tuple[str, str], int] = field(default_factory=dict)
    sender_role: str | None = None  # the role of the message being handled (None: unauthenticated)
    sender: Peer | None = None  # its role and job scope (None: unauthenticated)
    epoch: int = 0
    started: float = field(default_factory=time.time)
    tokens: dict[int, int] = field(default_factory=dict)  # iteration -> tokens seen, for token schedules
    retired: dict[str, Any] | None = None  # memory info of the previous epoch, while the new one bootstraps
    resyncs: dict[str, int] = field(default_factory=dict)  # job -> resyncs asked of its trainers
    starting: dict[int, dict[str, Any]] = field(default_factory=dict)  # pid -> a worker still compiling
    keyed: bool = False  # CURVE is on: every worker configuration gets a fresh data key
    loop: Any = None  # the loop's LoopWatch (status ``loop``), set by the Coordinator

    def new_data_key(self, w: WorkerRec, retire: bool = False) -> None:
        """Draw worker ``w`` a fresh data key (keyed clusters) for its next configuration: what
        any rank sent it under the last one no longer checks out. ``retire``: the last one's
        state still answers restores while the new epoch bootstraps (its key is kept for
        their tickets)."""
        w.retired_key = w.data_key if retire else None
        w.data_key = tags.new_key() if self.keyed else None

    def data_keys(self, rank: int, workers: list[WorkerRec]) -> dict[str, Any]:
        """The ``keys`` field of rank ``rank``'s ``attached`` (none on a wire without keys)."""
        if not self.keyed:
            return {}
        return {"keys": [tags.rank_key(w.data_key, rank) if w.data_key else b"" for w in workers]}

    def from_rank(self, env: list[bytes], rank: int) -> bool:
        """Whether a message naming ``rank`` of the attached job comes from that rank's own
        connection (the one it attached or heartbeats from); if not, it is counted as refused."""
        job = self.job
        if job is not None and job.trainers.get(rank) == env[0]:
            return True
        self.refuse(self.sender_role, "not_the_rank")
        logger.warning("refused a message naming rank %d from another connection", rank)
        return False

    def refuse(self, role: str | None, reason: str) -> None:
        """Count one message refused because of its sender (``role`` None: unauthenticated)."""
        key = (role or "peer", reason)
        self.refused[key] = self.refused.get(key, 0) + 1

    def __post_init__(self) -> None:
        check_shape(self.expected, self.replicas)

    @property
    def nshards(self) -> int:
        return self.expected // self.replicas

    def alive(self, w: WorkerRec, now: float) -> bool:
        """``w`` answered within ``tuning.worker_lost_s``."""
        return w.alive(now, self.tuning.worker_lost_s)

    def worker(self, ident: bytes) -> WorkerRec | None:
        """The registered worker whose connection is ``ident``."""
        for w in self.workers:
            if w.ident == ident:
                return w
        return None

    def shard_of(self, w: WorkerRec) -> int:
        return w.id % self.nshards

    def ready_workers(self, now: float | None = None) -> list[WorkerRec]:
        """Registered workers that answer: kernels compiled, sockets bound."""
        now = time.monotonic() if now is None else now
        return [w for w in self.workers if self.alive(w, now)]

    def healthy(self, w: WorkerRec, now: float | None = None) -> bool:
        """``w`` holds the current epoch's state and can serve it."""
        job = self.job
        now = time.monotonic() if now is None else now
        return (
            self.alive(w, now)
            and not w.stale
            and not w.undelivered
            and not w.out_of_service
            and job is not None
            and w.configured == job.epoch
        )

    def serving(self, now: float | None = None) -> list[WorkerRec] | None:
        """One healthy replica per shard (lowest id first), or None if a shard has none."""
        now = time.monotonic() if now is None else now
        out: dict[int, WorkerRec] = {}
        for w in self.workers:
            if self.shard_of(w) not in out and self.healthy(w, now):
                out[self.shard_of(w)] = w
        return [out[s] for s in range(self.nshards)] if len(out) == self.nshards else None

    def health(self, w: WorkerRec, now: float) -> Health:
        if not self.alive(w, now):
            return Health.LOST
        if self.job is not None and w.id in self.job.joining:
            return Health.JOINING
        if w.stale or w.undelivered:
            return Health.STALE
        return Health.OUT if w.out_of_service else Health.OK

    def pending_view(self) -> dict[str, int]:
        """What the held attaches take: job names, ranks, bytes of their messages."""
        return {
            "jobs": len(self.pending),
            "ranks": sum(len(p["ranks"]) for p in self.pending.values()),
            "bytes": sum(p["held"] for p in self.pending.values()),
        }

    def status_is(self, *statuses: JobStatus) -> bool:
        """A job is attached and its status is one of ``statuses``."""
        return self.job is not None and self.job.status in statuses


def configure_fields(
    st: ClusterState,
    w: WorkerRec,
    persist: Any,
    iteration: int,
    peer: dict[str, Any] | None = None,
    keep: int | None = None,
) -> dict[str, Any]:
    """The ``configure`` message that assigns worker ``w`` its range of the current job's
    epoch from ``iteration`` (``peer``: copy that iteration from this replica's serve endpoint;
    ``keep``: the epoch whose state at ``iteration`` the worker may keep as the base).
    ``persist`` is the coordinator's :class:`~shadow.coordinator.persistence.Persistence`."""
    job = st.job
    assert job is not None, "configure needs an attached job"
    start, stop = job.ranges[w.id]
    return {
        "epoch": job.epoch,
        "job": job.name,
        "job_id": job.job_id,
        "layout": job.layout,
        "start": start,
        "stop": stop,
        "world": job.world,
        "optim": job.optim,
        "iteration": iteration,
        "persist": persist.wire(job.generation),
        "shard": st.shard_of(w),
        "shards": st.nshards,
        "peer": peer,
        **({"data_key": w.data_key} if w.data_key is not None else {}),
        **({"keep": keep} if keep is not None else {}),
        "rank_secret": job.secret,
    }
