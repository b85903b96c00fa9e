"""Putting a trainer back at a checkpointed iteration. The plain torch state-dict form of
a checkpoint (what ``shadow restore ... format=torch`` writes) is
:func:`shadow.export.state.state_dicts`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shadow.config.tuning import Tuning
from shadow.core.errors import LayoutMismatchError, ShadowError, ShadowUsageError
from shadow.core.layout import Layout
from shadow.core.snapshot import Snapshot
from shadow.export.extras import recorded
from shadow.export.state import state_dicts
from trainer_hooks.capture import extras as _extras
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.capture import rng as _rng
from trainer_hooks.capture.model import LayoutError, build_layout, unwrap
from trainer_hooks.restorer import names as _names
from trainer_hooks.restorer.points import RESTORED, RestorePoint
from trainer_hooks.restorer.sink import ModelParams

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
    #: this rank's RNG states as checkpointed (``None``: the checkpoint has none for it).
    #: Applied by :func:`restore` unless ``defer_rng=True``; then :meth:`apply_rng` does it.
    rng: dict | None = field(default=None, repr=False)
    #: whether :func:`restore` applied :attr:`rng` (False with ``defer_rng=True`` until
    #: :meth:`apply_rng`)
    rng_applied: bool = False

    def apply_rng(self) -> None:
        """Set this process's RNGs (torch CPU and CUDA, Python ``random``, numpy's global
        generator) to the checkpointed states. For loops that draw from them between the
        restore and the point the checkpoint was taken at (building a DataLoader iterator,
        prefetching the next batch): restore with ``defer_rng=True``, build what draws,
        then call this. Once only: a second call would rewind the generators again."""
        if self.rng is None:
            raise ValueError(
                f"the checkpoint of job {self.job!r} at iteration {self.iteration} has no RNG state for "
                "this rank; nothing was changed"
            )
        if self.rng_applied:
            raise RuntimeError("the RNG states were applied already (apply_rng() runs once per restore)")
        _rng.restore(self.rng)
        self.rng_applied = True


def process_rank(rank: int | None, world: int) -> int:
    """This process's rank for a restore of a checkpoint taken with ``world`` ranks:
    ``rank`` if given, else the default process group's, else ``$RANK`` (set by torchrun
    and every launcher). A checkpoint of one rank needs none of them. Raises
    :class:`ValueError` when the rank cannot be told: giving rank 1 rank 0's RNG and extra
    state would resume it silently wrong."""
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        return rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"RANK={env!r} in the environment is not a rank (an integer >= 0); pass rank= to restore")
        return value
    if world <= 1:
        return 0
    raise ValueError(
        f"cannot tell which of the checkpoint's {world} ranks this process is: no process group is initialised "
        "and RANK is not set; call restore after init_process_group, run under a launcher that sets RANK "
        "(torchrun does), or pass rank=; nothing was changed"
    )


def current_world() -> int | None:
    """The number of ranks this process trains with: the default process group's size if
    one is initialised, else ``$WORLD_SIZE`` (torchrun and every launcher set it), else
    None (a single process outside any launcher: an evaluation or a conversion script)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return None
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"WORLD_SIZE={env!r} in the environment is not a world size (an integer >= 1)")
    return value


