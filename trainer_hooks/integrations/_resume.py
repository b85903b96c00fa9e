"""What the framework integrations share to resume a run: whether the cluster knows the job,
and its newest checkpoint written in the framework's own format for this rank. Imports no
framework."""

from __future__ import annotations

import logging
import os
import tempfile

import torch.distributed as dist

from trainer_hooks._restore import check_world
from trainer_hooks._restored import RestorePoint

logger = logging.getLogger(__name__)


def write_resume(
    coordinator: str, job: str, timeout: float, directory: str | None, fmt: str, name: str, resize: bool = False
) -> tuple[str, RestorePoint] | None:
    """The newest checkpoint of ``job`` written in format ``fmt`` (:func:`shadow.export.export`)
    as ``<directory>/rank<r>/<name>`` (``{iteration}`` in ``name`` filled in; ``directory``
    default a new temporary one), and the restore point this rank's attach starts from; None
    when the cluster knows no such job (a fresh run). A job it knows but cannot restore is an
    error, never a fresh start. A checkpoint taken with another number of ranks is refused
    on every rank unless ``resize`` (:func:`trainer_hooks.restore`)."""
    from shadow.export import export
    from shadow.export.state import state_dicts
    from shadow.restore import holds_job, resolve

    if not holds_job(coordinator, job, timeout):
        logger.info("the cluster at %s holds no checkpoint of job %s: a fresh run", coordinator, job)
        return None
    snap = resolve(coordinator, job=job, timeout=timeout)
    check_world(snap.world, job, snap.iteration, resize)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    base = directory or tempfile.mkdtemp(prefix=f"shadow-{job}-")
    out = os.path.join(base, f"rank{rank}", name.format(iteration=snap.iteration))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    export(snap, out, fmt)
    sd = state_dicts(snap)
    rng = sd["rng"][rank] if rank < len(sd["rng"]) else None
    extra = sd["extra_state_by_rank"][rank] if rank < len(sd["extra_state_by_rank"]) else sd["extra_state"]
    point = RestorePoint(snap.iteration, snap.job, snap.generation, snap.tier, snap.source, rng, extra)
    logger.info("job %s iteration %d written (%s) to resume from: %s", job, snap.iteration, fmt, out)
    return out, point
