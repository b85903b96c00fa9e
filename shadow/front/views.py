"""What a shared cluster's front shows: ``shadow status`` (its hosts' budgets and each
job) and ``shadow jobs`` (every job, running or in the tiers), from what each job's
coordinator reports."""

from __future__ import annotations

import time
from typing import Any

from shadow.coordinator.jobs import jobs_view
from shadow.front import report
from shadow.front.agents import RemoteProcs
from shadow.security import Peer


def status(front: Any, peer: Peer | None = None) -> dict[str, Any]:
    """The front's status: its own host's budget, each agent's, and each job the peer may see."""
    b = front.budget
    rows = []
    for job, procs in sorted(front.jobs.items()):
        if peer is not None and not peer.may(job):
            continue
        rep = procs.report()
        remote = isinstance(procs, RemoteProcs)
        parts = front.parts.get(job, [])
        rows.append(
            {
                "name": job,
                "address": procs.address,
                "host": procs.where if remote else "",
                "pid": _pid(procs),
                "memory_bytes": sum(p.need.bytes for p in [procs, *parts]),
                "cores": list(procs.cores),
                # a job spread over hosts: each host's worker slots (the coordinator's host first)
                "parts": [
                    {"host": p.where if isinstance(p, RemoteProcs) else "", "slots": list(p.slots), "pid": _pid(p)}
                    for p in ([procs, *parts] if parts else [])
                ],
                "up_s": round(time.monotonic() - procs.since, 1),
                "ended": procs.ended_why,
                "status": rep["status"] if rep else None,
            }
        )
    now = time.monotonic()
    agents = [
        {
            "name": name,
            "host": a.host,
            "alive": a.alive(now),
            "heard_s": round(now - a.heard, 1),
            "memory_bytes": a.budget.memory,
            "used_bytes": a.budget.used(),
            "cores": len(a.budget.cores),
            "free_cores": len(a.budget.free_cores()),
            "cores_per_job": a.cores_per_job,
            "jobs": sorted(j for j in a.budget.held if peer is None or peer.may(j)),
        }
        for name, a in sorted(front.agents.items())
    ]
    return {
        "front": {
            "memory_bytes": b.memory,
            "used_bytes": b.used(),
            "cores": len(b.cores),
            "free_cores": len(b.free_cores()),
            "cores_per_job": front.cfg.cores_per_job,
            "workers_per_job": front.cfg.workers,
            "refused": front.refused,
            "agents": agents,
        },
        "jobs": rows,
    }


def _pid(procs: Any) -> int | None:
    if isinstance(procs, RemoteProcs):
        return procs.pid
    return procs.proc.pid if procs.proc is not None else None


def jobs_rows(front: Any, peer: Peer | None) -> list[dict]:
    """``shadow jobs`` of a shared cluster: the jobs it runs first, then those only the tiers hold."""
    rows: dict[str, dict] = {}
    for job, procs in front.jobs.items():
        rep = procs.report()
        own = None
        for row in rep["jobs"] if rep else []:
            if row["name"] == job:
                own = row
            elif row["name"] not in front.jobs:
                rows.setdefault(row["name"], row)  # a job known from the tiers (every coordinator lists it)
        rows[job] = own or report.starting_row(job, procs.address)
    for row in jobs_view(front.nobody, front.tiers)[0]:  # what the tiers hold, as the front read them
        if row["name"] not in front.jobs:
            rows[row["name"]] = row
    visible = [r for n, r in sorted(rows.items()) if peer is None or peer.may(n)]
    return [r for r in visible if r["name"] in front.jobs] + [r for r in visible if r["name"] not in front.jobs]
