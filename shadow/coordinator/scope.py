"""Job-scoped roles at the coordinator: a trainer's or a client's key limited to named jobs
(:class:`shadow.security.Peer`, from the subdirectory of its role's allow directory that
holds its public half) reads and acts on those jobs only.

Every message such a peer sends is checked once it is decoded (:func:`problem`): a message
that names a job (an attach, a ``restore_info`` or ``catalog`` for a job) or the epoch of
the job the cluster holds (a trainer's heartbeat, ``detach``, ``paused``, ``lagging``,
``replica_from``) is refused unless that job is in the peer's scope, and counted by role
under ``scope``. What names no job is answered with the peer's jobs only: ``status`` shows
the cluster, and the held job only if it is one of them (:func:`status`); ``jobs`` and a
``catalog`` of every job list its jobs only (the handlers filter with
:meth:`~shadow.security.Peer.may`). ``drop`` is an admin's, and admin keys are never scoped.
"""

from __future__ import annotations

from typing import Any

from shadow.coordinator.cluster import ClusterState
from shadow.security import Peer

#: messages that name the held job by its epoch (the rank's session)
_BY_EPOCH = ("detach", "replica_from", "lagging", "paused", "trainer_hb")
#: what each checked message does, for the refusal
_VERBS = {
    "attach": "attach to",
    "restore_info": "restore",
    "catalog": "list the checkpoints of",
    "detach": "detach from",
    "replica_from": "stream to",
    "lagging": "report on",
    "paused": "report on",
    "trainer_hb": "train",
}


def named_job(st: ClusterState, kind: str, msg: dict[str, Any]) -> str | None:
    """The job message ``msg`` of type ``kind`` reads or acts on, or None if it names none
    (a message for an epoch the cluster no longer holds names none: it is answered with
    that, and nothing else)."""
    job = st.job
    if kind == "attach":
        return msg["job"]
    if kind == "restore_info":  # no job named: the held one
        return msg["job"] if msg["job"] is not None else (job.name if job is not None else None)
    if kind == "catalog":
        return msg["job"]
    if kind in _BY_EPOCH and job is not None:
        if msg["epoch"] == job.epoch or (kind == "trainer_hb" and msg["job_id"] == job.job_id):
            return job.name
    return None


def problem(st: ClusterState, kind: str, msg: dict[str, Any], peer: Peer) -> str | None:
    """Why a message from ``peer`` (a job-scoped key) is refused, or None if it may go on."""
    if peer.jobs is None:
        return None
    name = named_job(st, kind, msg)
    if name is None or peer.may(name):
        return None
    return (
        f"this {peer.role} key is limited to jobs {', '.join(peer.jobs)}: it may not {_VERBS.get(kind, 'act on')} "
        f"job {name!r} (use a key of that job, or ask the cluster's admin to put this key's public half in "
        f"security.allow_{peer.role}s/{name}/)"
    )


def status(view: dict[str, Any], peer: Peer | None) -> dict[str, Any]:
    """``view`` (:func:`~shadow.coordinator.queries.status_view`) as ``peer`` may see it: a
    job-scoped peer sees the cluster (workers, tiers' schedules), and the held job, what is
    restorable and each worker's part in it only if the job is one of its."""
    if peer is None or peer.jobs is None:
        return view
    job = view.get("job")
    if job is not None and peer.may(job["name"]):
        return view
    out = dict(view)
    out["job"] = None
    out.pop("restorable", None)
    out["attach_pending"] = {"jobs": 0, "ranks": 0, "bytes": 0}
    out["persist"] = {n: {"root": t.get("root"), "schedule": t.get("schedule")} for n, t in view["persist"].items()}
    job_fields = ("start", "stop", "applied", "prepared", "seen")
    out["workers"] = [
        {**w, **dict.fromkeys(job_fields), **({"stale": ""} if "stale" in w else {})} for w in view["workers"]
    ]
    return out
