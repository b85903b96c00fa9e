"""One epoch of a session: the running pipeline from DDP's reduced buckets to the sender.

An :class:`Attachment` is made for one :class:`~trainer_hooks.session.target.Target` (the
model and optimizer as laid out) and one :class:`~trainer_hooks.session.handshake.Handshake`
(the coordinator's answer), both frozen; it owns what runs: the recovery state, the
staging ring and the sender thread (:mod:`trainer_hooks.session.parts`, the sender made by
the sender factory it is given), the :class:`~trainer_hooks.session.stager.GradStager` that
stages the gradients, and the session's :class:`StepRecorder`, which it drives and whose
commits it queues. ``open`` makes all of them and closes whatever it made if a later part
fails; ``close`` releases them (the ring too: a closed session holds no staging memory).

Per step, everything flows one way: the hook slot, the session's step and forward hooks
and the scheduler/scaler observers call the attachment, the attachment asks the recorder
and acts on what it returns (the waits for the cluster's cut are in
:mod:`trainer_hooks.session.throttle`); the recorder calls nothing."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from trainer_hooks.restorer.points import RestorePoint
from trainer_hooks.session import audit, bootstrap, checks, handshake, parts, throttle
from trainer_hooks.session import commit as commit_parts
from trainer_hooks.session.extras import ExtrasTracker
from trainer_hooks.session.handshake import Handshake
from trainer_hooks.session.items import CommitItem
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import Commit, Stale, StepRecorder
from trainer_hooks.session.recovery import ErrorLatch, RecoveryController
from trainer_hooks.session.sender import Sender, SenderFactory
from trainer_hooks.session.stager import GradStager
from trainer_hooks.session.staging import StagingRing
from trainer_hooks.session.target import Target

logger = logging.getLogger(__name__)


def _ring_figures(ring: StagingRing) -> dict[str, float]:
    return {"blocked_s": ring.blocked_s, "occupancy": ring.occupancy, "high_water": ring.high_water / ring.capacity}


@dataclass
class Figures:
    """What an attachment counts beside its stager's hook figures (kept after ``close``)."""

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
        recovery state, staging ring, a sender made by ``sender_factory`` (called as
        :class:`Sender` is), not started yet (:meth:`open` starts it), and the stager."""
        self.target, self.handshake, self.options, self.latch = target, answer, options, latch
        self.recorder = recorder  # the session's: handed from one attachment to the next
        self.dealer = dealer  # to the coordinator: the sender's while it runs
        self.recovery = RecoveryController(
            latch, target.rank, answer.epoch, options.audit_strict, options.tuning.connect_timeout_s
        )
        self.ring: StagingRing | None = parts.new_ring(target, options.tuning)  # None once released
        self.sender: Sender = parts.new_sender(
            sender_factory, dealer, self.ring, target, answer, self.recovery, options.tuning
        )
        self.recovery.bind(self.sender, self.ring)
        self.stager = GradStager(
            target, answer.shards, options, latch, recorder, self.recovery, self.ring, self.sender.q
        )
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
        wait_s: float | None = None,
    ) -> Attachment:
        """Handshake (bounded by ``SHADOW_CONNECT_TIMEOUT_S``), ring, sender, bootstrap of
        iteration ``iteration`` (``carry``: the ``(rng, extra)`` recorded with it when
        re-attaching mid-run); then ``recorder`` starts counting from there. If any part
        fails, what was opened is closed. ``vote_group``: the process group an FSDP2
        model's votes are all-reduced in (DDP's ride along its last bucket, in its group).
        ``owner``: the epoch a re-attach leaves and this rank's token of it (see
        :func:`~trainer_hooks.session.handshake.attach`; ``wait_s``: its bound on the
        handshake, as there)."""
        target = Target.of(model, optimizer, options.exact)
        dealer, answer = handshake.attach(target, coordinator, options, iteration, overwrite, restored, owner, wait_s)
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
        """``fut`` reduces ``bucket``: the stager votes beside the last bucket and stages it
        once reduced (:meth:`GradStager.on_bucket`); nothing once closed."""
        return fut if self.closed else self.stager.on_bucket(fut, bucket)

    def fence(self) -> None:
        """The current stream waits (on the device) for every bucket copy queued so far:
        before anything may write to DDP's bucket buffers again."""
        self.stager.fence()

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
        what was staged); FSDP2: staged (:meth:`GradStager.stage_shards`)."""
        if self.target.fsdp is not None:
            if not self.closed:
                self.stager.stage_shards(self.vote_group)
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
        self.counts.blocked_s += throttle.throttle(k, self.recovery, self.latch, self.handshake, self.options)
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

    # -- the end -------------------------------------------------------------------------------------
    def close(self, wait: bool = True, join_s: float = 10.0) -> None:
        """With ``wait``: flush, then wait (``SHADOW_CLOSE_TIMEOUT_S``) for the cluster to
        commit the last iteration queued. Then stop the sender (it has ``join_s`` to end; one
        that has not keeps the ring), detach, release the ring."""
        if self.closed:
            return
        sender, latch = self.sender, self.latch
        if wait and sender.ident is not None and latch.error is None:
            throttle.drain(sender, self.recovery, latch, self.last_emitted, self.options.tuning.close_timeout_s)
        self.closed = True
        if sender.ident is not None:
            sender.stop()
            sender.join(timeout=join_s)
        handshake.detach(self.dealer, self.handshake, self.target.rank)
        self._release_ring()

    def _release_ring(self) -> None:
        ring = self.ring
        if ring is None or self.sender.is_alive():
            return  # a sender that did not stop may still read it
        self.counts.ring = _ring_figures(ring)
        self.ring = self.recovery.ring = self.sender.ring = self.stager.ring = None

    def figures(self) -> dict[str, Any]:
        """What this attachment counted: hook time and buckets, waits, ring figures (kept
        once the ring is released), bytes and messages sent."""
        out = dict(self.counts.ring if self.ring is None else _ring_figures(self.ring))
        out["blocked_s"] += self.counts.blocked_s
        out.update(
            hook_s=self.stager.hook_s,
            buckets=self.stager.buckets,
            bytes_out=self.sender.bytes_out,
            messages_out=self.sender.messages_out,
        )
        return out