def check_world(saved: int, job: str, iteration: int, resize: bool, resharded: bool = False) -> int | None:
    """This run's world size once a checkpoint taken with ``saved`` ranks may be restored
    into it. Another size is refused (:class:`ShadowUsageError`, naming both; nothing
    changed) unless ``resize``: the data order and each rank's RNG and extra state belong
    to the ranks that took it, so the run would not be the one checkpointed. Every rank
    refuses alike (the sizes are the same on all of them). ``resharded``: an FSDP2 model,
    whose restore onto another mesh takes each rank's rows and is allowed as it is.
    None: the world is not known (no process group, no ``$WORLD_SIZE``)."""
    world = current_world()
    if world is None or world == saved or resharded:
        return world
    if not resize:
        raise ShadowUsageError(
            f"the checkpoint of job {job!r} at iteration {iteration} was taken with {saved} rank"
            f"{'s' if saved != 1 else ''}, and this run has {world}: resumed so, the data order and each "
            "rank's RNG and extra state would not be the checkpointed run's; relaunch with "
            f"{saved} ranks, or pass resize=True to restore the model, optimizer and scheduler onto {world} "
            "ranks anyway; nothing was changed"
        )
    kept = min(saved, world)
    logger.warning(
        "job %s iteration %d: restoring a %d-rank checkpoint onto %d ranks (resize=True): the model, optimizer "
        "and scheduler are restored; ranks 0-%d get their own RNG and extra state back%s",
        job,
        iteration,
        saved,
        world,
        kept - 1,
        (
            f", ranks {saved}-{world - 1} keep their RNG as it is and get the job-wide extra state"
            if world > saved
            else f"; the RNG and extra state of ranks {world}-{saved - 1} are dropped"
        ),
    )
    return world


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
    defer_rng: bool = False,
    resize: bool | None = None,
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
    :class:`shadow.config.tuning.Tuning` (default: :meth:`Tuning.load`, from the environment).
    ``sign_key``: the manifest key (``shadow.persist.signing.load_key(path)``) a persisted
    checkpoint's signature is checked with: one unsigned or failing it is never restored
    (default: the key file ``$SHADOW_MANIFEST_KEY`` names; none: signatures unchecked).

    ``rank``: this process's rank in the checkpointed job (which RNG states and extra state
    it gets). Default: the process group's if one is initialised, else ``$RANK`` (torchrun
    and other launchers set it); a multi-rank checkpoint restored where neither tells the
    rank is refused rather than given rank 0's state. ``defer_rng=True``: leave the RNGs
    alone and return their states in ``info.rng``; call ``info.apply_rng()`` once the loop
    has drawn what it draws before the point of the checkpoint (a prefetched batch, a new
    DataLoader iterator).

    ``resize``: a checkpoint taken with another number of ranks than this run has (the
    process group's size, else ``$WORLD_SIZE``). Default (None): restored (a process that
    inspects a checkpoint, a conversion), but :func:`attach` then refuses to train on from
    it, on every rank, naming both sizes: resumed so, the data order and each rank's RNG and
    extra state would not be the checkpointed run's. ``False``: refused here already
    (:func:`resume` does so). ``True``: restored for training on: the model, optimizer and
    scheduler, the ranks the checkpoint had get their RNG and extra state back, the others
    keep theirs (a warning says which), and attach goes on. An FSDP2 model restores onto any
    mesh as it is.
    """
    if source is None:
        raise ValueError("restore() needs source=, e.g. the coordinator address tcp://127.0.0.1:5555")
    if optimizer is None and not weights_only:
        raise ValueError("restore() needs the optimizer (or weights_only=True to restore only the model)")
    from shadow.restore import resolve  # here: the storage tiers' codecs load only when a restore runs

    sink, built, ranges = None, None, None
    if optimizer is not None:
        try:  # built once: the sink and apply_snapshot's match check share it
            built = build_layout(model, optimizer)
        except LayoutError:
            built = None  # apply_snapshot says what does not match
        if built is not None:  # a model on the CPU gets its parameters straight from the workers (memory only)
            sink = ModelParams.of(*built)
            if sink is not None and resize is False:
                sink.world = current_world()  # a checkpoint of another world is refused before any change
            ranges = _fsdp.rows_ranges(*built)  # FSDP2: a fetch from memory reads this rank's rows only
    try:
        snap = resolve(
            source,
            job=job,
            iteration=iteration,
            timeout=timeout,
            tuning=tuning,
            sign_key=sign_key,
            sink=sink,
            ranges=ranges,
        )
        return apply_snapshot(
            snap,
            model,
            optimizer,
            scheduler=scheduler,
            scaler=scaler,
            weights_only=weights_only,
            rank=rank,
            defer_rng=defer_rng,
            built=built,
            resize=resize,
        )
    except Exception:
        if sink is not None and sink.written:
            logger.error(
                "the restore failed after it had received checkpoint data into the model's parameters: they "
                "hold a checkpoint's parameters or part of them (the optimizer, buffers and RNG are unchanged); "
                "restore again before training on"
            )
        raise


def resume(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str,
    *,
    job: str | None = None,
    timeout: float | None = None,
    tuning: Tuning | None = None,
    sign_key: bytes | None = None,
    **restore_kwargs: Any,
) -> RestoreInfo | None:
    """:func:`restore` when ``source`` holds a checkpoint of job ``job``; None, changing
    nothing, when it holds none (a fresh start). One command line then serves a run's first
    launch and every relaunch (torchrun ``--max-restarts``, a Slurm requeue, a pod
    restart). Only a job the source does not know starts fresh (for a cluster: neither its
    memory nor any tier holds a checkpoint of it); one it holds but cannot restore raises,
    never starting over silently. ``restore_kwargs``: :func:`restore`'s (``scheduler``,
    ``scaler``, ``resize``, ``defer_rng``, ...)."""
    from shadow.restore import holds_job

    restore_kwargs.setdefault("resize", False)  # a resume: another world size is refused unless asked for
    if not holds_job(source, job, timeout, tuning, sign_key):
        logger.info("%s holds no checkpoint of job %s: a fresh start", source, job if job is not None else "(any)")
        return None
    return restore(
        model, optimizer, source, job=job, timeout=timeout, tuning=tuning, sign_key=sign_key, **restore_kwargs
    )


def apply_snapshot(
    snap: Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    weights_only: bool = False,
    rank: int | None = None,
    defer_rng: bool = False,
    built: tuple[Layout, list[torch.Tensor]] | None = None,
    resize: bool | None = None,
) -> RestoreInfo:
    """Load a :class:`shadow.restore.Snapshot` (from :func:`shadow.restore.resolve`) into
    ``model``/``optimizer``/``scheduler``/``scaler`` and this rank's RNG states; what
    :func:`restore` does once it has found the checkpoint. ``built``: the model and
    optimizer's ``(layout, params)`` when the caller has built them already (they are
    then not built again). ``resize``: as :func:`restore`'s."""
    rank = process_rank(rank, snap.world)
    params, lay, index = _live_params(snap, model, optimizer, built)
    if resize is not None and not weights_only and optimizer is not None:  # weights alone go onto any world
        check_world(snap.world, snap.job, snap.iteration, resize, resharded=_fsdp.is_sharded(params))
    sd = state_dicts(snap)
    if index is not None:  # by name: part of the checkpoint's parameters (a pipeline stage), or grouped otherwise
        sd = _names.subset(sd, snap.layout, lay, index)
    try:  # checked before any change (by name: the model's own extras, whatever the checkpoint's other stages hold)
        extras = _extras.load_plan(model, params, sd["model"], recorded(snap.extras) if index is None else None)
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
    rows = _fsdp.Rows.of(lay, params)  # DTensors: this rank's boxes of each tensor; else None
    if snap.ranges is not None and (rows is None or not rows.within(snap.ranges)):
        raise ShadowError(
            "the checkpoint was fetched for another rank's rows than this model holds; nothing was changed "
            "(restore again with this model and optimizer)"
        )
    with torch.no_grad():
        for i, (spec, p) in enumerate(zip(lay.params, params, strict=True)):
            saved = sd["model"][spec.name]
            if rows is not None:
                _fsdp.local(p).copy_(rows.take(i, saved))
            elif saved is not p:  # a parameter received in place is there already
                p.copy_(saved)
        for live, saved in extras:  # parameters in no param group (frozen) and persistent buffers
            live.copy_(saved)
    if optimizer is not None and not weights_only:
        optimizer.load_state_dict(_into_live(optimizer, params, sd["optimizer"], rows))
        if scheduler is not None and sd["scheduler"] is not None:
            scheduler.load_state_dict(sd["scheduler"])
        if scaler is not None and sd["scaler"] is not None:
            scaler.load_state_dict(sd["scaler"])
    extra = sd["extra_state_by_rank"][blob_rank] if blob_rank is not None else sd["extra_state"]
    restores_state = optimizer is not None and not weights_only
    rng = sd["rng"][blob_rank] if blob_rank is not None and restores_state else None
    if optimizer is not None and not weights_only:
        RESTORED[optimizer] = RestorePoint(
            snap.iteration,
            snap.job,
            snap.generation,
            snap.tier,
            snap.source,
            rng,
            extra,
            world=snap.world,
            resized=bool(resize) or _fsdp.is_sharded(params) or index is not None,
        )
    info = RestoreInfo(snap.iteration, extra, snap.job, snap.source, snap.tier, snap.world, rng)
    if rng is not None and not defer_rng:
        info.apply_rng()
    logger.info("restored iteration %d of job %s from %s (%s)", snap.iteration, snap.job, snap.source, snap.tier)
    return info


