"""Memory for a new job from jobs that ended: each is asked to write its last iteration to
the local tier, then stopped, and the jobs that waited for the room are admitted
(:func:`ask_for`, :func:`settle`; a shared cluster's front calls them)."""

from __future__ import annotations

import logging
import time
from typing import Any

from shadow.front.admission import Need

logger = logging.getLogger(__name__)

#: seconds an ended job is given to write its last iteration to the local tier before its
#: memory goes to a new job anyway
RECLAIM_S = 60.0
#: the most seconds an attach that does not fit waits for every job's next report before
#: it is refused (reports come every second)
SETTLE_S = 5.0


def ask_for(front: Any, job: str, need: Need) -> bool:
    """Ask ended jobs, oldest first, for their memory (and cores) until ``need`` fits:
    each writes its last iteration to the local tier, then stops (:func:`settle`).
    False when even all of them would not make room."""
    chosen: list[str] = []
    for b in [front.budget] + [a.budget for a in front.agents.values() if a.alive()]:
        free, cores = b.memory - b.used(), len(b.free_cores())
        ended = sorted(
            (p.since, j)
            for j, p in front.jobs.items()
            if p.ended_why and j not in front.reclaiming and front.budget_of(p) is b
        )
        chosen = []
        for _, j in ended:
            if free >= need.bytes and cores >= need.cores:
                break
            held, given = b.held[j]
            free, cores = free + held, cores + len(given)
            chosen.append(j)
        if free >= need.bytes and cores >= need.cores and (chosen or front.reclaiming):
            break
    else:
        across = _across_hosts(front, need)  # a job to spread: the room of every host together
        if across is None or not (across or front.reclaiming):
            return False
        chosen = across
    now = time.monotonic()
    for j in chosen:
        logger.info("job %r: asking ended job %r for its memory (its last iteration to the tier first)", job, j)
        front.jobs[j].ask_last()
        front.reclaiming[j] = now
    return True


def settle(front: Any, now: float) -> None:
    """End the jobs asked for their memory once their last iteration is on the local tier
    (or after :data:`RECLAIM_S`); a job whose trainers came back keeps it. Then admit the
    jobs that waited."""
    for j, since in list(front.reclaiming.items()):
        procs = front.jobs.get(j)
        if procs is None or not procs.ended_why:
            del front.reclaiming[j]  # ended otherwise, or its trainers are back: it keeps its memory
            continue
        rep = procs.report()
        kept = bool(rep and rep.get("last_kept")) or not front.cfg.persist.local.enabled
        if kept or now - since > RECLAIM_S:
            if not kept:
                logger.warning("job %r: its last iteration was not on the local tier after %.0f s", j, RECLAIM_S)
            del front.reclaiming[j]
            front.end(j, "its memory went to a new job")
    if front.reclaiming:
        return
    for job, (env, msg, since) in list(front.admitting.items()):
        reports = [p.report() for p in front.jobs.values()]
        if since and time.time() - since < SETTLE_S and any(r is None or r["time"] <= since for r in reports):
            continue  # a job's next report may say it ended
        del front.admitting[job]
        front.admit(env, job, msg, settled=True)


def _across_hosts(front: Any, need: Need) -> list[str] | None:
    """Ended jobs, oldest first, whose memory on every live host together makes room for
    ``need`` beside what is free there (a job the front spreads over hosts); None when even
    all of them do not."""
    budgets = [front.budget] + [a.budget for a in front.agents.values() if a.alive()]
    free = sum(b.memory - b.used() for b in budgets)
    chosen = []
    for _, j in sorted((p.since, j) for j, p in front.jobs.items() if p.ended_why and j not in front.reclaiming):
        if free >= need.bytes:
            break
        free += sum(b.held[j][0] for b in budgets if j in b.held)
        chosen.append(j)
    return chosen if free >= need.bytes else None
