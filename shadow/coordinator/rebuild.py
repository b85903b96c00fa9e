"""Rebuilding the coordinator's view from the workers after a coordinator restart.

The coordinator keeps nothing on disk about the running job: the workers hold it. A
restarted coordinator answers heartbeats from workers it does not know with
``reregister``; each worker answers ``rejoin`` with the ``configure`` message of its
assignment and how far it got (prepared, applied, stale). Once every slot has rejoined,
the job is rebuilt from the newest epoch the workers share:

* the committed cut is the highest iteration any worker applied (a worker applies only
  what the old coordinator declared committed, i.e. what every worker had prepared);
  the next cut is computed as usual from the workers' prepared iterations;
* a worker left on an older epoch, or without state, is stale: the job is degraded and
  the trainers are asked to resync once they reconnect (their heartbeats carry epoch and
  rank, which is all the coordinator needs to find them again).
"""

from __future__ import annotations

import logging
from typing import Any

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.cut import Cut
from shadow.coordinator.membership import Membership
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import JobRec, JobStatus, WorkerRec
from shadow.core.layout import Layout, shard_bounds
from shadow.wire import messages as M

logger = logging.getLogger(__name__)

Msg = dict[str, Any]


def valid_assignment(assignment: dict | None) -> dict | None:
    """A rejoin's assignment report, checked like any message from the network."""
    if assignment is None:
        return None
    cfg = assignment.get("configure")
    if not isinstance(cfg, dict):
        raise M.MessageError("bad_field", "rejoin.assignment lacks its configure message")
    M.validate({"t": "configure", "v": M.VERSION, **{k: v for k, v in cfg.items() if k not in ("t", "v")}})
    for key in ("prepared", "applied"):
        if not isinstance(assignment.get(key), int) or isinstance(assignment.get(key), bool):
            raise M.MessageError("bad_field", f"rejoin.assignment.{key} must be an integer")
    if not isinstance(assignment.get("stale"), str):
        raise M.MessageError("bad_field", "rejoin.assignment.stale must be a string")
    return assignment


def rebuild_job(workers: list[WorkerRec], nshards: int) -> tuple[JobRec | None, dict[int, str]]:
    """The job the workers hold, and the workers that cannot serve it (id -> reason)."""
    held = {w.id: w.assignment for w in workers if w.assignment is not None}  # worker id -> what it holds
    if not held:
        return None, {}
    cfg = max(held.values(), key=lambda s: s["configure"]["epoch"])["configure"]
    same = {
        i
        for i, s in held.items()
        if s["configure"]["epoch"] == cfg["epoch"] and s["configure"]["job_id"] == cfg["job_id"]
    }
    ranges: list = [None] * len(workers)
    stale: dict[int, str] = {}
    for w in workers:
        if w.id in same and not held[w.id]["stale"]:
            c = held[w.id]["configure"]
            ranges[w.id] = (c["start"], c["stop"])
        elif w.id in same:
            stale[w.id] = held[w.id]["stale"]
        else:
            stale[w.id] = "holds no state of the current epoch (it restarted with the coordinator)"
    if any(held[i]["configure"]["shards"] != nshards for i in same):
        stale.update({i: "the cluster's shards do not match this worker's" for i in same if i not in stale})
    # ranges of stale workers: what the configuration says (a resync re-lays out anyway)
    layout = Layout.from_dict(cfg["layout"])
    bounds = shard_bounds(layout.total, nshards)
    ranges = [r if r is not None else bounds[i % nshards] for i, r in enumerate(ranges)]
    job = JobRec(
        cfg["job"],
        cfg["job_id"],
        cfg["epoch"],
        cfg["layout"],
        layout.hash,
        cfg["world"],
        cfg["optim"],
        cfg["iteration"],
        ranges,
        {},
    )
    job.generation = int(cfg["persist"].get("generation", 0))
    secret = cfg.get("rank_secret")
    if isinstance(secret, bytes) and len(secret) == 32:  # the ranks' tokens stay what they were given
        job.secret = secret
    ok = [w for w in workers if w.id in same and w.id not in stale]
    job.cut = max([held[w.id]["applied"] for w in ok] + [cfg["iteration"] - 1])
    for w in workers:
        w.configured = job.epoch if w.id in same else -1
        key = held[w.id]["configure"].get("data_key") if w.id in same else None
        w.data_key = key if isinstance(key, bytes) else None  # the ranks hold their keys of it
        w.prepared = held[w.id]["prepared"] if w in ok else job.cut
        w.applied = held[w.id]["applied"] if w in ok else -1
    job.status = JobStatus.RUNNING if job.cut >= job.base else JobStatus.BOOTSTRAPPING
    logger.warning(
        "rebuilt job %s epoch %d from %d workers: committed iteration %d%s",
        job.name,
        job.epoch,
        len(workers),
        job.cut,
        f"; stale workers {sorted(stale)}" if stale else "",
    )
    return job, stale


class Rebuild:
    """Handler ``rejoin`` (workers that outlived the previous coordinator), and the rebuild
    of the job once every slot has rejoined."""

    def __init__(
        self, state: ClusterState, out: Outbox, cut: Cut, membership: Membership, persist: Persistence
    ) -> None:
        self.state, self.out, self.cut, self.membership, self.persist = state, out, cut, membership, persist

    def on_rejoin(self, env: list[bytes], msg: Msg) -> None:
        """A worker that outlived the previous coordinator reports what it holds."""
        try:
            assignment = valid_assignment(msg["assignment"])
        except M.MessageError as exc:
            self.state.rejected.add(exc.reason)
            self.out.reply(env, "error", code="malformed", message=f"rejected rejoin: {exc}")
            return
        if self.state.job is not None:  # this coordinator already runs a job
            if self.state.worker(env[0]) is None:
                self.membership.on_register(env, msg)
            return
        w = self.membership.enrol(env, msg, fresh=False)
        if w is None:
            return
        w.assignment = assignment
        if len(self.state.workers) == self.state.expected and any(x.assignment for x in self.state.workers):
            self.rebuild()

    def rebuild(self) -> None:
        st = self.state
        job, stale = rebuild_job(st.workers, st.nshards)
        for w in self.state.workers:
            w.assignment = None
        if job is None:
            return
        st.job, st.epoch = job, max(st.epoch, job.epoch)
        self.persist.reset(job.cut)
        for w in self.state.workers:
            if w.id in stale:
                w.stale = stale[w.id]
        if stale:
            self.cut.degrade("coordinator restarted; workers " + ", ".join(f"{i} ({r})" for i, r in stale.items()))
            return
        for w in st.workers:  # one may have missed the last apply of the old coordinator
            self.out.to_worker(w, "apply", epoch=job.epoch, iteration=job.cut, persist=False)
        self.cut.advance()
