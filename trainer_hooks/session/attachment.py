"""One epoch of a session: the running pipeline from DDP's reduced buckets to the sender.

An :class:`Attachment` is made for one :class:`~trainer_hooks.session.target.Target` (the
model and optimizer as laid out) and one :class:`~trainer_hooks.session.handshake.Handshake`
(the coordinator's answer), both frozen; it owns what runs: the recovery state, the
staging ring, the copy stream, the bucket plans, the sender thread (made by the sender
factory it is given) and the session's :class:`StepRecorder`, which it drives and whose
commits it queues. ``open`` makes all of them and closes whatever it made if a later part
fails; ``close`` releases them (the ring too: a closed session holds no staging memory).

Per step, everything flows one way: the hook slot, the session's step and forward hooks
and the scheduler/scaler observers call the attachment, the attachment asks the recorder
and acts on what it returns; the recorder calls nothing."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from shadow.config.choices import Policy
from shadow.core.errors import ShadowUsageError
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.capture.extras import ExtrasTracker
from trainer_hooks.restorer.points import RestorePoint
from trainer_hooks.session import audit, bootstrap, buckets, checks, device, handshake
from trainer_hooks.session import commit as commit_parts
from trainer_hooks.session.handshake import Handshake
from trainer_hooks.session.items import CommitItem, FlushItem, GradItem
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import Commit, Stale, StepRecorder
from trainer_hooks.session.recovery import ErrorLatch, RecoveryController
from trainer_hooks.session.sender import Sender, SenderFactory
from trainer_hooks.session.staging import RingFullError, RingInterrupted, StagingRing
from trainer_hooks.session.target import Target
from trainer_hooks.session.transfer import CopyStream

logger = logging.getLogger(__name__)


def _ring_figures(ring: StagingRing) -> dict[str, float]:
    return {"blocked_s": ring.blocked_s, "occupancy": ring.occupancy, "high_water": ring.high_water / ring.capacity}


@dataclass
class Figures:
    """What an attachment counts (kept after ``close``)."""

    hook_s: float = 0.0  # time the hook spent staging, on the thread that runs DDP's callbacks
    buckets: int = 0  # buckets the hook staged (or tried to)
    blocked_s: float = 0.0  # waits for the cluster's cut (policy block)
    ring: dict[str, float] = field(default_factory=lambda: {"blocked_s": 0.0, "occupancy": 0.0, "high_water": 0.0})


class Attachment:
    """The running pipeline of one epoch. Built by :meth:`open`, ended by :meth:`close`."""

    def __init__(
        self,
        target: Target,
        answer: Handshake,
        options: AttachOptions,
        latch: ErrorLatch,
        recorder: StepRecorder,
        dealer: zmq.Socket,
        *,
        sender_factory: SenderFactory = Sender,
    ) -> None:
        """The pipeline for ``answer`` over the connection ``dealer`` (given to the sender):
        recovery state, staging ring and a sender made by ``sender_factory`` (called as
        :class:`Sender` is), not started yet (:meth:`open` starts it)."""
        self.target, self.handshake, self.options, self.latch = target, answer, options, latch
        self.recorder = recorder  # the session's: handed from one attachment to the next
        self.dealer = dealer  # to the coordinator: the sender's while it runs
        self.recovery = RecoveryController(
            latch, target.rank, answer.epoch, options.audit_strict, options.tuning.connect_timeout_s
        )
        nbuckets_slack = 16 * 256
        shards = target.fsdp
        per_step = target.layout.total // target.world if shards is None else -(-shards.total // shards.replicas)
        cap = options.tuning.ring_iterations * (per_step + nbuckets_slack)
        self.ring: StagingRing | None = StagingRing(cap, pin=target.device.type == "cuda")  # None once released
        self.sender: Sender = sender_factory(
            zmq.Context.instance(),
            dealer,
            answer.endpoints,
            self.ring,
            job_id=answer.job_id,
            epoch=answer.epoch,
            rank=target.rank,
            world=target.world,
            layout_hash=target.layout.hash,
            events=self.recovery,
            tuning=options.tuning,
            tags=list(answer.data_tags),
            curve=answer.curve,
            token=answer.token,
        )
        self.recovery.bind(self.sender, self.ring)
        self.copier = CopyStream(target.device)  # bucket copies to the ring, off the autograd thread's way
        self.planner = buckets.Planner(target.layout, target.index, target.rank, target.world, answer.shards)
        self._shard_runs: dict[tuple, list] = {}  # FSDP2: runs per set of parameters with a gradient
        self.vote_group: Any = None  # FSDP2: the group the votes are all-reduced in (the session's)
        self.extras: ExtrasTracker | None = None
        self.last_emitted = answer.base
        self.closed = False
        self.counts = Figures()

    @classmethod
    def open(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        coordinator: str,
        options: AttachOptions,
        latch: ErrorLatch,
        recorder: StepRecorder,
        *,
        iteration: int,
        overwrite: bool = False,
        restored: RestorePoint | None = None,
        carry: tuple | None = None,
        sender_factory: SenderFactory = Sender,
        vote_group: Any = None,
        owner: tuple[int, bytes] | None = None,
    ) -> Attachment:
        """Handshake (bounded by ``SHADOW_CONNECT_TIMEOUT_S``), ring, sender, bootstrap of
        iteration ``iteration`` (``carry``: the ``(rng, extra)`` recorded with it when
        re-attaching mid-run); then ``recorder`` starts counting from there. If any part
        fails, what was opened is closed. ``vote_group``: the process group an FSDP2
        model's votes are all-reduced in (DDP's ride along its last bucket, in its group).
        ``owner``: the epoch a re-attach leaves and this rank's token of it (see
        :func:`~trainer_hooks.session.handshake.attach`)."""
        target = Target.of(model, optimizer, options.exact)
        dealer, answer = handshake.attach(target, coordinator, options, iteration, overwrite, restored, owner)
        try:
            att = cls(target, answer, options, latch, recorder, dealer, sender_factory=sender_factory)
            att.vote_group = vote_group
        except BaseException:
            handshake.detach(dealer, answer, target.rank)
            raise
        try:
            att.sender.start()
            bootstrap.bootstrap(att, carry)
        except BaseException:
            att.close(wait=False)
            raise
        recorder.start(iteration, len(answer.shards))
        return att

    # -- step 1: the comm hook (the hook slot routes every bucket here) ----------------------------
    def on_bucket(self, fut: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """``fut`` reduces ``bucket``: vote beside the last bucket, stage once reduced."""
        if self.closed:
            return fut
        if device.capturing():  # never raise inside DDP: the next step raises it
            self.latch.set(ShadowUsageError(device.CAPTURE_ERROR))
            return fut
        if bucket.is_last():
            fut = self.recovery.vote(fut, bucket.buffer().device, self.recorder.next, self.target.pg)
        return fut.then(functools.partial(self._after_reduce, bucket))

    def _after_reduce(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        if self.latch.error is None and self.recovery.degraded is None:
            t0 = time.perf_counter()
            try:
                self.stage(bucket, reduced)
                if self.target.views:  # the gradients are the bucket: DDP's finish waits (on the device) for the copy
                    self.fence()
            except ShadowUsageError as exc:  # never raise into DDP: the next step raises it
                self.latch.set(exc)
            except Exception as exc:  # noqa: BLE001 - the shadow's own failure must not stop training
                self.recovery.on_error(exc)
            self.counts.hook_s += time.perf_counter() - t0
            self.counts.buckets += 1
        return reduced

    def stage(self, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        """Copy this rank's stripe of a reduced bucket into the ring and queue it. The
        copy is queued on the copy stream (after the all-reduce) and never waited for
        here: the sender waits for its event. The recorder's lock is taken once, for the
        bookkeeping (which iteration, the bucket's plan, what it stages); the wait for ring
        space (policy block) and the copy run outside it."""
        rec = self.recorder
        with rec.lock:
            k = rec.bucket(bucket.index())
            plan = self.planner.plan(bucket, reduced)
            lo, hi = plan.stripe
            if hi <= lo or not any(plan.counts):
                return
            probes = plan.pick(k)
            rec.staged(plan.counts, [(pidx, elem) for _, pidx, elem in probes])
        off = self._ring_slot(k, hi - lo)
        if off is None:
            return
        ring = self.ring
        assert ring is not None  # _ring_slot had one
        ready = self.copier.copy(ring.tensor[off : off + hi - lo], reduced[lo:hi])
        self.sender.q.put(GradItem(k, off, hi - lo, plan.runs, ready, probes))

    def fence(self) -> None:
        """The current stream waits (on the device) for every bucket copy queued so far:
        before anything may write to DDP's bucket buffers again."""
        self.copier.fence()

    def stage_shards(self) -> None:
        """FSDP2/HSDP: the gradients are final (the step is about to read them: clipped,
        unscaled and summed over micro-batches as the loop and FSDP left them). Vote
        (:meth:`RecoveryController.vote_now`), then copy this rank's stripe of its rows into
        the ring and queue it, as :meth:`stage` does a bucket's."""
        t, rec = self.target, self.recorder
        shards = t.fsdp
        assert shards is not None
        if self.closed:
            return
        # every rank votes at every step, degraded or not: how a degraded session learns to resync
        self.recovery.vote_now(t.device, rec.next, self.vote_group)
        if self.latch.error is not None or self.recovery.degraded is not None:
            return
        t0 = time.perf_counter()
        try:
            grads = [p.grad for p in t.params]
            present = tuple(g is not None for g in grads)
            runs = self._shard_runs.get(present)
            if runs is None:
                runs = self._shard_runs[present] = shards.runs(present, self.handshake.shards)
            with rec.lock:
                k = rec.bucket(0)
                counts = [sum(n for _, _, n in rs) for rs in runs]
                rec.staged(counts, [])
            lo, hi = shards.stripe()
            if hi <= lo or not any(counts):
                return
            off = self._ring_slot(k, hi - lo)
            if off is None:
                return
            ring = self.ring
            assert ring is not None  # _ring_slot had one
            pairs = []
            for i, src, dst, n in shards.pieces(lo, hi):
                g = grads[i]
                if g is not None:
                    flat = _fsdp.local(g).detach().reshape(-1)
                    pairs.append((ring.tensor[off + dst : off + dst + n], flat[src : src + n]))
            ready = self.copier.copy_all(pairs)
            self.sender.q.put(GradItem(k, off, hi - lo, runs, ready, []))
        except ShadowUsageError as exc:
            self.latch.set(exc)
        except Exception as exc:  # noqa: BLE001 - the shadow's own failure must not stop training
            self.recovery.on_error(exc)
        finally:
            self.counts.hook_s += time.perf_counter() - t0
            self.counts.buckets += 1

    def _ring_slot(self, k: int, n: int) -> int | None:
        """Ring space for ``n`` elements of iteration ``k`` (policy block: waits for it,
        bounded); None when there is none and the session stopped streaming or fell behind."""
        ring = self.ring
        if ring is None:
            raise RuntimeError("gradients reached an attachment that is not running (its ring is released)")
        block = self.options.policy is Policy.block
        try:
            return ring.alloc(n, self.options.tuning.block_timeout_s if block else 0.0)
        except RingInterrupted:
            return None  # degraded while waiting: nothing more is streamed until a resync
        except RingFullError as exc:
            if block:
                self.recovery.on_error(f"{exc} (SHADOW_BLOCK_TIMEOUT_S)")
            else:
                self.recovery.fall_behind(k, "the staging ring is full (the sender cannot keep up)")
            return None

    # -- step 2: what the loop does to the gradients, and the step ---------------------------------------
    def clipped(self, scaled: set[int], coef: torch.Tensor) -> None:
        """torch clipped the gradients of the parameters ``scaled`` (ids) by ``coef``
        (FSDP2: nothing to record, the gradients are staged as the step reads them)."""
        if self.target.fsdp is None:
            self.recorder.clipped_params(scaled, coef, self.target.params)

    def before_step(self) -> None:
        """The step begins: the previous commit leaves if it has not yet, and the optimizer
        must still hold the laid-out parameters."""
        self.recorder.window_closed()
        self.flush()
        checks.check_layout(self.target.optimizer, self.target.layout, self.target.params)

    def read_probes(self) -> None:
        """The gradients as the step will use them, probed (compared by the sender with
        what was staged); FSDP2: staged (:meth:`stage_shards`)."""
        if self.target.fsdp is not None:
            self.stage_shards()
        else:
            self.recorder.read_probes(self.target.params)

    def after_step(self, skip: bool, grad_scale: Any = None, found_inf: Any = None) -> None:
        """Iteration k is done (``skip``: GradScaler skipped the optimizer): record its
        commit (sent once the scheduler and scaler have stepped), then wait while this rank
        is too far ahead of the cluster (policy block); raise what the latch holds."""
        rec, rank, every = self.recorder, self.target.rank, self.options.audit_every
        if self.target.fsdp is not None:
            # FSDP2: the gradients were staged at the step; nothing after it (zero_grad without
            # set_to_none, the next backward) may write them before the copies ran (on the device)
            self.fence()
        k, sent = rec.advance()
        audits = every and self.target.fsdp is None  # FSDP2: rank 0 holds its own rows only
        sampled = self.audit(k) if audits and k % every == 0 and not skip and rank == 0 else None
        rec.record(k, sent, skip, grad_scale, found_inf, self.target.params, rank, sampled)
        self._emit(rec.take_ready())
        self.throttle(k)
        self.latch.raise_if_set(rank)

    # -- the scheduler and scaler (trainer_hooks.session.observe reports here) ----------------------------
    @property
    def next(self) -> int:
        """The iteration in progress."""
        return self.recorder.next

    def unscaled(self, inv_scale: Any) -> None:
        if self.target.fsdp is None:  # FSDP2: the gradients are staged unscaled
            self.recorder.unscaled(inv_scale)

    def skipped_step(self) -> None:
        """The scaler stepped and the optimizer did not (inf/nan gradients): iteration k
        happened (its gradients were reduced and sent) but changes nothing."""
        self.after_step(True)

    def stepped(self, what: str) -> None:
        """The scheduler or scaler stepped: the pending commit leaves once all have."""
        stale = self.recorder.stepped(what)
        if stale is not None:
            self._stale_schedule(stale)
        self._emit(self.recorder.take_ready())

    def release(self, what: str, extra: Any = None) -> None:
        """The hold ``what`` is over (with ``extra``: the extra state the commit carries)."""
        self.recorder.release(what, extra)
        self._emit(self.recorder.take_ready())

    def _stale_schedule(self, stale: Stale) -> None:
        """The scheduler stepped more often than learnt after commit ``k`` left: until the
        commit of ``k + 1`` lands, a restore of ``k`` gets the scheduler one step behind."""
        self.latch.shadow_errors += 1
        logger.error(
            "rank %d: %s; a restore of iteration %d until iteration %d is committed gets that scheduler state "
            "(step the scheduler the same number of times per optimizer step)",
            self.target.rank,
            stale.why,
            stale.iteration,
            stale.iteration + 1,
        )

    # -- step 3: the next forward --------------------------------------------------------------------------
    def before_forward(self) -> bool:
        """The next forward begins: the previous commit leaves, the bucket copies are
        fenced, and the votes are read. True: every rank resyncs at this boundary (the
        session re-attaches); replica joins are started here."""
        self.recorder.window_closed()
        self.flush()
        if self.closed:
            return False
        self.fence()
        k = self.recorder.next - 1
        action = self.recovery.boundary(k)
        if action == "resync":
            return True
        if isinstance(action, int):  # a replica generation
            self.recovery.start_joins(action, self.recorder.next)
        return False

    # -- commits ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Queue the recorded commit, if any, whatever it still waits for."""
        self._emit(self.recorder.take_pending())

    def _emit(self, commit: Commit | None) -> None:
        """Queue ``commit`` (dropped while degraded or once closed: nothing is streamed)."""
        if commit is None or self.closed or self.recovery.degraded is not None:
            return
        self.queue_commit(commit)

    def queue_commit(self, commit: Commit) -> None:
        """Queue the commit of ``commit.iteration``: rank 0's state and the model state
        outside the optimizer that changed are copied now (non-blocking); the sender
        builds the frames per worker (the blob only to the replicas of this rank's shard),
        after the EXTRA chunks (:mod:`trainer_hooks.session.commit`)."""
        state, extras = commit_parts.capture(self, commit)
        self.sender.q.put(
            CommitItem(commit.iteration, None, functools.partial(commit_parts.build, self, commit, state, extras))
        )
        self.last_emitted = commit.iteration

    def capture_extras(self, everything: bool):
        """Rank 0: copy the model state outside the optimizer that changed (all of it at
        a bootstrap, which starts a new epoch); sent with the commit."""
        if everything or self.extras is None:
            t = self.target
            self.extras = ExtrasTracker(t.model, t.params, list(self.handshake.workers), self.options.tuning)
        return self.extras.capture(everything=everything)

    def audit(self, k: int) -> tuple:
        """``(plan, gathered values)`` of the divergence audit after step ``k``."""
        t = self.target
        return audit.sample(t.layout, t.params, t.optimizer, t.optim_desc, list(self.handshake.shards), k)

    def throttle(self, k: int) -> None:
        """Policy block: wait while this rank is more than ``SHADOW_MAX_LAG`` iterations
        ahead of the cluster (bounded); policy skip: fall behind instead of waiting."""
        lag = self.options.tuning.max_lag_iterations
        floor = self.handshake.base - 1  # the bootstrap (iteration base) is in flight like any iteration
        rec, latch = self.recovery, self.latch
        if k - max(rec.committed, floor) <= lag or rec.degraded is not None:
            return
        if self.options.policy is Policy.skip:
            rec.fall_behind(
                k,
                f"iteration {k} is {k - max(rec.committed, floor)} ahead of the cluster's cut "
                f"{rec.committed} (SHADOW_MAX_LAG={lag})",
            )
            return
        t0 = time.monotonic()
        limit = self.options.tuning.block_timeout_s
        with latch.cond:
            ok = latch.cond.wait_for(
                lambda: k - max(rec.committed, floor) <= lag or latch.error is not None or rec.degraded is not None,
                limit,
            )
        self.counts.blocked_s += time.monotonic() - t0
        if not ok:
            rec.on_error(
                f"the shadow cluster has not committed iteration {k - lag} within {limit:.0f} s "
                f"(SHADOW_BLOCK_TIMEOUT_S; last committed: {rec.committed}); check "
                f"`shadow status address={self.handshake.coordinator}`"
            )

    # -- the end -------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """With ``wait``: flush, then wait (``SHADOW_CLOSE_TIMEOUT_S``) for the cluster to
        commit the last iteration queued. Then stop the sender, detach, release the ring."""
        if self.closed:
            return
        rec, sender, latch = self.recovery, self.sender, self.latch
        if wait and sender.ident is not None and latch.error is None:
            done = threading.Event()
            sender.q.put(FlushItem(done))
            done.wait(self.options.tuning.close_timeout_s)
            with latch.cond:
                latch.cond.wait_for(
                    lambda: rec.committed >= self.last_emitted or rec.degraded is not None or latch.error is not None,
                    self.options.tuning.close_timeout_s,
                )
            if rec.committed < self.last_emitted:
                logger.warning(
                    "closing with iteration %d not yet committed (cluster at %d)", self.last_emitted, rec.committed
                )
        self.closed = True
        if sender.ident is not None:
            sender.stop()
            sender.join(timeout=10)
        handshake.detach(self.dealer, self.handshake, self.target.rank)
        self._release_ring()

    def _release_ring(self) -> None:
        ring = self.ring
        if ring is None or self.sender.is_alive():
            return  # a sender that did not stop may still read it
        self.counts.ring = _ring_figures(ring)
        self.ring = self.recovery.ring = self.sender.ring = None

    def figures(self) -> dict[str, Any]:
        """What this attachment counted: hook time and buckets, waits, ring figures (kept
        once the ring is released), bytes and messages sent."""
        out = dict(self.counts.ring if self.ring is None else _ring_figures(self.ring))
        out["blocked_s"] += self.counts.blocked_s
        out.update(
            hook_s=self.counts.hook_s,
            buckets=self.counts.buckets,
            bytes_out=self.sender.bytes_out,
            messages_out=self.sender.messages_out,
        )
        return out
