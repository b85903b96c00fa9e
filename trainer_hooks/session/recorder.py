"""Per-step bookkeeping of one rank: which iteration is in progress, what the comm hook
staged for it (elements per worker, buckets seen, gradient probes), the transforms the loop
applied (clip coefficient, GradScaler unscale, a skipped step), and, at the step, the
commit record of iteration k: what the workers need to replay it (hyperparameters as
used, skipped params, clip and scaler factors) and what a restore needs besides the
arrays (RNG, extra state). No sockets: the session sends what it records."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shadow.errors import ShadowUsageError
from trainer_hooks import _optim, _rng
from trainer_hooks.session.options import AttachOptions


@dataclass
class Commit:
    """Iteration k as recorded at its step, waiting to be sent."""

    iteration: int
    replay: dict
    rng: dict
    extra: Any
    sent: list  # elements staged per worker
    audit: list | None = None


class StepRecorder:
    """Bookkeeping for the iteration in progress (``next``) and the last one recorded.

    The comm hook's thread and the training thread both touch the per-iteration fields:
    the hook holds :attr:`lock` while it stages a bucket (:meth:`bucket`, :meth:`staged`).
    ``on_ready``: the pending commit may leave (the scheduler and scaler have stepped);
    ``on_skipped``: GradScaler skipped ``optimizer.step()`` (inf/nan gradients).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, options: AttachOptions, *,
                 on_ready: Callable[[], None], on_skipped: Callable[[], None]) -> None:
        self.optimizer, self.options = optimizer, options
        self.on_ready, self.on_skipped = on_ready, on_skipped
        self.lock = threading.Lock()
        self.next = 1  # the iteration in progress
        self.sent: list[int] = []  # elements staged per worker in this iteration
        self.seen: set[int] = set()  # buckets reduced in this iteration
        self.samples: list = []  # (param index, element, reduced value), checked at the step
        self.clip: float | None = None  # clip coefficient of this iteration
        self.inv_scale: float | None = None  # GradScaler unscale factor of this iteration
        self.pending: Commit | None = None  # recorded, waiting for the scheduler/scaler to step
        self.awaiting: set[str] = set()
        self.last_record: tuple[dict, Any] | None = None  # (rng, extra) of the newest record

    def start(self, base: int, nworkers: int) -> None:
        """A new attachment at iteration ``base``: iteration ``base + 1`` is next."""
        with self.lock:
            self.next = base + 1
            self.sent = [0] * nworkers
            self.seen.clear()
            self.samples.clear()
        self.clip = self.inv_scale = None
        self.pending, self.awaiting = None, set()

    # -- the comm hook (caller holds the lock) ------------------------------------------------------
    def bucket(self, index: int) -> int:
        """Bucket ``index`` was reduced: the iteration it belongs to. Reduced twice
        without a step is the loop's mistake (:class:`ShadowUsageError`)."""
        if index in self.seen:
            raise ShadowUsageError(
                f"bucket {index} was all-reduced twice in iteration {self.next} without an optimizer step; "
                "accumulate gradients inside `with ddp_model.no_sync():` for all but the last micro-batch")
        self.seen.add(index)
        return self.next

    def staged(self, counts: list[int], samples: list) -> None:
        """A bucket's stripe was staged: ``counts`` elements per worker, gradient probes."""
        for w, c in enumerate(counts):
            self.sent[w] += c
        self.samples.extend(samples)

    # -- what the loop did to the gradients ----------------------------------------------------------
    def clipped(self, coef: float) -> None:
        self.clip = coef

    def unscaled(self, inv_scale: float) -> None:
        self.inv_scale = inv_scale

    def factors(self) -> list[float]:
        """What the reduced gradients were multiplied by before the step, in order."""
        return [f for f in (self.inv_scale, self.clip) if f is not None]

    def take_samples(self) -> list:
        with self.lock:
            samples, self.samples = self.samples, []
        return samples

    # -- the step ----------------------------------------------------------------------------------------
    def advance(self) -> tuple[int, list]:
        """Close iteration k's bookkeeping: ``(k, elements sent per worker)``."""
        with self.lock:
            k, sent, self.sent = self.next, self.sent, [0] * len(self.sent)
            self.seen.clear()
            self.samples.clear()
            self.next = k + 1
        return k, sent

    def record(self, k: int, sent: list, skip: bool, grad_scale: Any, params: list, rank: int,
               audit: list | None = None) -> Commit:
        """The commit of iteration k (pending until the scheduler and scaler step)."""
        replay = {"iteration": k, "rank": rank, "groups": _optim.replay_groups(self.optimizer),
                  "skipped": [i for i, p in enumerate(params) if p.grad is None],
                  "clip": self.clip, "inv_scale": self.inv_scale,
                  "grad_scale": None if grad_scale is None else float(torch.as_tensor(grad_scale).float().item()),
                  "skip_step": bool(skip), "bootstrap": False,
                  "tokens": int(self.options.tokens()) if self.options.tokens is not None else None}
        self.clip = self.inv_scale = None
        extra = self.options.extra_state() if self.options.extra_state is not None else None
        rng = _rng.capture()
        self.last_record = (rng, extra)  # a resync bootstrap right after k records these, not later draws
        self.pending = Commit(k, replay, rng, extra, sent, audit)
        self.awaiting = set(self.options.observed)
        return self.pending

    @property
    def ready(self) -> bool:
        """The pending commit may leave: the scheduler and scaler (if any) have stepped."""
        return not self.awaiting

    def take_pending(self) -> Commit | None:
        pending, self.pending = self.pending, None
        return pending

    # -- the observers (trainer_hooks.session.observe) ----------------------------------------------
    def stepped(self, what: str) -> None:
        """The scheduler or scaler stepped: once all have, the pending commit leaves."""
        self.awaiting.discard(what)
        if not self.awaiting:
            self.on_ready()

    def skipped_step(self) -> None:
        """The scaler stepped and the optimizer did not: iteration ``next`` was skipped."""
        self.on_skipped()
