"""The jobs a cluster knows (``shadow jobs``), and dropping one whose trainers are gone
(``shadow drop``).

The coordinator holds one job at a time (:attr:`ClusterState.job`), and a job that has not
detached and whose ranks are heard from refuses another job name unless that attach asks for
``overwrite=True``. A job whose trainers crashed never detaches; once its ranks are silent it
blocks no one (the next job takes the memory over, its last iteration written to the local
tier first). :meth:`Jobs.on_drop` detaches it at once, as its ranks' ``close()`` would have: its epoch,
its committed cut in shadow memory (restorable until another job replaces it) and its
checkpoints in every tier are kept; only its hold on the cluster goes. A rank of a dropped
job heard again is answered ``degraded`` (it stops streaming and trains on unprotected) and
never ``resync``, which would re-attach it with ``overwrite``; it comes back by attaching
again (after a restore), as any job does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.queries import memory_info
from shadow.coordinator.records import JobRec, JobStatus
from shadow.coordinator.trainers import heard_window_s
from shadow.core.jobs import job_name_problem

logger = logging.getLogger(__name__)

Msg = dict[str, Any]

#: the bytes of rows one ``jobs_reply`` carries at most (its limit is 1 MiB); the held job's comes first
REPLY_BYTES = 768 << 10
#: a job name longer than this is left out of a ``jobs_reply`` (the reply's strings are limited to 16 KiB)
NAME_CHARS = 4096


class Jobs:
    """Handlers ``jobs`` (clients and admins) and ``drop`` (admins)."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence) -> None:
        self.state, self.out, self.persist = state, out, persist

    def on_jobs(self, env: list[bytes], msg: Msg) -> None:
        rows, left_out = jobs_view(self.state, self.persist)
        peer = self.state.sender
        if peer is not None and peer.jobs is not None:  # a job-scoped key: its jobs only
            rows = [r for r in rows if peer.may(r["name"])]
        self.out.reply(
            env,
            "jobs_reply",
            jobs=rows,
            window_s=heard_window_s(self.state.tuning),
            **({"left_out": left_out} if left_out else {}),
        )

    def on_drop(self, env: list[bytes], msg: Msg) -> None:
        """Detach job ``msg.job`` if its trainers are gone (no rank heard from within
        :func:`~shadow.coordinator.trainers.heard_window_s`), or with ``msg.force``."""
        st, name = self.state, msg["job"]
        problem = job_name_problem(name)
        if problem is not None:
            return self._refuse(env, name, problem)
        job = st.job
        if job is None or job.name != name:
            return self._refuse(env, name, self._not_held(name))
        committed = job.cut if job.cut >= job.base else None
        if job.status == JobStatus.DETACHED:
            text = (
                f"job {name!r} is already detached ({'dropped before' if job.dropped else 'its ranks closed'}); "
                "it blocks no other job: another job may attach"
            )
            self.out.reply(
                env, "drop_reply", job=name, epoch=job.epoch, committed=committed, forced=False, message=text
            )
            return
        now, window = time.monotonic(), heard_window_s(st.tuning)
        alive = job.ranks_heard(now, window)
        if alive and not msg["force"]:
            latest = now - max(job.last_heard(r) for r in alive)
            return self._refuse(
                env,
                name,
                f"job {name!r} is still heard from: {_ranks(alive, job.world)} sent a heartbeat within the last "
                f"{window:g} s (SHADOW_WORKER_LOST_S), the latest {latest:.1f} s ago; stop its trainers (or let "
                "them close their sessions) and drop it once they are gone, or drop it now with force=true (its "
                "live ranks then train on without new checkpoints)",
            )
        was = job.status.value
        forced = bool(alive)
        job.dropped = (
            f"job {name!r} was dropped from the shadow cluster (shadow drop{' force=true' if forced else ''}); its "
            "checkpoints are kept but no new ones are taken: restore and attach again to protect it"
        )
        job.status = JobStatus.DETACHED
        self.out.to_trainers(job, "degraded", epoch=job.epoch, reason=job.dropped)  # live ones stop streaming
        kept = "no checkpoint in memory" if committed is None else f"iteration {committed} in memory"
        text = (
            f"job {name!r} epoch {job.epoch} ({was}) detached"
            + (f", although {_ranks(alive, job.world)} still heartbeat" if forced else "")
            + f"; it keeps {kept} until another job attaches, and its checkpoints in the tiers; another job may "
            "now attach without overwrite=True"
        )
        logger.warning("%s (shadow drop by %s)", text, st.sender_role or "an unauthenticated peer")
        self.out.reply(env, "drop_reply", job=name, epoch=job.epoch, committed=committed, forced=forced, message=text)

    def _refuse(self, env: list[bytes], name: str, text: str) -> None:
        logger.warning("drop of job %r refused: %s", name[:200], text)
        self.out.reply(env, "error", code="refused", message=text)

    def _not_held(self, name: str) -> str:
        """Why the cluster cannot drop job ``name``, which it does not hold."""
        st, job = self.state, self.state.job
        held = "no job" if job is None else f"job {job.name!r} ({job.status.value})"
        p = st.pending.get(name)
        if p is not None:
            world = next(iter(p["ranks"].values()))[1]["world"]
            return (
                f"job {name!r} is not attached: its attach waits for its ranks ({len(p['ranks'])} of {world} "
                f"arrived) and blocks no other job; it ends by itself within SHADOW_CONNECT_TIMEOUT_S "
                f"({st.tuning.connect_timeout_s:g} s). The cluster holds {held}"
            )
        tiers = [t for t, s in self.persist.tiers.items() if name in s.complete]
        if tiers:
            return (
                f"the cluster holds {held}, not job {name!r}: that one is known only from its checkpoints in the "
                f"{' and '.join(tiers)} tier{'s' if len(tiers) > 1 else ''}, which block no attach (drop never "
                "deletes checkpoints)"
            )
        return f"the cluster holds {held}, and knows no job {name!r}; `shadow jobs` lists the jobs it knows"


