"""Shard replicas: losing one copy of a shard loses nothing, and the replacement copies
its state from the surviving peer, not from the trainers.

With ``replicas=R`` the cluster's W workers hold W/R shards; worker ``w`` serves shard
``w % (W/R)``. Trainers send every shard to each of its replicas (the simplest feed: R
times the trainer's egress, no extra hop). The committed cut is the minimum over the
*healthy* workers, so a lost or damaged replica is taken out of service (``replica_out``:
trainers stop sending to it) and the job carries on as long as every shard keeps one.

A replacement (a restarted process in the slot, or a damaged replica that reset its data
socket) joins at an iteration boundary every rank agrees on:

1. the coordinator sends ``replica_in`` (worker, data endpoint, generation) to the ranks;
2. the ranks vote on it beside the last bucket (like a resync) and all start streaming to
   the new replica from the same iteration m, each reporting ``replica_from``;
3. the coordinator holds the cut at m - 1, configures the newcomer for iteration m - 1
   with its peer's serve endpoint; the newcomer fetches the peer's state of m - 1 while
   the trainers' frames of m, m + 1, ... wait in its socket;
4. ``copied``: the newcomer is healthy, the hold is released.

Anything unexpected on the way (ranks disagree on m, the cut already passed m - 1, the
peer is lost or moved on) degrades the job, and the usual resync rebuilds every shard.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shadow.coordinator.cluster import ClusterState, configure_fields
from shadow.coordinator.cut import Cut
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import JobRec, JobStatus, Join, JoinStage, WorkerRec
from shadow.wire import tags

logger = logging.getLogger(__name__)

Msg = dict[str, Any]


class Replicas:
    """Taking a replica out of service, and a replacement's join from its peer (see the
    module docstring): handlers ``replica_from`` (trainers) and ``copied`` (workers)."""

    def __init__(self, state: ClusterState, out: Outbox, cut: Cut, persist: Persistence) -> None:
        self.state, self.out, self.cut, self.persist = state, out, cut, persist

    def down(self, w: WorkerRec, reason: str) -> None:
        """Take ``w`` out of service if every shard keeps a healthy replica; else degrade."""
        job = self.state.job
        if job is None or job.status != JobStatus.RUNNING or self.state.replicas == 1 or w.out_of_service:
            if not w.out_of_service:
                self.cut.degrade(reason)
            return
        w.out_of_service = True
        if self.state.serving() is None:
            w.out_of_service = False
            self.cut.degrade(reason)
            return
        self.cancel_join(w)
        logger.error(
            "worker %d out of service (%s); shard %d continues on its other replica",
            w.id,
            reason,
            self.state.shard_of(w),
        )
        self.out.to_trainers(job, "replica_out", epoch=job.epoch, worker=w.id)
        self.cut.advance()
        if self.state.alive(w, time.monotonic()) and w.stale:  # a damaged but live replica: fresh socket, then a rejoin
            self.out.to_worker(w, "reset", reason=reason)

    def start_join(self, w: WorkerRec) -> bool:
        """A fresh process holds slot ``w``: bring it in from its peer. False if it cannot."""
        job = self.state.job
        if job is None or self.state.replicas == 1 or job.status != JobStatus.RUNNING:
            return False
        w.out_of_service = True
        if self.state.serving() is None:
            return False
        job.gen += 1
        job.joining[w.id] = Join(job.gen)
        # whatever is queued for the old process is dropped
        self.out.to_trainers(job, "replica_out", epoch=job.epoch, worker=w.id)
        logger.warning(
            "worker %d joins shard %d (generation %d): the ranks pick the iteration, its peer sends the state",
            w.id,
            self.state.shard_of(w),
            job.gen,
        )
        self.state.new_data_key(w)  # the newcomer's configure carries it; frames to the old process no longer check out
        key = w.data_key
        self.out.to_trainers(
            job,
            "replica_in",
            each=lambda rank: {} if key is None else {"key": tags.rank_key(key, rank)},
            epoch=job.epoch,
            worker=w.id,
            data=w.data,
            gen=job.gen,
            mode=w.data_mode,
        )
        self.cut.advance()  # the cut no longer waits for the old process in this slot
        return True

    def cancel_join(self, w: WorkerRec) -> None:
        job = self.state.job
        if job is not None and job.joining.pop(w.id, None) is not None:
            self._release_cut_ceiling(job)

    def _release_cut_ceiling(self, job: JobRec) -> None:
        """Hold ``job``'s cut at the earliest iteration a joining replica copies, if any."""
        holds = [j.at for j in job.joining.values() if j.at is not None]
        job.cut_ceiling = min(holds) if holds else None

    def on_replica_from(self, env: list[bytes], msg: Msg) -> None:
        """Rank ``msg.rank`` streams to the joining worker from iteration ``msg.iteration``."""
        job = self.state.job
        if job is None or msg["epoch"] != job.epoch:
            return
        j = job.joining.get(msg["worker"])
        if j is None or j.gen != msg["gen"] or j.stage is not JoinStage.VOTING:
            return
        if not self.state.from_rank(env, msg["rank"]):
            return
        j.starts[msg["rank"]] = msg["iteration"]
        if len(j.starts) < job.world:
            return
        starts = set(j.starts.values())
        m = max(starts)
        w = self.state.workers[msg["worker"]] if msg["worker"] < len(self.state.workers) else None
        peers = [
            p
            for p in self.state.workers
            if p is not w and self.state.shard_of(p) == msg["worker"] % self.state.nshards and self.state.healthy(p)
        ]
        if len(starts) != 1 or job.cut > m - 1 or not peers or w is None:
            job.joining.pop(msg["worker"], None)
            self.cut.degrade(
                f"worker {msg['worker']} could not join from its peer (ranks start at {sorted(starts)}, "
                f"cut {job.cut}, healthy peers {[p.id for p in peers]})"
            )
            return
        j.at = m - 1
        self._release_cut_ceiling(job)
        peer = peers[0]
        source = {"id": peer.id, "serve": peer.serve, **peer.fetch_ticket()}  # mac mode: a ticket for its serve socket
        self.out.to_worker(w, "configure", **configure_fields(self.state, w, self.persist, m - 1, peer=source))
        logger.info("worker %d: copying iteration %d from worker %d; ranks stream from %d", w.id, m - 1, peer.id, m)

    def on_copied(self, env: list[bytes], msg: Msg) -> None:
        w, job = self.state.worker(env[0]), self.state.job
        if w is None or job is None or msg["epoch"] != job.epoch or w.id not in job.joining:
            return
        job.joining.pop(w.id)
        self._release_cut_ceiling(job)
        w.out_of_service, w.stale, w.undelivered, w.configured = False, "", "", job.epoch
        w.seq, w.joined_at = [], time.monotonic()
        w.prepared = max(w.prepared, msg["iteration"])
        w.applied = msg["iteration"]
        logger.info(
            "worker %d is a healthy replica of shard %d again (from iteration %d, in %.2f s)",
            w.id,
            self.state.shard_of(w),
            msg["iteration"],
            msg["seconds"],
        )
        self.cut.advance()
