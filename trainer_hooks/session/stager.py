"""The per-step bucket handling of an attachment: from DDP's reduced buckets (or, FSDP2,
the gradients the step is about to read) to the staging ring and the sender's queue.

A :class:`GradStager` plans each bucket once (:class:`~trainer_hooks.session.buckets.Planner`),
asks the step recorder which iteration it belongs to, takes ring space (policy block:
waits for it, bounded by ``SHADOW_BLOCK_TIMEOUT_S``), queues the copy of this rank's
stripe on the copy stream and a :class:`~trainer_hooks.session.items.GradItem` for the
sender. It never raises into DDP: usage errors go to the error latch, the shadow's own
failures to the recovery state."""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shadow.config.choices import Policy
from shadow.core.errors import ShadowUsageError
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.session import buckets, device
from trainer_hooks.session.items import GradItem
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import StepRecorder
from trainer_hooks.session.recovery import ErrorLatch, RecoveryController
from trainer_hooks.session.staging import RingFullError, RingInterrupted, StagingRing
from trainer_hooks.session.target import Target
from trainer_hooks.session.transfer import CopyStream


class GradStager:
    """One attachment's gradients into its ring: built with the ring and the sender's
    queue, used from DDP's callbacks (:meth:`on_bucket`) or at the step (FSDP2:
    :meth:`stage_shards`). ``ring`` is None once the attachment released it."""

    def __init__(
        self,
        target: Target,
        shards: Sequence[tuple[int, int]],
        options: AttachOptions,
        latch: ErrorLatch,
        recorder: StepRecorder,
        recovery: RecoveryController,
        ring: StagingRing,
        out: queue.Queue,
    ) -> None:
        """Stage ``target``'s gradients for the workers' ``shards`` into ``ring``, queueing
        each staged stripe on ``out`` (the sender's queue)."""
        self.target, self.shards, self.options, self.latch = target, shards, options, latch
        self.recorder, self.recovery = recorder, recovery
        self.ring: StagingRing | None = ring
        self.out = out
        self.copier = CopyStream(target.device)  # bucket copies to the ring, off the autograd thread's way
        self.planner = buckets.Planner(target.layout, target.index, target.rank, target.world, shards)
        self._shard_runs: dict[tuple, list] = {}  # FSDP2: runs per set of parameters with a gradient
        self.hook_s = 0.0  # time spent staging, on the thread that runs DDP's callbacks
        self.buckets = 0  # buckets staged (or tried)

    # -- DDP: a bucket at a time, from the comm hook ----------------------------------------------
    def on_bucket(self, fut: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """``fut`` reduces ``bucket``: vote beside the last bucket, stage once reduced."""
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
            self.hook_s += time.perf_counter() - t0
            self.buckets += 1
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
        self.out.put(GradItem(k, off, hi - lo, plan.runs, ready, probes))

    def fence(self) -> None:
        """The current stream waits (on the device) for every bucket copy queued so far:
        before anything may write to DDP's bucket buffers again."""
        self.copier.fence()

    # -- FSDP2: the whole step's rows at once, as the step reads them ------------------------------
    def stage_shards(self, vote_group: Any) -> None:
        """FSDP2/HSDP: the gradients are final (the step is about to read them: clipped,
        unscaled and summed over micro-batches as the loop and FSDP left them). Vote in
        ``vote_group`` (:meth:`RecoveryController.vote_now`), then copy this rank's stripe
        of its rows into the ring and queue it, as :meth:`stage` does a bucket's."""
        t, rec = self.target, self.recorder
        shards = t.fsdp
        assert shards is not None
        # every rank votes at every step, degraded or not: how a degraded session learns to resync
        self.recovery.vote_now(t.device, rec.next, vote_group)
        _fsdp.align_grads(t.params)  # a collective as well: before anything may return
        if self.latch.error is not None or self.recovery.degraded is not None:
            return
        t0 = time.perf_counter()
        try:
            grads = [p.grad for p in t.params]
            present = tuple(g is not None for g in grads)
            runs = self._shard_runs.get(present)
            if runs is None:
                runs = self._shard_runs[present] = shards.runs(present, self.shards)
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
            self.out.put(GradItem(k, off, hi - lo, runs, ready, []))
        except ShadowUsageError as exc:
            self.latch.set(exc)
        except Exception as exc:  # noqa: BLE001 - the shadow's own failure must not stop training
            self.recovery.on_error(exc)
        finally:
            self.hook_s += time.perf_counter() - t0
            self.buckets += 1

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
