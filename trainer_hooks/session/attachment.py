"""One epoch of a session: the handshake's answer (epoch, workers, shards), the layout it
was made for, the staging ring, the sender thread and the recovery state. ``open`` makes
all of them and closes whatever it made if a later part fails; ``close`` releases them
(the ring too: a closed session holds no staging memory)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq
from torch.nn.parallel import DistributedDataParallel

from shadow import sqrttab
from shadow.choices import Policy
from shadow.client import LogWaiting, dealer, request
from shadow.errors import ShadowError
from shadow.layout import bucket_runs, stripe_bounds
from shadow.wire import messages as M
from shadow.wire import tags
from trainer_hooks import _optim
from trainer_hooks._extras import ExtrasTracker
from trainer_hooks._model import build_layout, state_dict_aliases
from trainer_hooks._restored import RestorePoint
from trainer_hooks.session import audit, bootstrap, buckets, device
from trainer_hooks.session import commit as commit_parts
from trainer_hooks.session.items import CommitItem, FlushItem, GradItem
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import Commit, StepRecorder
from trainer_hooks.session.recovery import ErrorLatch, RecoveryController
from trainer_hooks.session.sender import Sender
from trainer_hooks.session.staging import RingFullError, RingInterrupted, StagingRing
from trainer_hooks.session.transfer import CopyStream

logger = logging.getLogger(__name__)


class Attachment:
    """What one attach made. Built by :meth:`open`, ended by :meth:`close`."""

    #: the sender thread's class; ``trainer_hooks.testing`` swaps in a fault-injecting one
    sender_class: type[Sender] = Sender

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        coordinator: str,
        options: AttachOptions,
        base: int,
    ) -> None:
        """The layout and descriptors; no sockets yet (see :meth:`open`)."""
        self.model, self.optimizer, self.coordinator, self.options = model, optimizer, coordinator, options
        self.pg = model.process_group
        self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        self.layout, self.params = build_layout(model, optimizer)
        self.device = device.device_of(self.layout, self.params)
        self.copier = CopyStream(self.device)  # bucket copies to the ring, off the autograd thread's way
        self.optim_desc = _optim.describe(optimizer, exact=options.exact)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.aliases = state_dict_aliases(model)
        self.base = base
        self.plans: dict[tuple, buckets.BucketPlan] = {}
        self.extras: ExtrasTracker | None = None
        self.last_emitted = base
        self.hook_s = 0.0  # time the hook spent staging, on the thread that runs DDP's callbacks
        self.buckets = 0  # buckets the hook staged (or tried to)
        self.blocked_s = 0.0
        self.closed = False
        self.dealer: zmq.Socket | None = None  # to the coordinator: the handshake's, then the sender's
        self.ring: StagingRing | None = None  # None again once released (close)
        self.sender: Sender | None = None
        self._recovery: RecoveryController | None = None
        self.ring_figures = {"blocked_s": 0.0, "occupancy": 0.0, "high_water": 0.0}

    @classmethod
    def open(
        cls,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        coordinator: str,
        options: AttachOptions,
        latch: ErrorLatch,
        *,
        iteration: int,
        overwrite: bool = False,
        restored: RestorePoint | None = None,
        carry: tuple | None = None,
    ) -> Attachment:
        """Handshake (bounded by ``SHADOW_CONNECT_TIMEOUT_S``), ring, sender, bootstrap of
        iteration ``iteration`` (``carry``: the ``(rng, extra)`` recorded with it when
        re-attaching mid-run). If any part fails, what was opened is closed."""
        att = cls(model, optimizer, coordinator, options, iteration)
        att._handshake(overwrite, restored)
        try:
            att._start(latch)
            bootstrap.bootstrap(att, carry)
        except BaseException:
            att.close(wait=False)
            raise
        return att

    def _handshake(self, overwrite: bool, restored: RestorePoint | None) -> None:
        self.ctx: zmq.Context = zmq.Context.instance()
        self.dealer = dealer(self.ctx, self.coordinator)
        payload = M.encode(
            "attach",
            job=self.options.job,
            rank=self.rank,
            world=self.world,
            layout_hash=self.layout.hash,
            layout=self.layout.to_dict() if self.rank == 0 else None,
            optim=self.optim_desc if self.rank == 0 else sqrttab.public(self.optim_desc),  # one table is enough
            iteration=self.base,
            overwrite=bool(overwrite),
            restored=restored.wire() if restored is not None else None,
        )
        try:
            reply = request(
                self.dealer,
                self.coordinator,
                payload,
                self.options.tuning.connect_timeout_s,
                ("attached",),
                interim=LogWaiting(f"rank {self.rank}", self.coordinator),
            )
        except BaseException:
            self.dealer.close(linger=0)
            self.dealer, self.closed = None, True
            raise
        self.epoch, self.job_id, self.workers = reply["epoch"], reply["job_id"], reply["workers"]
        self.shards = [(w["start"], w["stop"]) for w in self.workers]
        self.data_tags = data_tags(self.workers, reply.get("keys"))
        token = reply.get("token")
        self.token = token if isinstance(token, bytes) else None  # proves this rank to a restarted coordinator

    @property
    def recovery(self) -> RecoveryController:
        """This epoch's view of the cluster (committed cut, degraded, resyncs, joins); there
        once :meth:`open` has started the attachment."""
        if self._recovery is None:
            raise RuntimeError("the attachment has not been started (Attachment.open starts it)")
        return self._recovery

    def _start(self, latch: ErrorLatch) -> None:
        if self.dealer is None:
            raise RuntimeError("the attachment has no connection to the coordinator (the handshake comes first)")
        self._recovery = RecoveryController(
            latch, self.rank, self.epoch, self.options.audit_strict, self.options.tuning.connect_timeout_s
        )
        nbuckets_slack = 16 * 256
        cap = self.options.tuning.ring_iterations * (self.layout.total // self.world + nbuckets_slack)
        self.ring = StagingRing(cap, pin=self.device.type == "cuda")
        self.sender = self.sender_class(
            self.ctx,
            self.dealer,
            [w["data"] for w in self.workers],
            self.ring,
            job_id=self.job_id,
            epoch=self.epoch,
            rank=self.rank,
            world=self.world,
            layout_hash=self.layout.hash,
            events=self.recovery,
            tuning=self.options.tuning,
            tags=self.data_tags,
            curve=[w.get("mode") == "curve" for w in self.workers],
            token=self.token,
        )
        self.recovery.bind(self.sender, self.ring)
        self.sender.start()

    # -- the comm hook ---------------------------------------------------------------------------
    def _plan(self, bucket: dist.GradBucket, reduced: torch.Tensor) -> buckets.BucketPlan:
        params = bucket.parameters()
        key = (bucket.index(), reduced.numel(), tuple(id(p) for p in params))
        plan = self.plans.get(key)
        if plan is None:
            base = reduced.data_ptr()
            slots = []
            for p, g in zip(params, bucket.gradients(), strict=True):
                i = self.index.get(id(p))
                if i is not None:
                    slots.append(((g.data_ptr() - base) // 4, self.layout.params[i].offset, p.numel(), i))
            stripe = stripe_bounds(reduced.numel(), self.world)[self.rank]
            per_worker = bucket_runs([s[:3] for s in slots], stripe, self.shards)
            runs = [[(r.src - stripe[0], r.dst, r.nelem) for r in rs] for rs in per_worker]
            plan = buckets.BucketPlan(
                stripe, runs, [sum(n for _, _, n in rs) for rs in runs], buckets.probes(slots, stripe)
            )
            self.plans[key] = plan
        return plan

    def stage(self, bucket: dist.GradBucket, reduced: torch.Tensor, recorder: StepRecorder) -> None:
        """Copy this rank's stripe of a reduced bucket into the ring and queue it. The
        copy is queued on the copy stream (after the all-reduce) and never waited for
        here: the sender waits for its event. The recorder's lock covers bookkeeping
        only; the wait for ring space (policy block) and the copy run outside it."""
        with recorder.lock:
            k = recorder.bucket(bucket.index())
            plan = self._plan(bucket, reduced)
        lo, hi = plan.stripe
        if hi <= lo or not any(plan.counts):
            return
        ring, sender = self.ring, self.sender
        if ring is None or sender is None:
            raise RuntimeError("a bucket reached an attachment that is not running (not started, or closed)")
        block = self.options.policy is Policy.block
        try:
            off = ring.alloc(hi - lo, self.options.tuning.block_timeout_s if block else 0.0)
        except RingInterrupted:
            return  # degraded while waiting: nothing more is streamed until a resync
        except RingFullError as exc:
            if block:
                self.recovery.on_error(f"{exc} (SHADOW_BLOCK_TIMEOUT_S)")
            else:
                self.recovery.fall_behind(k, "the staging ring is full (the sender cannot keep up)")
            return
        ready = self.copier.copy(ring.tensor[off : off + hi - lo], reduced[lo:hi])
        probes = []
        if plan.probes:
            n = len(plan.probes)
            for j in range(min(buckets.SAMPLES_PER_BUCKET, n)):
                pos, pidx, elem = plan.probes[(k * 7 + j * 13) % n]
                probes.append((pos - lo, pidx, elem))
        with recorder.lock:
            recorder.staged(plan.counts, [(pidx, elem) for _, pidx, elem in probes])
        sender.q.put(GradItem(k, off, hi - lo, plan.runs, ready, probes))

    def fence(self) -> None:
        """The current stream waits (on the device) for every bucket copy queued so far:
        before anything may write to DDP's bucket buffers again."""
        self.copier.fence()

    # -- the step ----------------------------------------------------------------------------------
    def audit(self, k: int) -> tuple:
        """``(plan, gathered values)`` of the divergence audit after step ``k``."""
        return audit.sample(self.layout, self.params, self.optimizer, self.optim_desc, self.shards, k)

    def throttle(self, k: int, latch: ErrorLatch) -> None:
        """Policy block: wait while this rank is more than ``SHADOW_MAX_LAG`` iterations
        ahead of the cluster (bounded); policy skip: fall behind instead of waiting."""
        lag = self.options.tuning.max_lag_iterations
        floor = self.base - 1  # the bootstrap (iteration base) is in flight like any iteration
        rec = self.recovery
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
        self.blocked_s += time.monotonic() - t0
        if not ok:
            rec.on_error(
                f"the shadow cluster has not committed iteration {k - lag} within {limit:.0f} s "
                f"(SHADOW_BLOCK_TIMEOUT_S; last committed: {rec.committed}); check "
                f"`shadow status address={self.coordinator}`"
            )

    def queue_commit(self, commit: Commit) -> None:
        """Queue the commit of ``commit.iteration``: rank 0's state and the model state
        outside the optimizer that changed are copied now (non-blocking); the sender
        builds the frames per worker (the blob only to the replicas of this rank's shard),
        after the EXTRA chunks (:mod:`trainer_hooks.session.commit`)."""
        sender = self.sender
        if sender is None:
            raise RuntimeError("a commit reached an attachment that was never started")
        state, extras = commit_parts.capture(self, commit)
        sender.q.put(
            CommitItem(commit.iteration, None, functools.partial(commit_parts.build, self, commit, state, extras))
        )
        self.last_emitted = commit.iteration

    def capture_extras(self, everything: bool):
        """Rank 0: copy the model state outside the optimizer that changed (all of it at
        a bootstrap, which starts a new epoch); sent with the commit."""
        if everything or self.extras is None:
            self.extras = ExtrasTracker(self.model, self.params, self.workers, self.options.tuning)
        return self.extras.capture(everything=everything)

    # -- the end -------------------------------------------------------------------------------------
    def close(self, wait: bool = True, latch: ErrorLatch | None = None) -> None:
        """With ``wait``: flush, then wait (``SHADOW_CLOSE_TIMEOUT_S``) for the cluster to
        commit the last iteration queued. Then stop the sender, detach, release the ring."""
        if self.closed:
            return
        rec, sender = self._recovery, self.sender
        if wait and rec is not None and sender is not None and (latch is None or latch.error is None):
            done = threading.Event()
            sender.q.put(FlushItem(done))
            done.wait(self.options.tuning.close_timeout_s)
            cond = latch.cond if latch is not None else threading.Condition()
            with cond:
                cond.wait_for(
                    lambda: (
                        rec.committed >= self.last_emitted
                        or rec.degraded is not None
                        or (latch is not None and latch.error is not None)
                    ),
                    self.options.tuning.close_timeout_s,
                )
            if rec.committed < self.last_emitted:
                logger.warning(
                    "closing with iteration %d not yet committed (cluster at %d)", self.last_emitted, rec.committed
                )
        self.closed = True
        if self.sender is not None and self.sender.ident is not None:
            self.sender.stop()
            self.sender.join(timeout=10)
        if self.dealer is not None:
            try:
                self.dealer.send(M.encode("detach", epoch=self.epoch, rank=self.rank), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.dealer.close(linger=500)
        self._release_ring()

    def _release_ring(self) -> None:
        ring = self.ring
        if ring is None or (self.sender is not None and self.sender.is_alive()):
            return  # a sender that did not stop may still read it
        self.ring_figures = {
            "blocked_s": ring.blocked_s,
            "occupancy": ring.occupancy,
            "high_water": ring.high_water / ring.capacity,
        }
        self.ring = None
        if self._recovery is not None:
            self._recovery.ring = None
        if self.sender is not None:
            self.sender.ring = None

    def figures(self) -> dict[str, Any]:
        """Ring and sender figures (kept once the ring is released)."""
        ring = self.ring
        out = (
            dict(self.ring_figures)
            if ring is None
            else {
                "blocked_s": ring.blocked_s,
                "occupancy": ring.occupancy,
                "high_water": ring.high_water / ring.capacity,
            }
        )
        out["blocked_s"] += self.blocked_s
        out["bytes_out"] = self.sender.bytes_out if self.sender is not None else 0
        out["messages_out"] = self.sender.messages_out if self.sender is not None else 0
        return out


def data_tags(workers: list[dict], keys: list | None) -> list[tags.Tags]:
    """What this rank tags its frames to each worker with, from the ``attached`` reply: its
    MAC key per worker on a keyed cluster, checksums on one without keys."""
    keyed = [w.get("mode") in ("mac", "curve") for w in workers]
    if not any(keyed):
        return [tags.PLAIN] * len(workers)
    if not isinstance(keys, list) or len(keys) != len(workers):
        sent = len(keys) if isinstance(keys, list) else "no"
        raise ShadowError(
            f"the coordinator named {len(workers)} keyed workers but sent {sent} data keys; "
            "coordinator and trainers must run the same shadow version"
        )
    for w, (k, on) in enumerate(zip(keys, keyed, strict=True)):
        if on and not (isinstance(k, bytes) and len(k) == tags.KEY_SIZE):
            raise ShadowError(f"the coordinator sent no valid data key for worker {w}; is it the same shadow version?")
    return [tags.for_key(k) if on else tags.PLAIN for k, on in zip(keys, keyed, strict=True)]
