"""What the framework integrations share to resume a run: whether the cluster knows the job,
and its newest checkpoint written in the framework's own format for this process, with every
rank's own part (RNG, extra state) kept aside until the process knows its rank. Imports no
framework."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from trainer_hooks.restorer.points import RestorePoint
from trainer_hooks.restorer.restore import check_world

logger = logging.getLogger(__name__)


def process_label() -> str:
    """The name of this process's directory under a resume directory: ``rank<r>`` when the
    rank is known (a process group, or ``$RANK`` as torchrun sets it), else
    ``node<n>-local<l>`` from ``$NODE_RANK`` (or ``$GROUP_RANK``) and ``$LOCAL_RANK``, each 0
    when unset. A launcher that starts the other ranks from inside the script (Lightning's
    own, ``Trainer(devices=2)`` run as ``python train.py``) sets no ``$RANK``: its first
    process has none of them set yet, the others ``$LOCAL_RANK`` and ``$NODE_RANK``."""
    if dist.is_available() and dist.is_initialized():
        return f"rank{dist.get_rank()}"
    env = os.environ
    if env.get("RANK", "").isdigit():
        return f"rank{int(env['RANK'])}"
    node = env.get("NODE_RANK") or env.get("GROUP_RANK") or "0"
    local = env.get("LOCAL_RANK") or "0"
    return f"node{int(node) if node.isdigit() else node}-local{int(local) if local.isdigit() else local}"


def known_rank() -> int | None:
    """This process's rank where it is known before the framework sets its process group up:
    the default process group's, else ``$RANK``; None otherwise."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK", "")
    return int(env) if env.isdigit() else None


@dataclass
class Resumed:
    """A checkpoint written to resume from (:func:`write_resume`): the file or directory the
    framework loads (the same for every rank), and every rank's own part, chosen with
    :meth:`point` once the process knows its rank (the framework's process group is up)."""

    path: str
    iteration: int
    job: str
    generation: int
    tier: str
    source: str
    world: int  #: the ranks the checkpoint was taken with
    resize: bool
    world_checked: bool  #: whether the world size was known, and checked, when it was written
    rngs: list = field(repr=False)
    extras: list = field(repr=False)
    extra: Any = field(default=None, repr=False)  #: the job-wide extra state (rank 0's)
    temporary: str | None = None  #: the directory write_resume made (removed by remove()); None: the caller's

    def point(self, rank: int) -> RestorePoint:
        """The restore point of rank ``rank``: its own RNG and extra state as checkpointed (a
        rank the checkpoint did not have, with ``resize``: no RNG and the job-wide extra
        state). Checks the world size first where it was not known when the checkpoint was
        written (:func:`trainer_hooks.restorer.restore.check_world`)."""
        if not self.world_checked:
            self.world_checked = check_world(self.world, self.job, self.iteration, self.resize) is not None
        rng = self.rngs[rank] if rank < len(self.rngs) else None
        extra = self.extras[rank] if rank < len(self.extras) else self.extra
        return RestorePoint(self.iteration, self.job, self.generation, self.tier, self.source, rng, extra)

    def remove(self) -> None:
        """Remove the temporary directory the checkpoint was written to, once the framework
        has loaded it (a directory the caller named is the caller's: kept). Idempotent."""
        tmp, self.temporary = self.temporary, None
        if tmp is None:
            return
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info("removed %s: the checkpoint of job %s iteration %d is loaded", tmp, self.job, self.iteration)


def write_resume(
    coordinator: str, job: str, timeout: float, directory: str | None, fmt: str, name: str, resize: bool = False
) -> Resumed | None:
    """The newest checkpoint of ``job`` written in format ``fmt`` (:func:`shadow.export.export`)
    as ``<directory>/<process>/<name>`` (``{iteration}`` in ``name`` filled in; ``<process>``:
    :func:`process_label`; ``directory`` default a new temporary one, which
    :meth:`Resumed.remove` removes), and every rank's own part of it; None when the cluster
    knows no such job (a fresh run). A job it knows but cannot restore is an error, never a
    fresh start. A checkpoint taken with another number of ranks is refused on every rank
    unless ``resize`` (:func:`trainer_hooks.restore`); where the world size is not known yet,
    at :meth:`Resumed.point`."""
    from shadow.export import export
    from shadow.export.state import state_dicts
    from shadow.restore import holds_job, resolve

    if not holds_job(coordinator, job, timeout):
        logger.info("the cluster at %s holds no checkpoint of job %s: a fresh run", coordinator, job)
        return None
    snap = resolve(coordinator, job=job, timeout=timeout)
    checked = check_world(snap.world, job, snap.iteration, resize) is not None
    temporary = None if directory else tempfile.mkdtemp(prefix=f"shadow-{job}-")
    base = directory or temporary
    assert base is not None
    try:
        out = os.path.join(base, process_label(), name.format(iteration=snap.iteration))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        export(snap, out, fmt)
    except BaseException:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    sd = state_dicts(snap)
    logger.info("job %s iteration %d written (%s) to resume from: %s", job, snap.iteration, fmt, out)
    return Resumed(
        out,
        snap.iteration,
        snap.job,
        snap.generation,
        snap.tier,
        snap.source,
        snap.world,
        resize,
        checked,
        list(sd["rng"]),
        list(sd["extra_state_by_rank"]),
        sd["extra_state"],
        temporary,
    )
