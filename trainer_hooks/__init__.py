"""Trainer side of the shadow checkpoint service: attach a DDP training run, restore it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shadow.config.choices import Policy
from shadow.config.tuning import Tuning
from shadow.core.errors import (
    LayoutMismatchError,
    ShadowConnectionError,
    ShadowError,
    ShadowTimeoutError,
    ShadowUsageError,
)
from shadow.export import export, export_weights
from shadow.export.state import state_dicts
from trainer_hooks.optim.describe import UnsupportedOptimizerError
from trainer_hooks.restorer.restore import RestoreInfo, apply_snapshot, restore
from trainer_hooks.restorer.restore import resume as _resume
from trainer_hooks.session.metrics import serve_metrics
from trainer_hooks.session.options import AttachOptions
from trainer_hooks.session.session import Session


def attach(
    ddp_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    coordinator: str,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    extra_state: Callable[[], Any] | None = None,
    tokens: Callable[[], int] | None = None,
    job: str = "default",
    iteration: int | None = None,
    overwrite: bool = False,
    policy: str | Policy = "block",
    comm_hook: Callable | None = None,
    comm_state: Any = None,
    audit_every: int = 0,
    audit_strict: bool = False,
    exact: bool = True,
    tuning: Tuning | None = None,
    resume: bool | str = False,
    resize: bool = False,
) -> Session:
    """Stream every iteration of ``ddp_model``/``optimizer`` to the shadow cluster at
    ``coordinator``. Call on every rank, before the first backward; returns the rank's
    :class:`Session`.

    Args:
        ddp_model: the ``DistributedDataParallel``-wrapped model (the shadow takes DDP's
            reduced gradient buckets through a communication hook it registers once), or
            an FSDP2 model (``fully_shard`` applied to its root, with or without an HSDP
            mesh: each rank streams its own rows of the gradients as the step reads them;
            docs/fsdp.md).
        optimizer: the model's optimizer (``torch.optim.Adam``, ``AdamW``, ``Adamax`` or ``SGD``: those of
            :mod:`shadow.core.optimizers`).
        coordinator: the cluster's address, ``tcp://host:port``.
        scheduler: an LR scheduler (any ``torch.optim.lr_scheduler``); its state is
            checkpointed with every iteration and restored with the model.
        scaler: a ``torch.amp.GradScaler``; unscale factors and skipped steps are replayed.
        extra_state: a callable returning this rank's state to keep with each iteration
            (data-loader position, tokens seen); :func:`restore` returns it as
            ``extra_state``.
        tokens: a callable returning the tokens trained on so far (for ``every_tokens``
            tiers).
        job: the job's name in the cluster.
        iteration: the iteration the model is at. Default: the iteration :func:`restore`
            last put this optimizer at (``info.iteration``; a convenience: passing
            ``iteration=info.iteration`` says the same explicitly), else 0.
        overwrite: replace a job of the same name held at another iteration.
        policy: back-pressure. ``"block"``: every iteration is checkpointed; training
            waits for a slow shadow (the wait is in :meth:`Session.stats`). ``"skip"``:
            never waits; the shadow resyncs after falling behind.
        comm_hook: a DDP communication hook to compose with the shadow's (e.g.
            ``fp16_compress_hook``); it reduces, the shadow takes what it leaves.
        comm_state: the state ``comm_hook`` is called with.
        audit_every: every N steps compare a sample of parameters and moments with the
            shadow bit for bit (0: never).
        audit_strict: raise on an audit mismatch (at the next step) instead of logging it.
        exact: refuse, at attach, an optimizer the shadow cannot replay bit for bit on this
            machine (checked then: the trainer's own optimizer steps probes and the replay
            must reproduce every bit). ``exact=False`` attaches anyway: the shadow's state
            may then differ by a few ulp per step, the audit reports rather than fails, and
            ``shadow status`` and every checkpoint's manifest say ``bit_exact: false``.
        tuning: the knobs of this rank's session (a :class:`shadow.config.tuning.Tuning`: ring size,
            lag, timeouts, ...). Default: :meth:`Tuning.load`, each field from its
            ``SHADOW_<NAME>`` environment variable, else its default.
        resume: restore first, from the cluster at ``coordinator``, then attach at the
            restored iteration. ``"auto"``: when the cluster holds a checkpoint of ``job``
            (in memory or a tier), else start fresh, so that the same command line serves
            the first launch and every relaunch (torchrun ``--max-restarts``, a requeue);
            ``True``: always (no checkpoint is an error); ``False`` (default): never (call
            :func:`restore` yourself). What was restored is ``session.restored`` (a
            :class:`RestoreInfo`, ``None`` on a fresh start): go on from
            ``session.restored.iteration`` with its ``extra_state``. The RNG states are
            set here: a loop that draws before its first step after a restore (a prefetched
            batch) calls :func:`restore` with ``defer_rng=True`` itself instead.
        resize: with ``resume``: a checkpoint taken with another number of ranks is
            restored anyway (see :func:`restore`); otherwise it is refused on every rank.

    A failure of the shadow (a lost worker or coordinator, an error it reports, a stall
    past ``tuning.block_timeout_s``) never stops training: the rank trains on unprotected
    until the cluster resyncs, and counts it in ``session.stats()["shadow_errors"]``. Only
    what the training loop got wrong (:class:`ShadowUsageError`, e.g. a bucket reduced
    twice without ``no_sync``) or asked for (``audit_strict``) is raised, at the next
    ``optimizer.step()``, never from inside DDP.
    """
    if resume not in (False, True, "auto"):
        raise ValueError(f"resume={resume!r}: use 'auto' (restore when the cluster holds the job), True or False")
    restored = None
    if resume:
        restore_from = _resume if resume == "auto" else restore
        restored = restore_from(
            ddp_model, optimizer, coordinator, scheduler=scheduler, scaler=scaler, job=job, resize=resize
        )
    _check_resumed_world(ddp_model, optimizer, iteration, resize)
    options = AttachOptions(
        scheduler=scheduler,
        scaler=scaler,
        extra_state=extra_state,
        tokens=tokens,
        job=job,
        policy=policy,
        comm_hook=comm_hook,
        comm_state=comm_state,
        audit_every=audit_every,
        audit_strict=audit_strict,
        exact=exact,
        tuning=Tuning.load() if tuning is None else tuning,
    )
    session = Session(ddp_model, optimizer, coordinator, options, iteration=iteration, overwrite=overwrite)
    session.restored = restored
    return session


resume = _resume


def _check_resumed_world(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: Any, resize: bool
) -> None:
    """Refuse, on every rank, to go on from a restore of a checkpoint taken with another
    number of ranks than this DDP run has, unless ``resize`` (here or at the restore)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainer_hooks.restorer.points import RESTORED

    point = RESTORED.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if point is None or point.resized or resize or not isinstance(model, DistributedDataParallel):
        return
    if iteration is not None and int(iteration) != point.iteration:
        return  # not going on from that restore
    import torch.distributed as dist

    world = dist.get_world_size(model.process_group)
    if point.world and point.world != world:
        raise ShadowUsageError(
            f"the checkpoint of job {point.job!r} at iteration {point.iteration} was taken with {point.world} "
            f"rank{'s' if point.world != 1 else ''}, and this run has {world}: trained on so, the data order and "
            f"each rank's RNG and extra state would not be the checkpointed run's; relaunch with {point.world} "
            "ranks, or pass resize=True (to restore or to attach) to go on anyway; nothing was attached"
        )


__all__ = [
    "AttachOptions",
    "LayoutMismatchError",
    "RestoreInfo",
    "Session",
    "ShadowConnectionError",
    "ShadowError",
    "ShadowTimeoutError",
    "ShadowUsageError",
    "Tuning",
    "UnsupportedOptimizerError",
    "apply_snapshot",
    "attach",
    "export",
    "export_weights",
    "restore",
    "resume",
    "serve_metrics",
    "state_dicts",
]
