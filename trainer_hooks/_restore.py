"""Putting a trainer back at a checkpointed iteration. The plain torch state-dict form of
a checkpoint (what ``shadow restore ... format=torch`` writes) is
:func:`shadow.export.state.state_dicts`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shadow.errors import LayoutMismatchError
from shadow.export.extras import recorded
from shadow.export.state import state_dicts
from shadow.snapshot import Snapshot
from shadow.tuning import Tuning
from trainer_hooks import _extras, _rng
from trainer_hooks._model import LayoutError, build_layout, unwrap
from trainer_hooks._restored import RESTORED, RestorePoint
from trainer_hooks._sink import ModelParams

logger = logging.getLogger(__name__)


@dataclass
class RestoreInfo:
    """What :func:`restore` put back."""

    iteration: int
    extra_state: Any
    job: str
    source: str
    tier: str
    world: int


def restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    source: str | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    job: str | None = None,
    iteration: int | None = None,
    weights_only: bool = False,
    rank: int | None = None,
    timeout: float | None = None,
    tuning: Tuning | None = None,
    sign_key: bytes | None = None,
) -> RestoreInfo:
    """Put ``model`` (DDP-wrapped or not), ``optimizer``, ``scheduler`` and this rank's
    RNG states back at the newest complete checkpoint (or ``iteration``).

    ``source`` is a coordinator address (``tcp://host:port``: shadow memory first, then
    the local tier, then the remote tier; ``RestoreInfo.tier`` says which was used), a
    checkpoint directory, or an fsspec URL. Weights are restored first; with
    ``weights_only=True`` only the model is touched. Nothing is modified unless the
    checkpoint matches the model and optimizer exactly (for a model on the CPU restored from
    memory, the parameters are received straight into it once its layout is known to match;
    if every source then fails, it holds part of them and this raises). ``timeout`` bounds the wait for a
    coordinator (default ``tuning.connect_timeout_s``); ``tuning``: a
    :class:`shadow.tuning.Tuning` (default: :meth:`Tuning.load`, from the environment).
    ``sign_key``: the manifest key (``shadow.persist.signing.load_key(path)``) a persisted
    checkpoint's signature is checked with: one unsigned or failing it is never restored
    (default: the key file ``$SHADOW_MANIFEST_KEY`` names; none: signatures unchecked).
    """
    if source is None:
        raise ValueError("restore() needs source=, e.g. the coordinator address tcp://127.0.0.1:5555")
    if optimizer is None and not weights_only:
        raise ValueError("restore() needs the optimizer (or weights_only=True to restore only the model)")
    from shadow.restore import resolve  # here: the storage tiers' codecs load only when a restore runs

    sink = None
    if optimizer is not None:
        try:  # a model on the CPU gets its parameters straight from the workers (memory only)
            sink = ModelParams.of(*build_layout(model, optimizer))
        except LayoutError:
            sink = None  # apply_snapshot says what does not match
    try:
        snap = resolve(
            source, job=job, iteration=iteration, timeout=timeout, tuning=tuning, sign_key=sign_key, sink=sink
        )
        return apply_snapshot(
            snap, model, optimizer, scheduler=scheduler, scaler=scaler, weights_only=weights_only, rank=rank
        )
    except Exception:
        if sink is not None and sink.written:
            logger.error(
                "the restore failed after it had received checkpoint data into the model's parameters: they "
                "hold a checkpoint's parameters or part of them (the optimizer, buffers and RNG are unchanged); "
                "restore again before training on"
            )
        raise


def apply_snapshot(
    snap: Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    weights_only: bool = False,
    rank: int | None = None,
) -> RestoreInfo:
    """Load a :class:`shadow.restore.Snapshot` (from :func:`shadow.restore.resolve`) into
    ``model``/``optimizer``/``scheduler``/``scaler`` and this rank's RNG states; what
    :func:`restore` does once it has found the checkpoint."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if optimizer is not None:
        try:
            layout, params = build_layout(model, optimizer)
        except LayoutError as exc:
            raise LayoutMismatchError(f"cannot restore: {exc}; nothing was changed") from None
        if layout.hash != snap.layout.hash:
            raise LayoutMismatchError(
                f"the checkpoint of job {snap.job!r} at iteration {snap.iteration} "
                "does not match this model/optimizer: "
                f"{layout.describe_mismatch(snap.layout)}; nothing was changed"
            )
    else:
        named = dict(unwrap(model).named_parameters())
        params = []
        for spec in snap.layout.params:
            p = named.get(spec.name)
            if p is None or tuple(p.shape) != spec.shape:
                raise LayoutMismatchError(
                    f"the checkpoint's parameter {spec.name!r} {list(spec.shape)} has no match in this model; "
                    "nothing was changed"
                )
            params.append(p)
    sd = state_dicts(snap)
    try:
        extras = _extras.load_plan(model, params, sd["model"], recorded(snap.extras))  # checked before any change
    except LayoutMismatchError as exc:
        if not snap.placed:
            raise
        raise LayoutMismatchError(
            str(exc).replace("nothing was changed", "the parameters were received into the model already, the rest")
            + " was not changed"
        ) from None
    blob_rank = rank if rank in range(len(sd["rng"])) else None
    if blob_rank is None:
        logger.warning("checkpoint was taken with %d ranks; rank %d gets no RNG state", len(sd["rng"]), rank)
    with torch.no_grad():
        for spec, p in zip(snap.layout.params, params, strict=True):
            saved = sd["model"][spec.name]
            if saved is not p:  # a parameter received in place is there already
                p.copy_(saved)
        for live, saved in extras:  # parameters in no param group (frozen) and persistent buffers
            live.copy_(saved)
    if optimizer is not None and not weights_only:
        optimizer.load_state_dict(sd["optimizer"])
        RESTORED[optimizer] = RestorePoint(snap.iteration, snap.job, snap.generation, snap.tier, snap.source)
        if scheduler is not None and sd["scheduler"] is not None:
            scheduler.load_state_dict(sd["scheduler"])
        if scaler is not None and sd["scaler"] is not None:
            scaler.load_state_dict(sd["scaler"])
        if blob_rank is not None:
            _rng.restore(sd["rng"][blob_rank])
    extra = sd["extra_state_by_rank"][blob_rank] if blob_rank is not None else sd["extra_state"]
    logger.info("restored iteration %d of job %s from %s (%s)", snap.iteration, snap.job, snap.source, snap.tier)
    return RestoreInfo(snap.iteration, extra, snap.job, snap.source, snap.tier, snap.world)
