"""How a session survives the shadow's failures without stopping training: degraded mode
(stop streaming), policy skip (never wait), the resync and replica-join votes the ranks
take beside the last bucket of every iteration, and the re-attach at the agreed boundary."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from shadow import knobs
from shadow.errors import ShadowError
from trainer_hooks._sender import JoinItem, NoticeItem

logger = logging.getLogger(__name__)


class RecoveryMixin:
    """Session methods: degraded mode, skip, resync and replica joins."""

    def _on_resync(self) -> None:
        logger.info("the shadow cluster is whole again; resyncing at the next iteration boundary")
        self._resync_requested = True

    def _on_coordinator_lost(self, why: str) -> None:
        """The coordinator stopped answering: train on unprotected (a blocked step stops
        waiting). Once it answers again, every heartbeat tells it so (``paused``) until it
        asks for the resync, which it does when the cluster is whole (a restarted cluster
        without the job asks by itself)."""
        self.sender.paused = why
        self._on_degraded(why)

    def _on_coordinator_back(self) -> None:
        if self.sender.paused is not None:
            logger.warning("rank %d hears the shadow coordinator again; the cluster resyncs once it is whole",
                           self.rank)

    def _on_join(self, msg: dict) -> None:
        with self._cond:
            self._joins[msg["gen"]] = msg
            self._cond.notify_all()

    def _before_forward(self) -> None:
        self._emit_pending()
        if self._resync_at is not None and self._resync_at == self._next - 1:
            self._resync()
        elif self._join_at is not None and self._join_at[0] == self._next - 1:
            self._start_joins(self._join_at[1])

    def _start_joins(self, gen: int) -> None:
        """Every rank voted, beside the same last bucket, to stream to the replicas joining
        up to generation ``gen`` from this iteration on; tell the coordinator so."""
        self._join_at = None
        with self._cond:  # another rank may have heard of a join this one has not yet: it is in flight
            self._cond.wait_for(lambda: max(self._joins, default=0) >= gen, knobs.get("CONNECT_TIMEOUT_S"))
        for g in sorted(x for x in self._joins if self._join_done < x <= gen):
            msg = self._joins.pop(g)
            self.sender.q.put(JoinItem(msg["worker"], msg["data"]))
            self.sender.q.put(NoticeItem("replica_from", {"epoch": self.epoch, "rank": self.rank,
                                                          "worker": msg["worker"], "gen": g, "iteration": self._next}))
            logger.info("rank %d streams to replica %d from iteration %d", self.rank, msg["worker"], self._next)
        self._join_done = max(self._join_done, gen)

    def _resync(self) -> None:
        """Re-attach at this iteration boundary: a new epoch bootstrapped from this rank's
        current state (every rank does it at the same iteration: they voted on it)."""
        k = self._next - 1
        t0 = time.monotonic()
        self.close(wait=False)
        keep_registered = self._comm_registered
        self._carry = getattr(self, "_last_record", None)
        try:
            self.__init__(self.model, self.optimizer, self.coordinator, iteration=k, overwrite=True,
                          **self._init_args)
        except Exception as exc:  # the shadow must never stop training
            self._closed, self.degraded = True, f"resync at iteration {k} failed: {exc}"
            logger.error("rank %d: %s; training continues without the shadow (attach again to resume "
                         "checkpointing)", self.rank, self.degraded)
            return
        finally:
            self._comm_registered = keep_registered
        logger.info("rank %d resynced the shadow cluster at iteration %d in %.2f s (epoch %d)", self.rank, k,
                    time.monotonic() - t0, self.epoch)

    def _shadow_failed(self, exc: BaseException | str) -> None:
        """A failure of the shadow (an error from the coordinator, the sender thread, a
        stall past ``SHADOW_BLOCK_TIMEOUT_S``) never stops training: this rank stops
        streaming (degraded), tells the coordinator with every heartbeat until it asks for
        the resync, and counts it in ``stats()["shadow_errors"]``."""
        why = str(exc)
        self.shadow_errors += 1
        if isinstance(exc, BaseException) and not isinstance(exc, ShadowError):  # a defect, not a report
            logger.error("rank %d: unexpected failure in the shadow's hook or sender", self.rank, exc_info=exc)
        sender = getattr(self, "sender", None)
        if self.degraded is None and sender is not None and sender.paused is None:
            sender.paused = why
        self._on_degraded(why)

    def _fall_behind(self, k: int, why: str) -> None:
        """Policy skip: never wait for the shadow. Stop streaming (degraded), tell the
        coordinator, and let it ask for a resync once the workers answer again."""
        self._on_degraded(f"policy skip: {why}; training goes on without checkpoints until the cluster resyncs")
        self.sender.q.put(NoticeItem("lagging", {"epoch": self.epoch, "rank": self.rank, "iteration": k,
                                                 "applied": self._applied}))

    def _on_degraded(self, reason: str) -> None:
        with self._cond:
            if self.degraded is None:
                logger.error("shadow cluster degraded, training continues without new checkpoints "
                             "(streaming stops until the next attach): %s", reason)
                self.degraded = reason
                self.ring.interrupt()  # a hook waiting for ring space (a dead worker's queue) stops waiting
            elif reason != self.degraded:
                logger.debug("shadow cluster also reports: %s", reason)
            self._cond.notify_all()

    def _vote_resync(self, fut: torch.futures.Future, device: torch.device) -> torch.futures.Future:
        """Alongside the last bucket of every iteration, a one-integer MAX all-reduce: did
        any rank hear the coordinator ask for a resync? All ranks learn the same answer in
        the same iteration, so they re-attach together."""
        if self._vote.device != device:
            self._vote = self._vote.to(device)
        self._vote[0] = 1 if self._resync_requested else 0
        self._vote[1] = max(self._joins, default=0)
        vote = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.pg, async_op=True).get_future()
        k = self._next

        def done(both):
            bucket_fut, vote_fut = both.value()
            resync, join = (int(v) for v in vote_fut.value()[0].tolist())
            if resync:
                self._resync_at = k
            elif join > self._join_done:
                self._join_at = (k, join)
            return bucket_fut.value()

        return torch.futures.collect_all([fut, vote]).then(done)
