"""Attaching a training job: the ranks' ``attach`` messages are held until every rank
has arrived and every worker is ready (``waiting`` meanwhile), within bounds on what the
coordinator holds, and a rank may withdraw its own; then the job's new epoch starts
(:class:`~shadow.coordinator.attach_epoch.EpochStart`: checked against what the cluster
holds, the workers configured)."""

from __future__ import annotations

import logging
import time
from typing import Any

from shadow.coordinator.attach_epoch import EpochStart
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.cut import Cut
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import JobStatus
from shadow.core.jobs import job_name_problem
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


Msg = dict[str, Any]

#: a ``detach`` of this epoch withdraws the sender's held attach (trainer_hooks' handshake)
WITHDRAW = -1


class Attach:
    """Handlers ``attach`` and ``detach`` (trainers); attaches held while their ranks
    arrive and workers start (periodic :meth:`start_attaches`, :meth:`expire_attaches`)."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence, cut: Cut | None = None) -> None:
        self.state, self.out, self.persist, self.cut = state, out, persist, cut
        self.epochs = EpochStart(state, out, persist)

    def on_attach(self, env: list[bytes], msg: Msg, size: int = 0) -> None:
        """Rank ``msg.rank`` of job ``msg.job`` attaches; ``size``: its message's bytes on the wire."""
        now = time.monotonic()
        problem = job_name_problem(msg["job"])  # the name becomes a directory under every tier's root
        if problem is not None:
            logger.error("attach refused: %s", problem)
            self.out.reply(env, "error", code="refused", message=problem)
            return
        if not 0 <= msg["rank"] < msg["world"]:
            self.out.reply(env, "error", code="refused", message=f"rank {msg['rank']} is not in world {msg['world']}")
            return
        if msg["rank"] != 0 and msg["layout"] is not None:
            msg = {**msg, "layout": None}  # rank 0's layout is the job's; the others' hashes must match it
            size = len(M.encode("attach", **{k: v for k, v in msg.items() if k not in ("t", "v")}))
        full = self._pending_full(msg["job"], msg["rank"], size)
        if full is not None:
            self.state.rejected.add("attach_full")
            logger.error("attach of job %s rank %d refused: %s", msg["job"], msg["rank"], full)
            self.out.reply(env, "error", code="busy", message=full)
            return
        p = self.state.pending.setdefault(
            msg["job"],
            {
                "ranks": {},
                "bytes": {},
                "held": 0,
                "since": now,
                "told": -1,
                "deadline": now + self.state.tuning.connect_timeout_s,
            },
        )
        p["ranks"][msg["rank"]] = (env[0], msg)  # a rank attaching again replaces its entry
        p["held"] += size - p["bytes"].get(msg["rank"], 0)
        p["bytes"][msg["rank"]] = size
        p["told"] = -1  # a newcomer hears how many workers are ready
        self.start_attaches()

    def _pending_full(self, name: str, rank: int, size: int) -> str | None:
        """Why one more held attach (job ``name``, ``rank``, a message of ``size`` bytes)
        would pass a bound on what the coordinator holds, or None."""
        p = self.state.pending.get(name)
        held = self.state.pending_view()
        again = p is not None and rank in p["ranks"]  # replaces its own entry
        jobs = held["jobs"] + (p is None)
        ranks = held["ranks"] + (not again)
        nbytes = held["bytes"] - (p["bytes"].get(rank, 0) if p is not None and again else 0) + size
        tuning = self.state.tuning
        for knob, cap, value, what in (
            ("ATTACH_PENDING_JOBS", tuning.attach_pending_jobs, jobs, "jobs with attaches waiting for their ranks"),
            ("ATTACH_PENDING_RANKS", tuning.attach_pending_ranks, ranks, "rank attaches waiting"),
            ("ATTACH_PENDING_BYTES", tuning.attach_pending_bytes, nbytes, "bytes of attach messages held"),
        ):
            if value > cap:
                waiting = (
                    f"other attaches are waiting for their ranks ({held['jobs']} jobs, {held['ranks']} "
                    f"ranks, {held['bytes']} bytes) until they arrive or SHADOW_CONNECT_TIMEOUT_S passes: "
                    "retry then, or"
                    if held["ranks"]
                    else ""
                )
                return (
                    f"the coordinator holds too many pending attaches: this one would make {value} {what}, "
                    f"over the bound of {cap} (SHADOW_{knob}); {waiting} raise SHADOW_{knob} on the coordinator"
                )
        return None

    def start_attaches(self) -> None:
        """Start every pending attach whose ranks have all arrived, once every worker is
        ready; until then each rank hears ``waiting`` whenever the count of ready workers
        changes (a cluster still compiling its kernels holds attaches, it does not refuse)."""
        if not self.state.pending:
            return
        ready = len(self.state.ready_workers())
        for name in list(self.state.pending):
            p = self.state.pending[name]
            world = next(iter(p["ranks"].values()))[1]["world"]
            if ready >= self.state.expected and len(p["ranks"]) >= world:
                owned = self.epochs.live_owner(name, p["ranks"])
                p["owned"] = owned
                if owned is not None:  # held until the live run's ranks fall silent, or the deadline
                    if self._tell_held(p, "owner_told", owned, ready):
                        logger.warning("attach of job %s held: %s", name, owned)
                    continue
                if self._keeping_last(name, p):
                    continue
                del self.state.pending[name]
                try:
                    self.epochs.start_job(name, p["ranks"])
                except Exception as exc:  # the ranks must hear, and the loop go on
                    self.state.rejected.failed("attach_error", f"the attach of job {name!r}")
                    for ident, _ in p["ranks"].values():
                        self.out.reply(
                            [ident],
                            "error",
                            code="internal",
                            message=f"attach of job {name!r} failed in the coordinator: {type(exc).__name__}: {exc}",
                        )
            elif ready < self.state.expected and p["told"] != ready:
                p["told"] = ready
                for ident, _ in p["ranks"].values():
                    self.out.reply(
                        [ident], "waiting", ready=ready, expected=self.state.expected, starting=len(self.state.starting)
                    )

    def _keeping_last(self, name: str, p: dict) -> bool:
        """Whether the attach of job ``name`` waits while the job whose memory it takes has
        its last committed iteration written to the local tier (:meth:`Cut.keep_last`), so a
        relaunch of that job loses nothing. It waits until the attach's own deadline is a
        second away at most; then the attach goes on, and the log says what was not kept."""
        old = self.state.job
        first = p["ranks"][min(p["ranks"])][1]
        if self.cut is None or old is None or old.name == name:
            return False
        if self.epochs.blocks(old) and not first["overwrite"]:
            return False  # refused by start_job: nothing of the held job changes
        keeping = self.cut.keep_last()
        if keeping is None:
            return False
        now = time.monotonic()
        if now >= p["deadline"] - 1.0:
            logger.warning(
                "attach of job %s goes on before %s (its attach deadline, SHADOW_CONNECT_TIMEOUT_S, has come); "
                "that iteration is not kept",
                name,
                keeping.removeprefix("the local tier is writing "),
            )
            return False
        if self._tell_held(p, "keep_told", keeping, len(self.state.ready_workers())):
            logger.info("attach of job %s waits: %s", name, keeping)
        return True

    def _tell_held(self, p: dict, when: str, reason: str, ready: int) -> bool:
        """Tell every rank of held attach ``p`` why it waits (``waiting`` with ``reason``), at
        most every 5 s (``p[when]``: when next); True if it was told now."""
        now = time.monotonic()
        if now < p.get(when, 0.0):
            return False
        p[when] = now + 5.0
        for ident, _ in p["ranks"].values():
            self.out.reply(
                [ident],
                "waiting",
                ready=ready,
                expected=self.state.expected,
                starting=len(self.state.starting),
                reason=reason,
            )
        return True

    def expire_attaches(self) -> None:
        now = time.monotonic()
        for name in [n for n, p in self.state.pending.items() if now > p["deadline"]]:
            p = self.state.pending.pop(name)
            world = next(iter(p["ranks"].values()))[1]["world"]
            ready = len(self.state.ready_workers(now))
            if p.get("owned"):
                text = (
                    f"attach of job {name!r} refused after {now - p['since']:.0f} s (SHADOW_CONNECT_TIMEOUT_S): "
                    f"{p['owned']}"
                )
            elif len(p["ranks"]) < world:
                text = (
                    f"attach of job {name!r} timed out: {len(p['ranks'])} of {world} ranks arrived "
                    f"(ranks {sorted(p['ranks'])}); every rank must call attach"
                )
            else:
                text = (
                    f"the shadow cluster has {ready} of {self.state.expected} workers ready after "
                    f"{now - p['since']:.0f} s ({len(self.state.starting)} still compiling their kernels); "
                    "check the worker logs, or allow longer with SHADOW_CONNECT_TIMEOUT_S"
                )
            logger.error("attach of job %s failed: %s", name, text)
            for ident, _ in p["ranks"].values():
                self.out.reply([ident], "error", code="timeout", message=text)

    def on_detach(self, env: list[bytes], msg: Msg) -> None:
        if msg["epoch"] == WITHDRAW:  # a rank gave up waiting: its held attach goes (from its connection only)
            for name, p in list(self.state.pending.items()):
                held = p["ranks"].get(msg["rank"])
                if held is not None and held[0] == env[0]:
                    del p["ranks"][msg["rank"]]
                    p["held"] -= p["bytes"].pop(msg["rank"], 0)
                    logger.info("attach of job %s rank %d withdrawn by the rank", name, msg["rank"])
                    if not p["ranks"]:
                        del self.state.pending[name]
            return
        job = self.state.job
        if job is not None and msg["epoch"] == job.epoch and self.state.from_rank(env, msg["rank"]):
            job.detached.add(msg["rank"])
            if len(job.detached) == job.world:
                job.status = JobStatus.DETACHED
                logger.info("job %s epoch %d detached at iteration %d", job.name, job.epoch, job.cut)
