"""A training run attached to a shadow cluster.

Call order (what runs where):

0. ``attach`` (every rank): layout + replay descriptor, handshake with the coordinator
   (bounded by ``SHADOW_CONNECT_TIMEOUT_S``), bootstrap state streamed to the workers.
1. backward: the DDP comm hook all-reduces each bucket exactly as DDP's default does,
   then copies this rank's stripe into the staging ring (never blocks on the network;
   waits for ring space at most ``SHADOW_BLOCK_TIMEOUT_S``) and queues it for the sender.
2. ``optimizer.step()``: the pre-step hook raises any latched error; the post-step hook
   records the commit (hyperparameters as used, skipped params, clip coefficient, RNG,
   extra state) and, once the scheduler has stepped, queues it; then waits while this
   rank is more than ``SHADOW_MAX_LAG`` iterations ahead of the cluster (policy block).
3. ``close``: flush, wait for the last commit (``SHADOW_CLOSE_TIMEOUT_S``), detach.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import zmq
from torch.nn.parallel import DistributedDataParallel

from shadow import knobs
from shadow.client import LogWaiting, dealer, request
from shadow.errors import ShadowError, ShadowUsageError
from shadow.jobs import check_job_name
from shadow.layout import bucket_runs, stripe_bounds
from shadow.wire import messages as M
from trainer_hooks import _bootstrap, _buckets, _checks, _metrics, _observe, _optim
from trainer_hooks._clip import ClipMixin
from trainer_hooks._commit import CommitMixin
from trainer_hooks._model import build_layout, state_dict_aliases
from trainer_hooks._recovery import RecoveryMixin
from trainer_hooks._restored import RESTORED
from trainer_hooks._sender import FlushItem, GradItem, Sender
from trainer_hooks._staging import RingFullError, RingInterrupted, StagingRing

logger = logging.getLogger(__name__)

POLICIES = ("block", "skip")


class Session(RecoveryMixin, CommitMixin, ClipMixin):
    """Handle returned by :func:`trainer_hooks.attach`."""

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, coordinator: str, *,
                 scheduler: Any = None, extra_state: Callable[[], Any] | None = None, job: str = "default",
                 iteration: int | None = None, overwrite: bool = False, policy: str = "block",
                 tokens: Callable[[], int] | None = None, comm_hook: Callable | None = None,
                 comm_state: Any = None, scaler: Any = None, audit_every: int = 0,
                 audit_strict: bool = False) -> None:
        check_job_name(job)  # it names a directory under every tier's root
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError("attach() takes the DistributedDataParallel-wrapped model (the shadow streams DDP's "
                            f"reduced gradient buckets); got {type(ddp_model).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"back-pressure policy {policy!r} is not supported; choose one of {POLICIES}")
        if extra_state is not None and not callable(extra_state):
            raise TypeError("extra_state must be a callable returning the state to save each iteration")
        if tokens is not None and not callable(tokens):
            raise TypeError("tokens must be a callable returning the number of tokens trained on so far")
        self.tokens = tokens
        if comm_hook is not None and not callable(comm_hook):
            raise TypeError("comm_hook must be a DDP communication hook, e.g. "
                            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook")
        self.comm_hook, self.comm_state = comm_hook, comm_state
        self._init_args = dict(scheduler=scheduler, extra_state=extra_state, job=job, policy=policy, tokens=tokens,
                               comm_hook=comm_hook, comm_state=comm_state, scaler=scaler, audit_every=audit_every,
                               audit_strict=audit_strict)
        if audit_every < 0:
            raise ValueError(f"audit_every={audit_every} must be >= 0 (0 = no audit)")
        self.audit_every, self.audit_strict = int(audit_every), bool(audit_strict)
        self.audit_failures: list[str] = []
        if scaler is not None and not hasattr(scaler, "unscale_"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._inv_scale: float | None = None
        self._awaiting: set[str] = set()
        self.model, self.optimizer, self.scheduler, self.extra_state = ddp_model, optimizer, scheduler, extra_state
        self.coordinator, self.job, self.policy = coordinator, job, policy
        self.pg = ddp_model.process_group
        self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        self.layout, self.params = build_layout(ddp_model, optimizer)
        self.optim_desc = _optim.describe(optimizer)
        _observe.check_scheduler(scheduler)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._aliases = state_dict_aliases(ddp_model)
        restored = RESTORED.get(optimizer)
        start = (restored.iteration if restored else 0) if iteration is None else int(iteration)
        self._restored = restored if restored is not None and restored.iteration == start else None
        if start < 0:
            raise ValueError(f"iteration must be >= 0, got {start}")
        self.base = start
        self._next = start + 1
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._applied = -1
        self._error: BaseException | None = None  # raised at the next step: only what the user caused or asked for
        self.shadow_errors = 0  # failures of the shadow itself: counted, logged, never raised
        self.degraded: str | None = None
        self._resync_requested = False  # the coordinator asked (this rank heard it)
        self._resync_at: int | None = None  # every rank agreed: resync after this iteration
        self._vote = torch.zeros(2, dtype=torch.int32)  # [resync asked, newest replica join heard]
        self._joins: dict[int, dict] = {}  # generation -> replica_in message
        self._join_done = 0  # newest generation this rank streams to
        self._join_at: tuple[int, int] | None = None  # (after iteration, up to generation)
        self._closed = False
        self._clip: float | None = None
        self._pending: tuple | None = None
        self._last_emitted = start
        self._seen_buckets: set[int] = set()
        self._samples: list = []  # (param index, element, reduced value) checked at the step
        self._bucket_plans: dict[tuple, _buckets.BucketPlan] = {}
        self.hook_s = 0.0
        self.blocked_s = 0.0
        self._handshake(overwrite)
        self._sent = [0] * len(self.shards)
        total = self.layout.total
        nbuckets_slack = 16 * 256
        cap = knobs.get_int("RING_ITERATIONS") * (total // self.world + nbuckets_slack)
        self.ring = StagingRing(cap, pin=torch.cuda.is_available() and any(p.is_cuda for p in self.params))
        self.sender = Sender(self._ctx, self._dealer, [w["data"] for w in self.workers], self.ring,
                             job_id=self.job_id, epoch=self.epoch, rank=self.rank, world=self.world,
                             layout_hash=self.layout.hash, on_error=self._shadow_failed, on_progress=self._progress,
                             on_degraded=self._on_degraded, on_audit=self._on_audit,
                             on_resync=self._on_resync, on_join=self._on_join,
                             on_lost=self._on_coordinator_lost, on_back=self._on_coordinator_back)
        self.sender.start()
        _bootstrap.bootstrap(self)
        self._install_hooks()
        _metrics.publish(self)
        logger.info("rank %d attached to %s as job %s epoch %d at iteration %d (%s Adam, %d elements, %d workers)",
                    self.rank, coordinator, job, self.epoch, start, self.optim_desc["impl"], total, len(self.shards))

    # -- attach ----------------------------------------------------------------------------
    def _handshake(self, overwrite: bool) -> None:
        self._ctx = zmq.Context.instance()
        self._dealer = dealer(self._ctx, self.coordinator)
        payload = M.encode("attach", job=self.job, rank=self.rank, world=self.world,
                           layout_hash=self.layout.hash, layout=self.layout.to_dict() if self.rank == 0 else None,
                           optim=self.optim_desc, iteration=self.base, overwrite=bool(overwrite),
                           restored=dataclasses.asdict(self._restored) if self._restored is not None else None)
        try:
            reply = request(self._dealer, self.coordinator, payload, knobs.get("CONNECT_TIMEOUT_S"), ("attached",),
                            interim=LogWaiting(f"rank {self.rank}", self.coordinator))
        except BaseException:
            self._dealer.close(linger=0)
            raise
        self.epoch, self.job_id, self.workers = reply["epoch"], reply["job_id"], reply["workers"]
        self.shards = [(w["start"], w["stop"]) for w in self.workers]

    def _install_hooks(self) -> None:
        if not getattr(self, "_comm_registered", False):
            self.model.register_comm_hook(None, self._comm_hook)  # DDP takes one hook, once
            self._comm_registered = True
        self._handles = [
            self.optimizer.register_step_pre_hook(self._pre_step),
            self.optimizer.register_step_post_hook(self._post_step),
        ]
        # the commit of iteration k leaves once the scheduler has stepped; if it steps at
        # another cadence, at the latest when the next forward (or step, or close) begins
        self._handles.append(self.model.register_forward_pre_hook(lambda *_: self._before_forward()))
        self._swapped = []
        for obj in (self.scheduler, self.scaler):
            if obj is not None:
                self._swapped.append((obj, type(obj)))
                obj.__class__ = _observe.observed(type(obj))
                _observe.OWNERS[obj] = self

    # -- errors and progress ------------------------------------------------------------------------
    def _latch(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _raise_latched(self) -> None:
        if self._error is not None:
            err = self._error
            cls = type(err) if isinstance(err, ShadowError) else ShadowError
            raise cls(f"shadow checkpointing failed on rank {self.rank}: {err}") from err

    def _progress(self, applied: int) -> None:
        with self._cond:
            if applied > self._applied:
                self._applied = applied
                self._cond.notify_all()

    def _on_audit(self, msg: dict) -> None:
        text = f"divergence audit failed at iteration {msg['iteration']}: {msg['detail']}"
        self.audit_failures.append(text)
        logger.error("%s", text)
        if self.audit_strict:
            self._latch(ShadowError(text))

    @property
    def applied(self) -> int:
        """Newest iteration the cluster has committed (as last heard)."""
        return self._applied

    @property
    def iteration(self) -> int:
        """Last iteration this rank completed (optimizer steps since attach + start)."""
        return self._next - 1

    # -- step 1: comm hook ---------------------------------------------------------------------------
    def _comm_hook(self, _state, bucket):  # unannotated: DDP inspects hook annotations
        if self.comm_hook is not None:
            # the user's hook (e.g. bf16 compression) reduces; the shadow takes what it
            # leaves in the bucket, which is what the optimizer will see
            fut = self.comm_hook(self.comm_state, bucket)
        else:
            buf = bucket.buffer()
            buf.mul_(1.0 / self.world)  # DDP's built-in allreduce divides the same way
            fut = dist.all_reduce(buf, group=self.pg, async_op=True).get_future().then(lambda f: f.value()[0])
        if self._closed:
            return fut
        if bucket.is_last():
            fut = self._vote_resync(fut, bucket.buffer().device)
        return fut.then(functools.partial(self._after_reduce, bucket))

    def _after_reduce(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        if self._error is None and self.degraded is None:
            t0 = time.perf_counter()
            try:
                self._stage(bucket, reduced)
            except ShadowUsageError as exc:  # never raise into DDP: the next step raises it
                self._latch(exc)
            except Exception as exc:  # noqa: BLE001 - the shadow's own failure must not stop training
                self._shadow_failed(exc)
            self.hook_s += time.perf_counter() - t0
        return reduced

    def _plan(self, bucket: dist.GradBucket, reduced: torch.Tensor) -> _buckets.BucketPlan:
        params = bucket.parameters()
        key = (bucket.index(), reduced.numel(), tuple(id(p) for p in params))
        plan = self._bucket_plans.get(key)
        if plan is None:
            base = reduced.data_ptr()
            slots = []
            for p, g in zip(params, bucket.gradients()):
                i = self._index.get(id(p))
                if i is not None:
                    slots.append(((g.data_ptr() - base) // 4, self.layout.params[i].offset, p.numel(), i))
            stripe = stripe_bounds(reduced.numel(), self.world)[self.rank]
            per_worker = bucket_runs([s[:3] for s in slots], stripe, self.shards)
            runs = [[(r.src - stripe[0], r.dst, r.nelem) for r in rs] for rs in per_worker]
            plan = _buckets.BucketPlan(stripe, runs, [sum(n for _, _, n in rs) for rs in runs], _buckets.probes(slots, stripe))
            self._bucket_plans[key] = plan
        return plan

    def _stage(self, bucket: dist.GradBucket, reduced: torch.Tensor) -> None:
        with self._lock:
            idx = bucket.index()
            if idx in self._seen_buckets:
                raise ShadowUsageError(
                    f"bucket {idx} was all-reduced twice in iteration {self._next} without an optimizer step; "
                    "accumulate gradients inside `with ddp_model.no_sync():` for all but the last micro-batch")
            self._seen_buckets.add(idx)
            plan = self._plan(bucket, reduced)
            lo, hi = plan.stripe
            if hi <= lo or not any(plan.counts):
                return
            try:
                off = self.ring.alloc(hi - lo, knobs.get("BLOCK_TIMEOUT_S") if self.policy == "block" else 0.0)
            except RingInterrupted:
                return  # degraded while waiting: nothing more is streamed until a resync
            except RingFullError as exc:
                if self.policy == "block":
                    self._shadow_failed(f"{exc} (SHADOW_BLOCK_TIMEOUT_S)")
                else:
                    self._fall_behind(self._next, "the staging ring is full (the sender cannot keep up)")
                return
            self.ring.tensor[off:off + hi - lo].copy_(reduced[lo:hi])
            if plan.probes:
                n = len(plan.probes)
                for j in range(min(_buckets.SAMPLES_PER_BUCKET, n)):
                    pos, pidx, elem = plan.probes[(self._next * 7 + j * 13) % n]
                    self._samples.append((pidx, elem, self.ring.array[off + pos - lo]))
            for w, c in enumerate(plan.counts):
                self._sent[w] += c
            self.sender.q.put(GradItem(self._next, off, hi - lo, plan.runs))

    # -- step 2: optimizer hooks --------------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self._closed:
            return
        self._raise_latched()
        self._emit_pending()
        _checks.check_layout(self)
        _checks.check_samples(self)

    def add_param_group(self, group: dict) -> None:
        """``optimizer.add_param_group(group)``, then re-attach with the new layout: the
        cluster is bootstrapped from this iteration's state and carries on. Checkpoints of
        earlier iterations keep the old layout. Call on every rank at the same iteration."""
        self.close(wait=True)
        self.optimizer.add_param_group(group)
        keep_registered = self._comm_registered
        self._carry = getattr(self, "_last_record", None)
        self.__init__(self.model, self.optimizer, self.coordinator, iteration=self.iteration, overwrite=True,
                      **self._init_args)
        self._comm_registered = keep_registered

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self._closed:
            return
        k, sent = self._advance()
        grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
        skip = found_inf is not None and float(found_inf) != 0.0
        self._record(k, sent, skip, grad_scale)

    def _advance(self) -> tuple[int, list]:
        """Close iteration k's bookkeeping: ``(k, elements sent per worker)``."""
        with self._lock:
            k, sent, self._sent = self._next, self._sent, [0] * len(self.shards)
            self._seen_buckets.clear()
            self._samples.clear()
            self._next = k + 1
        return k, sent

    def _skipped_step(self) -> None:
        """GradScaler found inf/nan and did not call the optimizer: iteration k happened
        (gradients were reduced and sent) but changes nothing."""
        k, sent = self._advance()
        self._record(k, sent, True, None)

    def _throttle(self, k: int) -> None:
        lag = knobs.get_int("MAX_LAG")
        floor = self.base - 1  # the bootstrap (iteration base) is in flight like any iteration
        if k - max(self._applied, floor) <= lag or self.degraded is not None:
            return
        if self.policy == "skip":
            self._fall_behind(k, f"iteration {k} is {k - max(self._applied, floor)} ahead of the cluster's cut "
                                 f"{self._applied} (SHADOW_MAX_LAG={lag})")
            return
        t0 = time.monotonic()
        limit = knobs.get("BLOCK_TIMEOUT_S")
        with self._cond:
            ok = self._cond.wait_for(
                lambda: k - max(self._applied, floor) <= lag or self._error is not None or self.degraded is not None,
                limit)
        self.blocked_s += time.monotonic() - t0
        if not ok:
            self._shadow_failed(
                f"the shadow cluster has not committed iteration {k - lag} within {limit:.0f} s "
                f"(SHADOW_BLOCK_TIMEOUT_S; last committed: {self._applied}); check "
                f"`shadow status address={self.coordinator}`")

    # -- step 3: close ---------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> int:
        """Flush, wait for the cluster to commit the last iteration, detach.

        Returns the newest committed iteration known to this rank.
        """
        if self._closed:
            return self._applied
        self._emit_pending()
        if wait and self._error is None:
            done = threading.Event()
            self.sender.q.put(FlushItem(done))
            done.wait(knobs.get("CLOSE_TIMEOUT_S"))
            with self._cond:
                self._cond.wait_for(lambda: self._applied >= self._last_emitted or self._error is not None
                                    or self.degraded is not None, knobs.get("CLOSE_TIMEOUT_S"))
            if self._applied < self._last_emitted:
                logger.warning("closing with iteration %d not yet committed (cluster at %d)",
                               self._last_emitted, self._applied)
        self._closed = True
        self.sender.stop()
        self.sender.join(timeout=10)
        for h in self._handles:
            h.remove()
        for obj, cls in self._swapped:
            obj.__class__ = cls
            _observe.OWNERS.pop(obj, None)
        try:
            self._dealer.send(M.encode("detach", epoch=self.epoch, rank=self.rank), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._dealer.close(linger=500)
        return self._applied

    def stats(self) -> dict:
        """Trainer-side figures: hook time, ring occupancy, blocked time, bytes sent."""
        return {"hook_s": self.hook_s, "steps": self.iteration - self.base,
                "blocked_s": self.blocked_s + self.ring.blocked_s, "ring_occupancy": self.ring.occupancy,
                "ring_high_water": self.ring.high_water / self.ring.capacity, "degraded": self.degraded,
                "bytes_out": self.sender.bytes_out, "messages_out": self.sender.messages_out,
                "applied": self._applied, "iteration": self.iteration, "shadow_errors": self.shadow_errors}