def _ranks(ranks: list[int], world: int) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _row(name: str, status: str, restorable: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """One job of ``jobs_reply``: every row has the same keys (None where they do not apply)."""
    row: dict[str, Any] = {
        "name": name,
        "held": False,  # the job the cluster holds (the one that may block another)
        "status": status,
        "epoch": None,
        "world": None,
        "committed": None,
        "base": None,  # the iteration the held job's current epoch began at
        "generation": None,
        "ranks_heard": None,  # ranks heard from within window_s (attaching: ranks arrived)
        "last_heard_s": None,  # seconds since the newest heartbeat of any rank
        "trainers_gone": None,  # no rank heard from within window_s: shadow drop may detach it
        "dropped": "",
        "reason": "",
        "restorable": restorable,
    }
    row.update(fields)
    return row


def _held_row(st: ClusterState, persist: Persistence, job: JobRec, now: float) -> dict[str, Any]:
    heard = job.ranks_heard(now, heard_window_s(st.tuning))
    latest = max((job.last_heard(r) for r in range(job.world)), default=job.created)
    memory = memory_info(st, job.name)
    return _row(
        job.name,
        job.status.value,
        {"memory": memory["iteration"] if memory else None, **_stored(persist, job.name)},
        held=True,
        epoch=job.epoch,
        world=job.world,
        committed=job.cut if job.cut >= job.base else None,
        base=job.base,
        generation=job.generation,
        ranks_heard=len(heard),
        last_heard_s=round(now - latest, 3),
        trainers_gone=not heard,
        dropped=job.dropped,
        reason=job.reason if job.status == JobStatus.DEGRADED else "",
    )


def _stored(persist: Persistence, name: str) -> dict[str, Any]:
    """The newest complete checkpoint of job ``name`` in each tier, as the coordinator knows it."""
    return {tier: t.complete.get(name) for tier, t in persist.tiers.items()}


def jobs_view(st: ClusterState, persist: Persistence, budget: int = REPLY_BYTES) -> tuple[list[dict[str, Any]], int]:
    """What ``shadow jobs`` shows, and how many jobs known only from the tiers it left out:
    the job the cluster holds; the previous epoch's job while a new one bootstraps (its memory
    still answers restores: ``replaced``); attaches held for their ranks (``attaching``); then
    every other job whose checkpoints the tiers hold (``persisted``: what the coordinator's
    catalog of complete checkpoints knows, read at its start and kept as it writes; no tier is
    read for this), by name; in that order within ``budget`` bytes. Reads only."""
    now, job = time.monotonic(), st.job
    rows: list[dict[str, Any]] = []
    if job is not None:
        rows.append(_held_row(st, persist, job, now))
    retired = st.retired
    if retired is not None and job is not None and job.cut < job.base and retired["job"] != job.name:
        rows.append(
            _row(
                retired["job"],
                "replaced",
                {"memory": retired["iteration"], **_stored(persist, retired["job"])},
                epoch=retired["epoch"],
                world=retired["world"],
                committed=retired["iteration"],
                generation=retired["generation"],
                reason=f"its memory answers restores until job {job.name!r} holds its first iteration",
            )
        )
    for name, p in sorted(st.pending.items()):
        world = next(iter(p["ranks"].values()))[1]["world"]
        rows.append(
            _row(
                name,
                "attaching",
                {"memory": None, **_stored(persist, name)},
                world=world,
                ranks_heard=len(p["ranks"]),
                last_heard_s=round(now - p["since"], 3),
                reason=f"{len(p['ranks'])} of {world} ranks arrived; waiting for the rest or for the workers",
            )
        )
    listed = {r["name"] for r in rows}
    names = sorted({n for t in persist.tiers.values() for n in t.complete} - listed)
    rows += [_row(name, "persisted", {"memory": None, **_stored(persist, name)}) for name in names]
    kept: list[dict[str, Any]] = []
    used, left_out = 0, 0
    for row in rows:
        size = len(msgpack.packb(row))
        if len(row["name"]) > NAME_CHARS or used + size > budget:
            left_out += 1
            continue
        kept.append(row)
        used += size
    return kept, left_out
