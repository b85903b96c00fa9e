"""A training run attached to a shadow cluster.

Call order (what runs where):

0. ``attach`` (every rank): layout + replay descriptor, handshake with the coordinator
   (bounded by ``SHADOW_CONNECT_TIMEOUT_S``), bootstrap state streamed to the workers
   (:meth:`Attachment.open`).
1. backward: the model's hook slot all-reduces each bucket exactly as DDP's default does,
   then the attachment's bucket handler queues the copy of this rank's stripe into the
   staging ring (on CUDA: non-blocking, on a copy stream, after the all-reduce) and queues
   the slot for the sender, which waits for the copy. It never blocks on the network or
   the device; it waits for ring space at most ``SHADOW_BLOCK_TIMEOUT_S``.
2. ``optimizer.step()``: the pre-step hook raises any latched error and has the
   attachment copy the probed gradients (non-blocking); the post-step hook has the
   attachment record the commit with its :class:`StepRecorder` (hyperparameters as used,
   skipped params; clip coefficient, GradScaler factors and ``found_inf`` copied
   non-blocking; RNG, extra state), which leaves once the scheduler has stepped; the
   sender reads what was copied, checks the probed gradients and frames it. Then the step
   waits while this rank is more than ``SHADOW_MAX_LAG`` iterations ahead of the cluster
   (policy block).
3. ``close``: flush, wait for the last commit (``SHADOW_CLOSE_TIMEOUT_S``), detach.

The session holds the options, the error latch, the hooks (installed and removed per
attachment: :mod:`trainer_hooks.session.wiring`), the step recorder, its totals across
attachments (:mod:`trainer_hooks.session.tally`) and the current attachment; every hook
hands its event to the attachment, which runs the pipeline and drives the recorder (which
calls nothing back). A resync or :meth:`Session.add_param_group` closes the current
attachment and opens a new one at the same iteration boundary, handing it the same
recorder; the session and its hooks stay.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shadow.core.errors import ShadowUsageError
from trainer_hooks.restorer.points import RESTORED, RestorePoint
from trainer_hooks.session import device, wiring
from trainer_hooks.session import metrics as _metrics
from trainer_hooks.session.attachment import Attachment
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.recorder import StepRecorder
from trainer_hooks.session.recovery import ErrorLatch
from trainer_hooks.session.retry import RESYNC_MIN_S, RETRY_STEPS, Prober, resync_budget
from trainer_hooks.session.sender import SENDER_FACTORY, SenderFactory
from trainer_hooks.session.tally import Tally
from trainer_hooks.session.transfer import HostCopy

if TYPE_CHECKING:
    from trainer_hooks.restorer.restore import RestoreInfo

logger = logging.getLogger(__name__)


def _checked(ddp_model: Any, options: AttachOptions | None, option_values: dict[str, Any]) -> AttachOptions:
    """The session's options (given, or built from keywords), and its model checked."""
    if options is not None and option_values:
        raise TypeError(
            f"pass the options either as an AttachOptions or as keywords, not both "
            f"(got options= and {sorted(option_values)})"
        )
    options = AttachOptions(**option_values) if options is None else options
    wiring.check(ddp_model, options)
    return options


