"""Where a shared cluster's job runs: on one host when one has room for it (the one with the
most memory free among those), else spread over several, its coordinator on the host with
the most room and its worker slots divided among the hosts (:func:`place`).

A spread job's first part runs its coordinator and that host's slots; each other part is a
``shadow cluster coordinator=...`` of that host's slots alone (workers only), started once
the coordinator's address is known and started again if that address changes
(:func:`tend`). Slots are handed out in order, at most one replica of each shard per host
where the hosts allow it (a shard's worker ``i`` holds shard ``i % shards``), so that a
host lost costs no shard both of its replicas. A part that exits ends its job, as a job's
coordinator exiting does: the job's memory is no longer whole."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from shadow.front.admission import Budget, Need, gb
from shadow.front.agents import AgentRec, RemoteProcs
from shadow.front.jobs import START_TRIES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Part:
    """One host's share of a job: ``where`` ("" the front's own host, else an agent's name),
    the worker ``slots`` it runs (empty: all of them), the ``cores`` given to it there, and
    what it holds (``need``)."""

    where: str
    slots: tuple[int, ...]
    cores: tuple[int, ...]
    need: Need


def place(
    job: str, need: Need, optim: str, ended: dict[str, str], local: Budget, agents: dict[str, AgentRec]
) -> list[Part] | str:
    """The parts of ``job``, the first running its coordinator, their memory and cores taken
    from the hosts' budgets; or why no host, nor all of them together, takes it (the figures
    of each)."""
    now = time.monotonic()
    hosts: list[tuple[str, Budget, Need]] = [("", local, need)]
    hosts += [
        (name, a.budget, dataclasses.replace(need, cores=a.cores_per_job))
        for name, a in sorted(agents.items())
        if a.alive(now)
    ]
    hosts.sort(key=lambda h: -(h[1].memory - h[1].used()))
    refusals = []
    for name, budget, n in hosts:
        given = budget.admit(job, n, optim, {j: w for j, w in ended.items() if j in budget.held})
        if not isinstance(given, str):
            return [Part(name, (), given, n)]
        refusals.append((name, given))
    if len(hosts) > 1 and need.workers > 1:
        shards = need.workers // need.replicas
        for cap in (shards, need.workers) if need.replicas > 1 else (need.workers,):
            parts = _spread(job, optim, hosts, cap)
            if parts:
                return parts
    if len(refusals) == 1:
        return refusals[0][1]
    lines = "; ".join(
        f"{'host ' + name if name else 'the front'}: {why.split(' refused: ', 1)[-1]}" for name, why in refusals
    )
    one = need.part(1)
    return (
        f"attach of job {job!r} refused: no host of this shared cluster has room for it ({lines}); nor have all "
        f"of them together: each of its {need.workers} workers needs {gb(one.bytes)}"
        + (f" and {one.cores} cores" if one.cores else "")
    )


def _spread(job: str, optim: str, hosts: list[tuple[str, Budget, Need]], cap: int) -> list[Part] | None:
    """``job``'s slots over ``hosts`` in their order, at most ``cap`` on each; None when they
    do not all find room."""
    left, plan = hosts[0][2].workers, []
    for name, budget, n in hosts:
        free = budget.memory - budget.used()
        k = min(left, cap)
        while k and n.part(k).bytes > free:
            k -= 1
        if k and n.cores > len(budget.free_cores()):
            k = 0
        if k:
            plan.append((name, budget, n.part(k)))
            left -= k
    if left:
        return None
    parts, slot = [], 0
    for name, budget, part in plan:
        given = budget.admit(job, part, optim, {})
        assert not isinstance(given, str)  # (it was checked to fit just now)
        parts.append(Part(name, tuple(range(slot, slot + part.workers)), given, part))
        slot += part.workers
    return parts


def where(procs: Any) -> str:
    return f"host {procs.where}" if isinstance(procs, RemoteProcs) else "the front's host"


def tend(front: Any) -> None:
    """Start each spread job's parts once its coordinator's address is known (again when it
    changes), and end a job whose part exited."""
    for job, parts in list(front.parts.items()):
        head = front.jobs.get(job)
        if head is None:
            continue
        if isinstance(head, RemoteProcs):
            head.report()  # the port its agent reports
        address = head.address if head.port else ""
        for p in parts:
            if isinstance(p, RemoteProcs):
                p.report()  # its pid, as its agent reports it
            if address and p.join != address:
                logger.info("job %r: its workers on %s join its coordinator at %s", job, where(p), address)
                if not isinstance(p, RemoteProcs) and p.proc is not None:
                    p.stop()
                p.join = address
                if not isinstance(p, RemoteProcs):
                    p.start()
                continue
            code = p.exited() if p.join else None
            if code is None:
                continue
            if not isinstance(p, RemoteProcs) and not p.reported and p.tries < START_TRIES:
                logger.warning("job %r: its workers on %s exited (%s) before they came up; again", job, where(p), code)
                p.start()
                continue
            logger.error("job %r: its workers on %s exited with status %s; its memory is lost", job, where(p), code)
            front.end(job, f"its workers on {where(p)} exited")
            break
