"""What the framework integrations share to resume a run: whether the cluster knows the job,
and its newest checkpoint written in the framework's own format for this rank. Imports no
framework."""

from __future__ import annotations

import logging
import os
import tempfile

import torch.distributed as dist

from trainer_hooks._restored import RestorePoint

logger = logging.getLogger(__name__)


def job_known(coordinator: str, job: str, timeout: float) -> bool:
    """Whether the cluster holds job ``job``: in memory, or complete checkpoints in its tiers."""
    import zmq

    from shadow.client import dealer, request
    from shadow.wire import messages as M

    sock = dealer(zmq.Context.instance(), coordinator)
    try:
        reply = request(sock, coordinator, M.encode("jobs"), timeout, ("jobs_reply",))
    finally:
        sock.close(linger=0)
    return any(isinstance(j, dict) and j.get("name") == job for j in reply["jobs"]) or bool(reply.get("left_out"))


def write_resume(
    coordinator: str, job: str, timeout: float, directory: str | None, fmt: str, name: str
) -> tuple[str, RestorePoint] | None:
    """The newest checkpoint of ``job`` written in format ``fmt`` (:func:`shadow.export.export`)
    as ``<directory>/rank<r>/<name>`` (``{iteration}`` in ``name`` filled in; ``directory``
    default a new temporary one), and the restore point this rank's attach starts from; None
    when the cluster knows no such job (a fresh run). A job it knows but cannot restore is an
    error, never a fresh start."""
    from shadow.export import export
    from shadow.export.state import state_dicts
    from shadow.restore import resolve

    if not job_known(coordinator, job, timeout):
        logger.info("the cluster at %s holds no checkpoint of job %s: a fresh run", coordinator, job)
        return None
    snap = resolve(coordinator, job=job, timeout=timeout)
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