class Session:
    """Handle returned by :func:`trainer_hooks.attach` (one per rank)."""

    def __init__(
        self,
        ddp_model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        coordinator: str,
        options: AttachOptions | None = None,
        *,
        iteration: int | None = None,
        overwrite: bool = False,
        sender_factory: SenderFactory | None = None,
        **option_values: Any,
    ) -> None:
        """Prefer :func:`trainer_hooks.attach`. ``options``, or the same values as keywords
        (``scheduler=``, ``job=``, ...: the fields of :class:`AttachOptions`).
        ``sender_factory``: makes each attachment's sender thread (default: the one
        :data:`~trainer_hooks.session.sender.SENDER_FACTORY` holds in this context, read
        now and kept for every re-attach)."""
        options = _checked(ddp_model, options, option_values)
        self.model, self.optimizer, self.coordinator, self.options = ddp_model, optimizer, coordinator, options
        fsdp = not isinstance(ddp_model, DistributedDataParallel)
        # FSDP2: the default group, every rank of the job
        self.pg: Any = ddp_model.process_group if isinstance(ddp_model, DistributedDataParallel) else None
        self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        # FSDP2: the votes get a group of their own (DDP's ride along its last bucket)
        self._vote_group = dist.new_group() if fsdp else None
        restored = RESTORED.get(optimizer)
        start = (restored.iteration if restored else 0) if iteration is None else int(iteration)
        if start < 0:
            raise ValueError(f"iteration must be >= 0, got {start}")
        self.latch = ErrorLatch()
        # the step recorder lives as long as the session: each attachment drives it for its epoch
        self.recorder = StepRecorder(optimizer, options)
        self._sender_factory = SENDER_FACTORY.get() if sender_factory is None else sender_factory
        self.attachment: Attachment | None = None
        #: what ``attach(resume=...)`` restored before attaching (None: a fresh start, or no resume asked)
        self.restored: RestoreInfo | None = None
        self.closed = True
        self._failed: str | None = None  # a resync that could not re-attach
        # after a failed resync: the iteration it failed at, the steps trained since, and the
        # step count at which to try again (``_retry``)
        self._lost: tuple[int, int, int] | None = None  # (at, steps since, next try)
        self._prober: Prober | None = None  # while a failed resync waits: is the cluster ready again?
        self._tally = Tally(start, self.rank, options.tuning.unprotected_warn_iterations)  # across attachments
        self._slot = wiring.slot_of(ddp_model)  # FSDP2: None
        self._attach(start, overwrite, carry=None)
        _metrics.publish(self, options.tuning.metrics_port)
        att = self._att
        logger.info(
            "rank %d attached to %s as job %s epoch %d at iteration %d (%s Adam, %d elements, %d workers)",
            self.rank,
            coordinator,
            options.job,
            att.handshake.epoch,
            start,
            att.target.optim_desc["impl"],
            att.target.wire_layout.total,
            len(att.handshake.shards),
        )

    # -- attachments ----------------------------------------------------------------------------
    def _attach(self, start: int, overwrite: bool, carry: tuple | None, wait_s: float | None = None) -> None:
        """Open an attachment at iteration ``start`` (handing it the recorder) and route the
        hooks to it; ``wait_s``: the bound on the handshake (default SHADOW_CONNECT_TIMEOUT_S)."""
        restored = RESTORED.get(self.optimizer)
        point: RestorePoint | None = restored if restored is not None and restored.iteration == start else None
        prev = self.attachment  # a re-attach proves it is the job's owner with the epoch it leaves
        owner = (prev.handshake.epoch, prev.handshake.token) if prev is not None and prev.handshake.token else None
        if carry is None and point is not None and point.rng is not None:
            # the restored iteration's own RNG and extra state, whatever the loop drew since
            # (restore(defer_rng=True) leaves the RNG alone until apply_rng)
            carry = (point.rng, HostCopy(point.extra_state))
        att = self.attachment = Attachment.open(
            self.model,
            self.optimizer,
            self.coordinator,
            self.options,
            self.latch,
            self.recorder,
            iteration=start,
            overwrite=overwrite,
            restored=point,
            carry=carry,
            sender_factory=self._sender_factory,
            vote_group=self._vote_group,
            owner=owner,
            wait_s=wait_s,
        )
        self.latch.error = None
        self.closed = False
        self._wiring = wiring.install(
            self.model,
            self.optimizer,
            self.options,
            self._slot,
            att,
            pre_step=self._pre_step,
            post_step=self._post_step,
            before_forward=self._before_forward,
            clip_owner=self,
        )

    @property
    def _att(self) -> Attachment:
        """The current attachment: there from the end of ``__init__`` on (a failed resync
        keeps the closed one)."""
        if self.attachment is None:
            raise RuntimeError("the session has no attachment (its first attach did not complete)")
        return self.attachment

    def _detach(self, wait: bool, join_s: float = 10.0) -> None:
        """Close the current attachment (its sender given ``join_s`` to stop) and unhook
        (the slot goes back to reducing only)."""
        att = self._att
        att.flush()
        att.close(wait=wait, join_s=join_s)
        self._tally.add(att.figures())
        self.closed = True
        self._wiring.remove()

    def _resync(self) -> None:
        """Re-attach at this iteration boundary: a new epoch bootstrapped from this rank's
        current state (every rank does it at the same iteration: they voted on it)."""
        k = self.recorder.next - 1
        t0 = time.monotonic()
        budget = resync_budget(self.options.tuning)  # the step waits on all of it
        self._detach(wait=False, join_s=budget / 2)
        try:  # (a failed one is tried again, once the cluster is ready)
            wait_s = max(RESYNC_MIN_S, budget - (time.monotonic() - t0))
            self._attach(k, overwrite=True, carry=self.recorder.last_record, wait_s=wait_s)
        except Exception as exc:  # the shadow must never stop training
            self._failed = f"resync at iteration {k} failed: {exc}"
            self._lost = (k, 0, RETRY_STEPS)
            self._prober = Prober(self.coordinator, self.options.tuning, self.options.job)
            self._unhooked()
            logger.error(
                "rank %d: %s; training continues without the shadow, and tries again once the cluster is ready",
                self.rank,
                self._failed,
            )
            return
        logger.info(
            "rank %d resynced the shadow cluster at iteration %d in %.2f s (epoch %d)",
            self.rank,
            k,
            time.monotonic() - t0,
            self.epoch,
        )

    def _unhooked(self) -> None:
        """No attachment (a failed resync): the steps are counted and warned about, and each
        forward asks whether it is time to try again (:meth:`_retry`)."""
        self._wiring = wiring.Wiring(
            [
                self.optimizer.register_step_post_hook(lambda *_: self._count_unprotected()),
                self.model.register_forward_pre_hook(lambda *_: self._retry(), prepend=True),
            ]
        )

    def _retry(self) -> None:
        """Before a forward, after a failed resync: every :data:`RETRY_STEPS` steps (a step
        count every rank reaches at the same iteration: they failed at the same one), if the
        probe has found the cluster ready (:class:`~trainer_hooks.session.retry.Prober`, on a
        thread of its own), re-attach at this iteration, from this rank's state as it stands
        (as a first attach does)."""
        if self._lost is None:
            return
        at, steps, due = self._lost
        if steps < due:
            return
        k = at + steps  # the iteration this rank completed
        self._lost = (at, steps, steps + RETRY_STEPS)
        why = self._prober.not_ready() if self._prober is not None else None
        if why is not None:
            logger.info("rank %d: no new resync at iteration %d: %s", self.rank, k, why)
            return
        self._wiring.remove()
        try:
            self._attach(k, overwrite=True, carry=None, wait_s=resync_budget(self.options.tuning))
        except Exception as exc:  # the shadow must never stop training
            self._failed = f"resync at iteration {k} failed: {exc}"
            self._unhooked()
            logger.error("rank %d: %s; tries again in %d steps", self.rank, self._failed, RETRY_STEPS)
            return
        self._failed, self._lost = None, None
        self._stop_probe()
        logger.warning("rank %d resynced the shadow cluster at iteration %d, after a failed resync", self.rank, k)

    def _stop_probe(self) -> None:
        if self._prober is not None:
            self._prober.stop()
            self._prober = None

    def add_param_group(self, group: dict) -> None:
        """``optimizer.add_param_group(group)``, then re-attach with the new layout: the
        cluster is bootstrapped from this iteration's state and carries on. Checkpoints of
        earlier iterations keep the old layout. Call on every rank at the same iteration."""
        self.close(wait=True)
        self.optimizer.add_param_group(group)
        self._attach(self.iteration, overwrite=True, carry=self.recorder.last_record)

    # -- the hooks: each hands its event to the current attachment -----------------------------------
    def _pre_step(self, optimizer, args, kwargs) -> tuple | None:
        if self.closed:
            return None
        if device.capturing():
            raise ShadowUsageError(device.CAPTURE_ERROR)
        self.latch.raise_if_set(self.rank)
        att = self._att
        att.before_step()
        # torch passes the step's own arguments: (optimizer, closure?) and keywords
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            att.read_probes()  # compared by the sender with what was staged
            return None
        # optimizer.step(closure) (Lightning, LBFGS-style loops): forward, backward and any
        # clipping run inside the step; the gradients are probed once the closure returns
        wrapped = functools.partial(self._run_closure, closure)
        if "closure" in kwargs:
            return args, dict(kwargs, closure=wrapped)
        return (args[0], wrapped, *args[2:]), kwargs

    def _run_closure(self, closure):
        loss = closure()
        if not self.closed:
            self._att.read_probes()
        return loss

    def _clipped(self, scaled: set[int], coef: torch.Tensor) -> None:
        """torch clipped the gradients of the parameters ``scaled`` (ids) by ``coef``
        (:mod:`trainer_hooks.session.clipping`): recorded if they are this session's."""
        if self.closed or self.attachment is None:
            return
        self.attachment.clipped(scaled, coef)

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self.closed:
            return
        # a fused optimizer under GradScaler skips on the device: found_inf is read by the sender
        self._att.after_step(False, getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))
        self._count_unprotected()

    def _count_unprotected(self) -> None:
        """A step taken while this rank streams nothing (degraded, or a failed resync): counted
        (``stats()["unprotected_steps"]``, the metric ``shadow_trainer_unprotected_steps``)
        and warned about (:meth:`Tally.step`)."""
        if self._lost is not None:
            at, steps, due = self._lost
            self._lost = (at, steps + 1, due)
        self._tally.step(self.degraded, self.iteration, self.committed)

    def _before_forward(self) -> None:
        if self._att.before_forward():  # every rank resyncs at this boundary
            self._resync()

    def _release(self, hold: str, extra_state: Any = None) -> None:
        """An integration's hold ``hold`` (one of ``recorder.holds``) is over for the
        pending commit, which leaves once nothing else holds it; with ``extra_state``, it
        carries that extra state instead of what was recorded at the step."""
        if not self.closed:
            self._att.release(hold, extra_state)

    # -- public ---------------------------------------------------------------------------------------------
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        parameters=None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``parameters`` (default
        ``model.parameters()``; the order matters, since the total norm is summed in it).

        A convenience: torch's own ``clip_grad_norm_``, called from the loop or from a
        framework (accelerate, the transformers Trainer, Lightning), is recorded the same
        way; the shadow applies the same coefficient.
        """
        params = list(self.model.parameters() if parameters is None else parameters)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    def close(self, wait: bool = True) -> int:
        """Flush, wait for the cluster to commit the last iteration, detach.

        Returns the newest committed iteration known to this rank.
        """
        if not self.closed:
            self._detach(wait)
        elif self._failed is not None:  # the failed resync's step counter and probe
            self._wiring.remove()
        self._stop_probe()
        return self.committed

    @property
    def committed(self) -> int:
        """Newest iteration the cluster has committed (as last heard): every shadow
        worker applied it, so a restore can return it."""
        return self._att.recovery.committed

    @property
    def applied(self) -> int:
        """Deprecated name of :attr:`committed`."""
        warnings.warn("Session.applied is deprecated; use Session.committed", DeprecationWarning, stacklevel=2)
        return self.committed

    @property
    def iteration(self) -> int:
        """Last iteration this rank completed (optimizer steps since attach + start)."""
        return self.recorder.next - 1

    @property
    def degraded(self) -> str | None:
        """Why this rank is not streaming now (None while it is)."""
        return self._failed or self._att.recovery.degraded

    @property
    def job(self) -> str:
        """The job's name in the cluster."""
        return self.options.job

    @property
    def epoch(self) -> int:
        """The cluster's epoch for this job (a new one at every resync or re-attach)."""
        return self._att.handshake.epoch

    @property
    def job_id(self) -> int:
        """The cluster's id for this job (in every data frame header)."""
        return self._att.handshake.job_id

    @property
    def layout(self):
        """The flat layout of the optimizer's parameters the cluster holds."""
        return self._att.target.wire_layout

    @property
    def base(self) -> int:
        """The iteration the current attachment started at."""
        return self._att.handshake.base

    @property
    def sender(self):
        """The current attachment's sender thread (its queue, sequence numbers, byte counts)."""
        return self._att.sender

    @property
    def audit_failures(self) -> list[str]:
        """What failed divergence audits reported, oldest first (kept across resyncs)."""
        return self.latch.audit_failures

    def stats(self) -> dict:
        """Trainer-side figures since attach (across resyncs): ``hook_s`` (time the comm
        hook spent staging), ``buckets`` and ``hook_s_per_bucket``, ``steps``,
        ``blocked_s`` (waits for the cluster or for ring space), ring occupancy and high
        water (the current ring), bytes and messages sent, ``applied``, ``iteration``,
        ``degraded`` (why this rank streams nothing now, or None), ``unprotected_steps``
        (steps in a row taken so: 0 while protected), ``unprotected_steps_total``,
        ``base_kept`` (the workers kept the state this epoch began from, restored from their
        memory, and this rank proved its own equal by digests instead of sending it),
        ``shadow_errors``."""
        att = self._att
        return self._tally.stats(
            att.figures(),
            not att.closed,  # a closed attachment's figures are in the tally's totals
            iteration=self.iteration,
            degraded=self.degraded,
            committed=self.committed,
            base_kept=att.handshake.keep,
            shadow_errors=self.latch.shadow_errors,
        )
