"""How an attachment survives the shadow's failures without stopping training: degraded
mode (stop streaming), policy skip (never wait), and the resync and replica-join votes the
ranks take beside the last bucket of every iteration. The session re-attaches at the
boundary the ranks agreed on (:meth:`RecoveryController.boundary`): the vote taken in
iteration j is read (copied non-blocking when it was reduced) at the boundary after
iteration j + 1, when its copy has long landed, and every rank acts there."""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from shadow.core.errors import ShadowError
from shadow.wire import tags
from trainer_hooks.session.items import JoinItem, NoticeItem
from trainer_hooks.session.sender import Sender
from trainer_hooks.session.staging import StagingRing
from trainer_hooks.session.transfer import HostCopy

logger = logging.getLogger(__name__)


class ErrorLatch:
    """What went wrong, for the training thread: the first error the loop caused or asked
    for (raised at the next step), the shadow's own failures (counted, never raised) and
    the audit's findings. One per session; its condition also wakes waits for progress."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.shadow_errors = 0
        self.audit_failures: list[str] = []

    def set(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def raise_if_set(self, rank: int) -> None:
        if self.error is not None:
            err = self.error
            cls = type(err) if isinstance(err, ShadowError) else ShadowError
            raise cls(f"shadow checkpointing failed on rank {rank}: {err}") from err


class _Vote:
    """A vote all-reduced on its own (FSDP2): its future copies the result to the host
    once the collective is done (nothing waits for it then); read like a
    :class:`HostCopy`, an iteration later."""

    def __init__(self, fut: torch.futures.Future) -> None:
        self.fut = fut.then(lambda f: HostCopy(f.value()[0]))

    def get(self) -> torch.Tensor:
        return self.fut.wait().get()


class RecoveryController:
    """One attachment's view of the cluster (committed cut, degraded, asked resyncs and
    replica joins) and the votes on them. It is the sender's :class:`SenderEvents`."""

    def __init__(self, latch: ErrorLatch, rank: int, epoch: int, audit_strict: bool, join_wait_s: float) -> None:
        self.latch, self.rank, self.epoch, self.audit_strict = latch, rank, epoch, audit_strict
        self.join_wait_s = join_wait_s  # how long a rank waits for a join another rank has heard of
        self.sender: Sender | None = None  # bound once the attachment's sender exists
        self.ring: StagingRing | None = None  # bound with it; None again once the attachment releases it
        self.committed = -1  # newest iteration the cluster committed (as last heard)
        self.degraded: str | None = None  # why this attachment stopped streaming
        self.resync_requested = False  # the coordinator asked (this rank heard it)
        self.resync_at: int | None = None  # every rank agreed: resync after this iteration
        self.votes: list[tuple[int, HostCopy | _Vote]] = []  # (iteration, the reduced vote on its way to the host)
        self.joins: dict[int, dict] = {}  # generation -> replica_in message
        self.join_done = 0  # newest generation this rank streams to
        self.join_at: tuple[int, int] | None = None  # (after iteration, up to generation)

    def bind(self, sender: Sender, ring: StagingRing) -> None:
        self.sender, self.ring = sender, ring

    def _bound_sender(self) -> Sender:
        """The attachment's sender: bound before it starts, so before anything here needs it."""
        if self.sender is None:
            raise RuntimeError("the recovery controller is not bound to its sender yet")
        return self.sender

    # -- SenderEvents --------------------------------------------------------------------------------
    def on_error(self, exc: BaseException | str) -> None:
        """A failure of the shadow (an error from the coordinator, the sender thread, a
        stall past ``SHADOW_BLOCK_TIMEOUT_S``) never stops training: this rank stops
        streaming (degraded), tells the coordinator with every heartbeat until it asks for
        the resync, and counts it in ``stats()["shadow_errors"]``."""
        why = str(exc)
        with self.latch.cond:
            self.latch.shadow_errors += 1
        if isinstance(exc, BaseException) and not isinstance(exc, ShadowError):  # a defect, not a report
            logger.error("rank %d: unexpected failure in the shadow's hook or sender", self.rank, exc_info=exc)
        if self.degraded is None and self.sender is not None and self.sender.paused is None:
            self.sender.paused = why
        self.on_degraded(why)

    def on_progress(self, applied: int) -> None:
        with self.latch.cond:
            if applied > self.committed:
                self.committed = applied
                self.latch.cond.notify_all()

    def on_degraded(self, reason: str) -> None:
        with self.latch.cond:
            if self.degraded is None:
                logger.error(
                    "shadow cluster degraded, training continues without new checkpoints "
                    "(streaming stops until the next attach): %s",
                    reason,
                )
                self.degraded = reason
                if self.ring is not None:
                    self.ring.interrupt()  # a hook waiting for ring space (a dead worker's queue) stops waiting
            elif reason != self.degraded:
                logger.debug("shadow cluster also reports: %s", reason)
            self.latch.cond.notify_all()

    def on_audit(self, msg: dict) -> None:
        text = f"divergence audit failed at iteration {msg['iteration']}: {msg['detail']}"
        self.latch.audit_failures.append(text)
        logger.error("%s", text)
        if self.audit_strict:
            self.latch.set(ShadowError(text))

    def on_resync(self) -> None:
        logger.info("the shadow cluster is whole again; resyncing at the next iteration boundary")
        self.resync_requested = True

    def on_join(self, msg: dict) -> None:
        with self.latch.cond:
            self.joins[msg["gen"]] = msg
            self.latch.cond.notify_all()

    def on_lost(self, why: str) -> None:
        """The coordinator stopped answering: train on unprotected (a blocked step stops
        waiting). Once it answers again, every heartbeat tells it so (``paused``) until it
        asks for the resync, which it does when the cluster is whole (a restarted cluster
        without the job asks by itself)."""
        self._bound_sender().paused = why
        self.on_degraded(why)

    def on_refused(self, iteration: int, exc: BaseException) -> None:
        """The commit of ``iteration`` failed its check (the loop changed the gradients):
        the error is raised at the next step; nothing of that iteration was committed."""
        self.latch.set(exc)

    def on_back(self) -> None:
        if self._bound_sender().paused is not None:
            logger.warning(
                "rank %d hears the shadow coordinator again; the cluster resyncs once it is whole", self.rank
            )

    # -- policy skip -------------------------------------------------------------------------------------
    def fall_behind(self, k: int, why: str) -> None:
        """Policy skip: never wait for the shadow. Stop streaming (degraded), tell the
        coordinator, and let it ask for a resync once the workers answer again."""
        self.on_degraded(f"policy skip: {why}; training goes on without checkpoints until the cluster resyncs")
        self._bound_sender().q.put(
            NoticeItem("lagging", {"epoch": self.epoch, "rank": self.rank, "iteration": k, "applied": self.committed})
        )

    # -- votes -------------------------------------------------------------------------------------------
    def vote(self, fut: torch.futures.Future, device: torch.device, k: int, group) -> torch.futures.Future:
        """Alongside the last bucket of iteration ``k``, a two-integer MAX all-reduce: did
        any rank hear the coordinator ask for a resync, and of which replica joins? All
        ranks learn the same answer, read at the same boundary, so they act together.
        Nothing waits for the answer here: it is copied to the host non-blocking."""
        buf = torch.tensor([1 if self.resync_requested else 0, max(self.joins, default=0)], dtype=torch.int32)
        if buf.device != device:
            buf = buf.pin_memory().to(device, non_blocking=True)  # queued behind the bucket work: no wait
        vote = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True).get_future()

        def done(both):
            bucket_fut, vote_fut = both.value()
            self.votes.append((k, HostCopy(vote_fut.value()[0])))
            return bucket_fut.value()

        return torch.futures.collect_all([fut, vote]).then(done)

    def vote_now(self, device: torch.device, k: int, group) -> None:
        """The same vote for iteration ``k`` with nothing to ride along (FSDP2: taken when
        the gradients are final, before the step); every rank takes it at the same point."""
        buf = torch.tensor([1 if self.resync_requested else 0, max(self.joins, default=0)], dtype=torch.int32)
        if buf.device != device:
            buf = buf.pin_memory().to(device, non_blocking=True)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self.votes.append((k, _Vote(work.get_future())))

    def _read_votes(self, k: int) -> None:
        """Read the votes taken before iteration ``k`` (their copies landed an iteration ago)."""
        while self.votes and self.votes[0][0] < k:
            j, copy = self.votes.pop(0)
            resync, join = (int(v) for v in copy.get().numpy())
            if resync:
                self.resync_at = j + 1
            elif join > self.join_done:
                self.join_at = (j + 1, join)

    def boundary(self, k: int) -> str | int | None:
        """At the boundary after iteration ``k``: ``"resync"``, a replica generation to
        start streaming to, or None (from the votes of iteration ``k - 1`` and before)."""
        self._read_votes(k)
        if self.resync_at is not None and self.resync_at == k:
            return "resync"
        if self.join_at is not None and self.join_at[0] == k:
            return self.join_at[1]
        return None

    def start_joins(self, gen: int, next_iteration: int) -> None:
        """Every rank voted, beside the same last bucket, to stream to the replicas joining
        up to generation ``gen`` from ``next_iteration`` on; tell the coordinator so."""
        self.join_at = None
        with self.latch.cond:  # another rank may have heard of a join this one has not yet: it is in flight
            self.latch.cond.wait_for(lambda: max(self.joins, default=0) >= gen, self.join_wait_s)
        sender = self._bound_sender()
        for g in sorted(x for x in self.joins if self.join_done < x <= gen):
            msg = self.joins.pop(g)
            sender.q.put(JoinItem(msg["worker"], msg["data"], tags.for_key(msg.get("key")), msg.get("mode")))
            sender.q.put(
                NoticeItem(
                    "replica_from",
                    {
                        "epoch": self.epoch,
                        "rank": self.rank,
                        "worker": msg["worker"],
                        "gen": g,
                        "iteration": next_iteration,
                    },
                )
            )
            logger.info("rank %d streams to replica %d from iteration %d", self.rank, msg["worker"], next_iteration)
        self.join_done = max(self.join_done, gen)