def _live_params(
    snap: Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    built: tuple[Layout, list[torch.Tensor]] | None,
) -> tuple[list[torch.Tensor], Layout, list[int] | None]:
    """The live parameters the snapshot's go into, once the model (and optimizer) match
    it: ``(params, their layout, None)`` in the snapshot's layout order; or, when the
    optimizer lays out part of the snapshot's parameters or groups them otherwise (a
    pipeline stage), ``(params, the optimizer's layout, the snapshot's index of each)``,
    matched by name (``trainer_hooks.restorer.names``). :class:`LayoutMismatchError`
    (nothing changed) otherwise."""
    if optimizer is not None:
        try:
            layout, params = built if built is not None else build_layout(model, optimizer)
        except LayoutError as exc:
            raise LayoutMismatchError(f"cannot restore: {exc}; nothing was changed") from None
        if layout.hash != snap.layout.hash:
            return params, layout, _names.match(snap.layout, layout, snap.job, snap.iteration)
        return params, snap.layout, None
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
    return params, snap.layout, None


def _into_live(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], saved: dict, rows: _fsdp.Rows | None = None
) -> dict:
    """``saved`` (the optimizer's state dict over the snapshot's flat arrays) with each
    tensor the optimizer already holds for that parameter and key, as ``load_state_dict``
    would make it (same shape, dtype and device), filled from the snapshot in place and put
    in its stead: ``load_state_dict`` then keeps the live tensor (``Tensor.to`` returns it
    as it is), so a restore into a trained optimizer allocates nothing and copies once. A
    tensor with no such live match stays the snapshot's view, made the parameter's dtype and
    device by ``load_state_dict`` as before. ``rows``: the parameters are FSDP2's DTensors;
    each per-element tensor becomes one placed as its parameter is, holding this rank's rows
    (into the live one's local tensor when there is one)."""
    flags = {}
    for g in saved["param_groups"]:
        for i in g["params"]:
            flags[i] = bool(g.get("fused") or g.get("capturable"))
    state: dict[int, dict] = {}
    with torch.no_grad():
        for i, entry in saved["state"].items():
            p, live = params[i], optimizer.state.get(params[i], {})
            out = dict(entry)
            for key, value in entry.items():
                cur = live.get(key)
                if rows is not None and isinstance(value, torch.Tensor) and key != "step":
                    out[key] = rows.place(i, value, cur)
                    continue
                if not (isinstance(cur, torch.Tensor) and isinstance(value, torch.Tensor)):
                    continue
                if key == "step":  # load_state_dict keeps it a float32 tensor, on the parameter's device if fused
                    want = (torch.float32, p.device if flags.get(i) else value.device)
                else:
                    want = (p.dtype if p.is_floating_point() else value.dtype, p.device)
                if cur.shape == value.shape and (cur.dtype, cur.device) == want and cur is not value:
                    cur.copy_(value)
                    out[key] = cur
            state[i] = out
    return {**saved, "state": state}
