"""Per-step bookkeeping of one rank: which iteration is in progress, what the comm hook
staged for it (elements per worker, buckets seen, gradient probes), the transforms the loop
applied (clip coefficient, GradScaler unscale, a skipped step), and, at the step, the
commit record of iteration k: what the workers need to replay it (hyperparameters as
used, skipped params, clip and scaler factors) and what a restore needs besides the
arrays (RNG, extra state). No sockets and no callbacks: the attachment drives it and
sends what it returns (:meth:`StepRecorder.take_ready`, :meth:`StepRecorder.take_pending`).

Nothing here waits for the device: the clip coefficient, the GradScaler's factors and
``found_inf``, the probed gradients and the audit samples stay tensors, copied to the
host non-blocking (:class:`~trainer_hooks.session.transfer.HostCopy`) and read by the
sender thread when it builds the commit."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from shadow.core.errors import ShadowUsageError
from trainer_hooks.capture import rng as _rng
from trainer_hooks.optim import describe as _optim
from trainer_hooks.session import transfer
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.transfer import AsScalar, HostCopy


@dataclass
class Commit:
    """Iteration k as recorded at its step, waiting to be sent. ``late`` holds what the
    sender reads once the device has caught up: ``scalars`` (clip, inv_scale,
    grad_scale, found_inf) and ``audit`` (sampled values); ``probes``: the gradients
    probed before the step, and which."""

    iteration: int
    replay: dict
    rng: dict
    extra: Any  # a HostCopy of the extra state (or the value itself)
    sent: list  # elements staged per worker
    audit: Any = None  # the audit plan (trainer_hooks.session.audit), if sampled
    late: HostCopy | None = None
    probes: tuple[list, HostCopy] | None = None
    refusal: str | None = None  # why this iteration cannot be replayed (the sender refuses it)
    kept: list | None = None  # a bootstrap onto kept state: per worker, {field: packed (dst, n, xxh3) runs}


@dataclass(frozen=True)
class Stale:
    """The scheduler stepped again after the commit of ``iteration`` left: the scheduler
    state recorded with it missed that step (``why`` says how)."""

    iteration: int
    why: str


def _scalar(x: Any) -> Any:
    """A recorded factor for a :class:`HostCopy`: a tensor is read as a float32 number."""
    if x is None or not isinstance(x, torch.Tensor):
        return None if x is None else float(x)
    return AsScalar(x.detach().reshape(-1)[0].to(torch.float32))


class StepRecorder:
    """Bookkeeping for the iteration in progress (``next``) and the last one recorded.

    The comm hook's thread and the training thread both touch the per-iteration fields:
    the hook holds :attr:`lock` while it stages a bucket (:meth:`bucket`, :meth:`staged`).
    It calls nothing back: a commit recorded at the step waits as :attr:`pending` until
    the scheduler and scaler have stepped (:meth:`stepped`) and every hold is released
    (:meth:`release`); the caller then takes it (:meth:`take_ready`), or takes it anyway
    at the next forward, step or close (:meth:`take_pending`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, options: AttachOptions) -> None:
        self.optimizer, self.options = optimizer, options
        self.lock = threading.Lock()
        self.next = 1  # the iteration in progress
        self.sent: list[int] = []  # elements staged per worker in this iteration
        self.seen: set[int] = set()  # buckets reduced in this iteration
        self.samples: list = []  # (param index, element) probed in this iteration
        self.probes: tuple[list, HostCopy] | None = None  # what the step read of them
        self.clip: Any = None  # clip coefficient of this iteration (a tensor: not read here)
        self.inv_scale: Any = None  # GradScaler unscale factor of this iteration (a tensor)
        self.refusal: str | None = None  # why this iteration cannot be replayed, once known
        self.pending: Commit | None = None  # recorded, waiting for the scheduler/scaler to step
        self.awaiting: set[str] = set()
        self.last_record: tuple[dict, Any] | None = None  # (rng, extra) of the newest record
        # scheduler steps per optimizer step, learnt from the loop: the commit leaves after that
        # many (accelerate's wrapper steps the scheduler once per process per optimizer step)
        self.sched_count = 0  # scheduler steps since the last optimizer step
        self.cadence = 1  # as counted over the last whole window (before one: once per step, the usual)
        self._window = False  # sched_count counts from an optimizer step
        self.early: int | None = None  # iteration whose commit left on a scheduler step, until the window closes
        # what else every commit waits for, by name, until :meth:`release` (a framework's end of batch,
        # where its own checkpoints are taken; the next forward lets it go at the latest)
        self.holds: set[str] = set()

    def start(self, base: int, nworkers: int) -> None:
        """A new attachment at iteration ``base``: iteration ``base + 1`` is next."""
        with self.lock:
            self.next = base + 1
            self.sent = [0] * nworkers
            self.seen.clear()
            self.samples.clear()
        self.clip = self.inv_scale = self.probes = self.refusal = None
        self.pending, self.awaiting = None, set()

    # -- the comm hook (caller holds the lock) ------------------------------------------------------
    def bucket(self, index: int) -> int:
        """Bucket ``index`` was reduced: the iteration it belongs to. Reduced twice
        without a step is the loop's mistake (:class:`ShadowUsageError`)."""
        if index in self.seen:
            raise ShadowUsageError(
                f"bucket {index} was all-reduced twice in iteration {self.next} without an optimizer step; "
                "accumulate gradients inside `with ddp_model.no_sync():` for all but the last micro-batch"
            )
        self.seen.add(index)
        return self.next

    def staged(self, counts: list[int], samples: list) -> None:
        """A bucket's stripe is staged (in the same hold of the lock as :meth:`bucket`):
        ``counts`` elements per worker, gradient probes ``(param index, element)``. Should
        the staging then fail, the attachment stops streaming (degraded) and no commit of
        this iteration leaves, so nothing counted here is sent."""
        for w, c in enumerate(counts):
            self.sent[w] += c
        self.samples.extend(samples)

    # -- what the loop did to the gradients ----------------------------------------------------------
    def clipped(self, coef: Any) -> None:
        """The clip coefficient (a tensor, or a number) the gradients were multiplied by.
        A second clip in one iteration is not replayed (one factor per iteration): the
        iteration is refused."""
        if self.clip is not None:
            self.refuse(
                f"the gradients were clipped twice in iteration {self.next}; the shadow replays one clip "
                "coefficient per iteration: clip once, after the last backward"
            )
        self.clip = coef

    def clipped_params(self, scaled: set[int], coef: Any, params: list) -> None:
        """torch clipped the gradients of the parameters ``scaled`` (ids) by ``coef``
        (:mod:`trainer_hooks.session.clipping`); ``params``: the laid-out parameters. A clip
        of every one of them that has a gradient is recorded, one of some of them refuses
        the iteration, one of none of them (another model's) is not this recorder's."""
        with_grad = [p for p in params if p.grad is not None]
        hit = sum(id(p) in scaled for p in with_grad)
        if hit == 0:
            return  # another model's parameters
        if hit != len(with_grad):
            self.refuse(
                f"clip_grad_norm_ scaled {hit} of the {len(with_grad)} attached parameters that have gradients in "
                f"iteration {self.next}; the shadow replays one clip coefficient for all of them: clip "
                "model.parameters() (or the optimizer's parameters) in one call"
            )
            return
        self.clipped(coef)

    def refuse(self, why: str) -> None:
        """Iteration ``next`` cannot be replayed: its commit is refused (nothing of it is
        checkpointed) and the next step raises ``why``."""
        if self.refusal is None:
            self.refusal = why

    def unscaled(self, inv_scale: Any) -> None:
        """The GradScaler unscale factor (a tensor, or a number)."""
        self.inv_scale = inv_scale

    def read_probes(self, params: list) -> None:
        """Before the step: copy the probed gradients as the optimizer will use them
        (one small gather, non-blocking); the sender compares them with what was staged."""
        with self.lock:
            samples, self.samples = self.samples, []
        kept = [(i, e) for i, e in samples if params[i].grad is not None]
        if not kept:
            self.probes = None
            return
        grads = transfer.gather([params[i].grad.detach().reshape(-1)[e] for i, e in kept])
        self.probes = (kept, HostCopy(grads))

    # -- the step ----------------------------------------------------------------------------------------
    def advance(self) -> tuple[int, list]:
        """Close iteration k's bookkeeping: ``(k, elements sent per worker)``."""
        with self.lock:
            k, sent, self.sent = self.next, self.sent, [0] * len(self.sent)
            self.seen.clear()
            self.samples.clear()
            self.next = k + 1
        return k, sent

    def record(
        self,
        k: int,
        sent: list,
        skip: bool,
        grad_scale: Any,
        found_inf: Any,
        params: list,
        rank: int,
        audit: tuple | None = None,
    ) -> Commit:
        """The commit of iteration k (pending until the scheduler and scaler step).
        ``skip``: the step was skipped (known on the host); ``found_inf``: the tensor a
        fused optimizer skipped by (read later); ``audit``: ``(plan, sampled values)``."""
        replay = {
            "iteration": k,
            "rank": rank,
            "groups": _optim.wire_groups(self.optimizer),
            "skipped": [i for i, p in enumerate(params) if p.grad is None],
            "skip_step": bool(skip),
            "bootstrap": False,
            "tokens": int(self.options.tokens()) if self.options.tokens is not None else None,
        }
        scalars = {
            "clip": _scalar(self.clip),
            "inv_scale": _scalar(self.inv_scale),
            "grad_scale": _scalar(grad_scale),
            "found_inf": _scalar(found_inf),
        }
        self.clip = self.inv_scale = None
        refusal, self.refusal = self.refusal, None
        probes, self.probes = self.probes, None
        extra = HostCopy(self.options.extra_state() if self.options.extra_state is not None else None)
        rng = _rng.capture()
        self.last_record = (rng, extra)  # a resync bootstrap right after k records these, not later draws
        late = HostCopy({"scalars": scalars, "audit": None if audit is None else audit[1]})
        self.pending = Commit(k, replay, rng, extra, sent, None if audit is None else audit[0], late, probes, refusal)
        self.awaiting = set(self.options.observed) | self.holds
        if self._window:
            self.cadence = self.sched_count
        self._window, self.sched_count, self.early = True, 0, None
        return self.pending

    @property
    def ready(self) -> bool:
        """The pending commit may leave: the scheduler and scaler (if any) have stepped."""
        return not self.awaiting

    def take_ready(self) -> Commit | None:
        """The pending commit, taken, once it may leave (:attr:`ready`); None while it waits
        (it stays pending) or when none is pending."""
        return self.take_pending() if self.ready else None

    def take_pending(self) -> Commit | None:
        """The pending commit, taken whatever it still waits for (the next forward, step or
        close lets it go); None when none is pending."""
        pending, self.pending = self.pending, None
        return pending

    # -- the observers (trainer_hooks.session.observe) ----------------------------------------------
    def stepped(self, what: str) -> Stale | None:
        """The scheduler or scaler stepped: once all have, the pending commit may leave
        (:meth:`take_ready`).

        The scheduler counts as stepped once it has stepped as often as it did per optimizer
        step in the last whole window (once, until a window was counted; a scheduler stepped
        every other iteration, or per epoch: the commit leaves when the next forward or step
        begins).
        A scheduler that steps again after its commit left early made that commit's
        scheduler state stale: the :class:`Stale` returned says so (else None)."""
        if what == "scheduler":
            self.sched_count += 1
            if self.pending is None:
                if self.early is not None:
                    k, self.early = self.early, None
                    return Stale(
                        k,
                        f"the scheduler stepped {self.sched_count} times after optimizer step {k} (it had stepped "
                        f"{self.cadence} times per step): the state recorded with iteration {k} missed the last",
                    )
                return None
            if not self.cadence or self.sched_count < self.cadence:
                return None
        self.awaiting.discard(what)
        if not self.awaiting and "scheduler" in self.options.observed and self.pending is not None:
            self.early = self.pending.iteration
        return None

    def release(self, what: str, extra: Any = None) -> None:
        """The hold ``what`` (one of :attr:`holds`) is over for the pending commit (once
        nothing else holds it, it may leave: :meth:`take_ready`); with ``extra``, the
        commit carries that extra state instead of what was recorded at the step (the
        framework's loop state as it stands at the end of the batch)."""
        if self.pending is None or what not in self.awaiting:
            return
        if extra is not None:
            copy = HostCopy(extra)
            self.pending.extra = copy
            if self.last_record is not None:
                self.last_record = (self.last_record[0], copy)
        self.awaiting.discard(what)
        if not self.awaiting and "scheduler" in self.options.observed:
            self.early = self.pending.iteration  # a scheduler step from here on comes too late for it

    def window_closed(self) -> None:
        """The next forward or step began: a scheduler step from now on belongs to the next
        iteration's state."""
        self.early = None
