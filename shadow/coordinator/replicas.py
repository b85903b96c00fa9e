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

from shadow.coordinator._host import CoordinatorHost
from shadow.coordinator.records import JobRec, WorkerRec

logger = logging.getLogger(__name__)


class ReplicaMixin(CoordinatorHost):
    """Coordinator methods for replicated shards (see the module docstring)."""

    def shard_of(self, w: WorkerRec) -> int:
        return w.id % self.nshards

    def healthy(self, w: WorkerRec, now: float | None = None) -> bool:
        job = self.job
        now = time.monotonic() if now is None else now
        return (
            w.alive(now)
            and not w.stale
            and not w.transit
            and not w.out
            and job is not None
            and w.configured == job.epoch
        )

    def serving(self) -> list[WorkerRec] | None:
        """One healthy replica per shard (lowest id first), or None if a shard has none."""
        now, out = time.monotonic(), {}
        for w in self.workers:
            if self.shard_of(w) not in out and self.healthy(w, now):
                out[self.shard_of(w)] = w
        return [out[s] for s in range(self.nshards)] if len(out) == self.nshards else None

    def _replica_down(self, w: WorkerRec, reason: str) -> None:
        """Take ``w`` out of service if every shard keeps a healthy replica; else degrade."""
        job = self.job
        if job is None or job.status not in ("running",) or self.replicas == 1 or w.out:
            if not w.out:
                self._degrade(reason)
            return
        w.out = True
        if self.serving() is None:
            w.out = False
            self._degrade(reason)
            return
        self._cancel_join(w)
        logger.error(
            "worker %d out of service (%s); shard %d continues on its other replica", w.id, reason, self.shard_of(w)
        )
        for ident in job.trainers.values():
            self._reply([ident], "replica_out", epoch=job.epoch, worker=w.id)
        self._advance_cut()
        if w.alive(time.monotonic()) and w.stale:  # a damaged but live replica: fresh socket, then a rejoin
            self._reply([w.ident], "reset", reason=reason)

    def _start_join(self, w: WorkerRec) -> bool:
        """A fresh process holds slot ``w``: bring it in from its peer. False if it cannot."""
        job = self.job
        if job is None or self.replicas == 1 or job.status != "running":
            return False
        w.out = True
        if self.serving() is None:
            return False
        job.gen += 1
        job.joining[w.id] = {"gen": job.gen, "from": {}, "at": None}
        for ident in job.trainers.values():  # whatever is queued for the old process is dropped
            self._reply([ident], "replica_out", epoch=job.epoch, worker=w.id)
        logger.warning(
            "worker %d joins shard %d (generation %d): the ranks pick the iteration, its peer sends the state",
            w.id,
            self.shard_of(w),
            job.gen,
        )
        for ident in job.trainers.values():
            self._reply([ident], "replica_in", epoch=job.epoch, worker=w.id, data=w.data, gen=job.gen)
        self._advance_cut()  # the cut no longer waits for the old process in this slot
        return True

    def _cancel_join(self, w: WorkerRec) -> None:
        job = self.job
        if job is not None and job.joining.pop(w.id, None) is not None:
            self._release_cut_ceiling(job)

    def _release_cut_ceiling(self, job: JobRec) -> None:
        """Hold ``job``'s cut at the earliest iteration a joining replica copies, if any."""
        holds = [j["at"] for j in job.joining.values() if j["at"] is not None]
        job.cut_ceiling = min(holds) if holds else None

    def _on_replica_from(self, env, msg) -> None:
        """Rank ``msg.rank`` streams to the joining worker from iteration ``msg.iteration``."""
        job = self.job
        if job is None or msg["epoch"] != job.epoch:
            return
        j = job.joining.get(msg["worker"])
        if j is None or j["gen"] != msg["gen"] or j["at"] is not None:
            return
        j["from"][msg["rank"]] = msg["iteration"]
        if len(j["from"]) < job.world:
            return
        starts = set(j["from"].values())
        m = max(starts)
        w = self.workers[msg["worker"]] if msg["worker"] < len(self.workers) else None
        peers = [
            p
            for p in self.workers
            if p is not w and self.shard_of(p) == msg["worker"] % self.nshards and self.healthy(p)
        ]
        if len(starts) != 1 or job.cut > m - 1 or not peers or w is None:
            job.joining.pop(msg["worker"], None)
            self._degrade(
                f"worker {msg['worker']} could not join from its peer (ranks start at {sorted(starts)}, "
                f"cut {job.cut}, healthy peers {[p.id for p in peers]})"
            )
            return
        j["at"] = m - 1
        self._release_cut_ceiling(job)
        peer = peers[0]
        lo, hi = job.ranges[w.id]
        self._reply(
            [w.ident],
            "configure",
            epoch=job.epoch,
            job=job.name,
            job_id=job.job_id,
            layout=job.layout,
            start=lo,
            stop=hi,
            world=job.world,
            optim=job.optim,
            iteration=m - 1,
            persist={**self.persist.config, "generation": job.generation},
            shard=self.shard_of(w),
            shards=self.nshards,
            peer={"id": peer.id, "serve": peer.serve},
        )
        logger.info("worker %d: copying iteration %d from worker %d; ranks stream from %d", w.id, m - 1, peer.id, m)

    def _on_copied(self, env, msg) -> None:
        w, job = self._worker(env), self.job
        if w is None or job is None or msg["epoch"] != job.epoch or w.id not in job.joining:
            return
        job.joining.pop(w.id)
        self._release_cut_ceiling(job)
        w.out, w.stale, w.transit, w.configured = False, "", "", job.epoch
        w.seq, w.joined_at = [], time.monotonic()
        w.prepared = max(w.prepared, msg["iteration"])
        w.applied = msg["iteration"]
        logger.info(
            "worker %d is a healthy replica of shard %d again (from iteration %d, in %.2f s)",
            w.id,
            self.shard_of(w),
            msg["iteration"],
            msg["seconds"],
        )
        self._advance_cut()
