"""A shared cluster's front: the cluster's address for every job at once.

Each job gets a coordinator and workers of its own (:class:`~shadow.front.jobs.JobProcs`),
started when its rank 0 attaches and the host has the memory and cores the job needs
(:class:`~shadow.front.admission.Budget`); an attach that does not fit is refused then, with
the figures. From then on the front answers the job's messages with ``moved`` (the job's
coordinator's address): trainers and readers follow it once and talk to that coordinator,
which runs the one-job code unchanged. What names no job (``status``, ``jobs``) the front
answers itself, from what each job's coordinator reports (:mod:`~shadow.front.report`).

Jobs are apart as processes are: a job's replay runs on its own cores (when
``cores_per_job`` is set), a crash takes one job's coordinator or workers down, and a
job-scoped key reaches its jobs only (checked here and again by the job's coordinator).
A job whose trainers are gone keeps its memory (a relaunch restores from it) until an admin
drops it (``shadow drop``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from shadow.config import ClusterConfig, PersistConfig
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.routes import ADMIN, READERS, TRAINER, WORKER
from shadow.coordinator.trainers import heard_window_s
from shadow.core.errors import ShadowError
from shadow.core.jobs import job_name_problem
from shadow.front import agents as hosts
from shadow.front import reclaim, report, spread, views
from shadow.front.admission import Budget, gb, need_of
from shadow.front.agents import AgentRec, RemoteProcs
from shadow.front.jobs import START_TRIES, JobProcs
from shadow.security import Peer
from shadow.wire import messages as M

logger = logging.getLogger(__name__)

#: the messages a front takes, and from whom
ROLES: dict[str, frozenset[str]] = {
    "attach": TRAINER,
    "detach": TRAINER,  # a held rank withdrawing its attach
    "status": READERS,
    "restore_info": READERS,
    "catalog": READERS,
    "jobs": READERS,
    "drop": ADMIN,
    "agent": WORKER,  # a host that runs jobs for this front (shadow agent), with a worker key
}
#: seconds a rank's attach waits at the front for its job's rank 0 (which carries the layout)
HOLD_S = 120.0
#: ranks held for their rank 0 at once, at most (what a trainer key can make the front hold)
MAX_HELD = 4096


class Front:
    """The jobs of one shared cluster. Runs on one thread (the front's loop): :meth:`on_message`
    for each message, :meth:`tick` after each poll. ``spawn``: makes a job's processes
    (tests give a stand-in)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        out: Outbox,
        budget: Budget,
        workdir: str,
        spawn: Callable[..., JobProcs] = JobProcs,
        tiers: Callable[[], Persistence] | None = None,
    ) -> None:
        self.cfg, self.out, self.budget, self.workdir, self.spawn = cfg, out, budget, workdir, spawn
        # the tiers as read now (what jobs that do not run hold there): read at the start and
        # again each time a job ends (its last writes are done then)
        self.read_tiers = tiers or (lambda: Persistence(PersistConfig(durable=False)))
        self.tiers = self.read_tiers()
        self.nobody = ClusterState(expected=cfg.workers, replicas=cfg.replicas, tuning=cfg.tuning.resolve())
        self.jobs: dict[str, JobProcs | RemoteProcs] = {}
        self.held: dict[str, list[tuple[list[bytes], int, float]]] = {}  # job -> [(envelope, rank, since)]
        self.refused = 0
        self.reclaiming: dict[str, float] = {}  # ended job -> when its memory was asked back
        # job -> its rank 0's attach, held for the jobs' next reports (since, wall time) or a reclaim (0.0)
        self.admitting: dict[str, tuple[list[bytes], dict, float]] = {}
        self.max_bytes = cfg.tuning.resolve().max_commit_bytes  # the most an attach may carry
        self.agents: dict[str, AgentRec] = {}  # the other hosts that run jobs, by name
        self.starting: dict[str, list[list[bytes]]] = {}  # job on an agent -> ranks told once its port is known
        self.parts: dict[str, list[Any]] = {}  # a job spread over hosts -> its parts but the first (spread.py)

    # -- messages

    def on_message(self, parts: list[bytes], role: str | None = None, jobs: tuple[str, ...] | None = None) -> None:
        if len(parts) < 2:
            return
        env, raw = parts[:-1], parts[-1]
        try:
            kind = M.peek_type(raw)
            roles = ROLES.get(kind)
            if roles is None:
                self._error(env, "refused", f"this is a shared cluster's front: it does not take {kind!r} messages")
                return
            if role is not None and role not in roles:
                self._refuse(
                    env, f"a {role} may not send {kind!r} messages (from {', '.join(sorted(roles))} keys only)"
                )
                return
            msg = M.decode(raw, self.max_bytes)
        except M.MessageError as exc:
            self._error(env, "malformed", f"rejected: {exc}")
            return
        peer = Peer(role, jobs) if role is not None else None
        try:
            getattr(self, "_on_" + kind)(env, msg, peer)
        except Exception as exc:  # a bug meeting an input: answered, logged, and the front goes on
            logger.exception("the front failed on a %s message", kind)
            self._error(env, "internal", f"the front could not handle this {kind} message ({type(exc).__name__})")

    def _on_attach(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        job = msg["job"]
        why = job_name_problem(job) or self._scope(peer, job, "attach to")
        if why is not None:
            self._refuse(env, why)
            return
        if job in self.jobs:
            self._moved(env, job)
            return
        if msg["layout"] is None:  # not rank 0: held until rank 0's attach admits the job (or not)
            if sum(map(len, self.held.values())) >= MAX_HELD:
                self._error(env, "busy", f"{MAX_HELD} ranks already wait for their rank 0 here; attach again later")
                return
            self.held.setdefault(job, []).append((env, msg["rank"], time.monotonic()))
            reason = f"job {job!r} is admitted when its rank 0 attaches (its attach carries what the job needs)"
            self.out.reply(env, "waiting", ready=0, expected=0, starting=0, reason=reason)
            return
        self.admit(env, job, msg)

    def admit(self, env: list[bytes], job: str, msg: dict, settled: bool = False) -> None:
        """Admit ``job`` (rank 0's attach ``msg``), or make room for it from ended jobs, or
        refuse it. Before a refusal the jobs' next reports are awaited (``settled``): a job
        whose ranks detached a moment ago counts as ended."""
        cfg = self.cfg
        try:
            need, optim = need_of(msg, cfg.workers, cfg.replicas, cfg.persist.local.enabled, cfg.cores_per_job)
        except (ValueError, KeyError, TypeError) as exc:
            self._refuse(env, f"attach of job {job!r}: {exc}")
            return
        ended = {j: p.ended_why for j, p in self.jobs.items() if p.ended_why}
        given = spread.place(job, need, optim, ended, self.budget, self.agents)
        if isinstance(given, str) and not settled:
            self.admitting[job] = (env, msg, time.time())
            return
        if isinstance(given, str) and reclaim.ask_for(self, job, need):
            self.admitting[job] = (env, msg, 0.0)
            names = ", ".join(repr(j) for j in self.reclaiming)
            reason = (
                f"the memory of ended job {names} is being freed for job {job!r} (its last iteration to the tier first)"
            )
            self.out.reply(env, "waiting", ready=0, expected=0, starting=0, reason=reason)
            return
        if isinstance(given, str):
            logger.warning("%s", given)
            for e in [env] + [e for e, _, _ in self.held.pop(job, [])]:
                self._refuse(e, given)
            return
        head, *rest = [self._procs(job, part) for part in given]
        try:
            head.start()
        except (ShadowError, OSError) as exc:  # no port left in job_ports, no process could start
            self._release(job)
            for e in [env] + [e for e, _, _ in self.held.pop(job, [])]:
                self._refuse(e, f"attach of job {job!r}: its coordinator could not start: {exc}")
            return
        self.jobs[job] = head
        if rest:
            self.parts[job] = rest  # started once its coordinator's address is known (spread.tend)
        on = ", ".join(f"{len(p.slots) or cfg.workers} workers on {spread.where(p)}" for p in [head, *rest])
        logger.info("job %r admitted (%s): %s, %s of memory", job, on, need.describe(optim), gb(need.bytes))
        for e in [env] + [e for e, _, _ in self.held.pop(job, [])]:
            self._moved(e, job)

    def _on_detach(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        for job, waiting in list(self.held.items()):  # a held rank that gave up
            self.held[job] = [w for w in waiting if not (w[0] == env and w[1] == msg["rank"])]

    def _on_status(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        job = msg.get("job")
        if job:
            self._to_job(env, job, peer, "read the status of")
            return
        self.out.reply(env, "status_reply", status=self.status(peer))

    def _on_restore_info(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        self._to_job(env, msg["job"], peer, "restore")

    def _on_catalog(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        self._to_job(env, msg["job"], peer, "list the checkpoints of")

    def _on_jobs(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        rows = views.jobs_rows(self, peer)
        self.out.reply(env, "jobs_reply", jobs=rows, window_s=heard_window_s(self.nobody.tuning))

    def _on_drop(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        job = msg["job"]
        procs = self.jobs.get(job)
        if procs is None:
            self._error(env, "refused", f"no job {job!r} runs on this shared cluster ({self._names()})")
            return
        rep = procs.report()
        row = next((r for r in (rep["jobs"] if rep else []) if r["name"] == job), None)
        if not procs.ended_why and not msg["force"] and row is not None and row.get("held"):
            self._error(
                env,
                "refused",
                f"job {job!r}'s trainers are still heard from; stop them first, or drop it anyway with force=true",
            )
            return
        self.end(job, "dropped by an admin")
        self.out.reply(
            env,
            "drop_reply",
            job=job,
            epoch=int((row or {}).get("epoch") or 0),
            committed=(row or {}).get("committed"),
            forced=bool(msg["force"]),
            message=f"job {job!r}'s coordinator and workers stopped and its memory is free; its checkpoints in "
            "the tiers stay",
        )

    def _on_agent(self, env: list[bytes], msg: dict, peer: Peer | None) -> None:
        """An agent's beat: what its host gives jobs and how its jobs do; answered with every
        job it is to run."""
        why = hosts.checked(msg)
        if why is not None:
            self._error(env, "malformed", f"rejected: {why}")
            return
        name, rec = msg["name"], self.agents.get(msg["name"])
        if rec is not None and rec.env != env and rec.alive():
            self._error(env, "busy", f"an agent named {name!r} already serves this front; give this one another name=")
            return
        if rec is None:
            if len(self.agents) >= hosts.MAX_AGENTS:
                self._error(env, "busy", f"this front already has {hosts.MAX_AGENTS} agents")
                return
            rec = self.agents[name] = AgentRec(name, env, msg)
            logger.info("agent %s joined: host %s, %s for jobs", name, msg["host"], gb(msg["memory"]))
        rec.update(env, msg)
        parts = [p for ps in self.parts.values() for p in ps if p.join]  # a spread job's, once they can join
        wanted = [
            p.wanted(self.cfg.workers, self.cfg.replicas)
            for p in [*self.jobs.values(), *parts]
            if isinstance(p, RemoteProcs) and p.agent is rec
        ]
        self.out.reply(env, "agent_jobs", jobs=wanted)

    def budget_of(self, procs: Any) -> Budget:
        return procs.agent.budget if isinstance(procs, RemoteProcs) else self.budget

    def _procs(self, job: str, part: spread.Part) -> Any:
        """The processes of one part of ``job`` (not started)."""
        if part.where:
            return RemoteProcs(job, self.agents[part.where], part.need, part.cores, part.slots)
        return self.spawn(job, self.cfg, part.need, part.cores, self.workdir, slots=part.slots)

    def _release(self, job: str) -> None:
        """Give back what ``job`` holds on every host."""
        for b in [self.budget, *(a.budget for a in self.agents.values())]:
            b.release(job)

    # -- periodic

    def tick(self) -> None:
        now = time.monotonic()
        for job, procs in list(self.jobs.items()):
            code = procs.exited()
            if code is not None:
                if not procs.reported and procs.tries < START_TRIES:
                    logger.warning("job %r: its cluster exited (%s) before it came up; starting it again", job, code)
                    procs.start()
                    continue
                logger.error(
                    "job %r: its cluster exited with status %s; its memory is lost (its next attach admits it again)",
                    job,
                    code,
                )
                self.end(job, "exited")
                continue
            procs.ended_why = report.ended(procs)
        reclaim.settle(self, now)
        spread.tend(self)
        for job, envs in list(self.starting.items()):
            remote = self.jobs.get(job)
            if remote is not None and (remote.report() is not None or remote.port):
                del self.starting[job]
                for env in envs:
                    self._moved(env, job)
        for job, waiting in list(self.held.items()):
            kept = [w for w in waiting if now - w[2] < HOLD_S]
            for env, _, _ in (w for w in waiting if now - w[2] >= HOLD_S):
                self._error(env, "timeout", f"job {job!r}'s rank 0 did not attach within {HOLD_S:.0f} s")
            if kept:
                self.held[job] = kept
            else:
                del self.held[job]

    def stop_all(self) -> None:
        for job in list(self.jobs):
            self.end(job, "the shared cluster stopped")

    # -- views

    def status(self, peer: Peer | None = None) -> dict[str, Any]:
        """What ``shadow status`` shows of a shared cluster: its hosts' budgets and each job."""
        return views.status(self, peer)

    # -- helpers

    def end(self, job: str, why: str) -> None:
        procs = self.jobs.pop(job)
        for p in [*self.parts.pop(job, []), procs]:
            p.stop()
            p.kill()  # what is left of its process group (its workers, when its cluster died)
        self._release(job)
        for env in self.starting.pop(job, []):
            self._error(env, "refused", f"job {job!r} ended before its coordinator came up ({why})")
        logger.info("job %r ended (%s): its memory is free", job, why)
        self.tiers = self.read_tiers()

    def _to_job(self, env: list[bytes], job: str | None, peer: Peer | None, verb: str) -> None:
        if job is None:
            mine = [j for j in self.jobs if peer is None or peer.may(j)]
            if len(mine) != 1 and verb == "restore":  # the jobs, for `shadow ls` to list each
                problem = f"this shared cluster runs {self._names(peer)}: name the job (job=NAME)"
                info = {"memory": None, "memory_error": problem, "storage": self.tiers.storage(), "job": None}
                self.out.reply(env, "restore_info_reply", info={**info, "jobs": sorted(mine)})
                return
            if len(mine) != 1:
                self._error(env, "refused", f"this shared cluster runs {self._names(peer)}: name the job (job=NAME)")
                return
            job = mine[0]
        why = self._scope(peer, job, verb)
        if why is not None:
            self._refuse(env, why)
        elif job in self.jobs:
            self._moved(env, job)
        elif verb == "restore":  # a job that does not run here now: its tiers, read directly
            info = {
                "memory": None,
                "memory_error": f"job {job!r} does not run on this shared cluster now ({self._names(peer)})",
                "storage": self.tiers.storage(),
                "job": None,
            }
            self.out.reply(env, "restore_info_reply", info=info)
        else:
            self._error(
                env,
                "refused",
                f"job {job!r} does not run on this shared cluster ({self._names(peer)}): its memory was freed, or it "
                "never ran here; restore it from a tier (`shadow restore source=DIR_OR_URL job=...`)",
            )

    def _names(self, peer: Peer | None = None) -> str:
        names = [j for j in sorted(self.jobs) if peer is None or peer.may(j)]
        return f"jobs {', '.join(names)}" if names else "no job"

    def _scope(self, peer: Peer | None, job: str, verb: str) -> str | None:
        if peer is None or peer.may(job):
            return None
        return (
            f"this {peer.role} key is limited to jobs {', '.join(peer.jobs or ())}: it may not {verb} job {job!r} "
            f"(use a key of that job, or ask the cluster's admin to put this key's public half in "
            f"security.allow_{peer.role}s/{job}/)"
        )

    def _moved(self, env: list[bytes], job: str) -> None:
        procs = self.jobs[job]
        if not isinstance(procs, RemoteProcs):
            self.out.reply(env, "moved", job=job, to=procs.address)
        elif procs.report() is None and not procs.port:  # told once the agent says where it listens
            self.starting.setdefault(job, []).append(env)
            reason = f"job {job!r}'s coordinator is starting on host {procs.where}"
            self.out.reply(env, "waiting", ready=0, expected=0, starting=0, reason=reason)
        else:
            self.out.reply(env, "moved", job=job, to=procs.address, host=procs.agent.host)

    def _refuse(self, env: list[bytes], message: str) -> None:
        self.refused += 1
        logger.warning("refused: %s", message)
        self._error(env, "refused", message)

    def _error(self, env: list[bytes], code: str, message: str) -> None:
        self.out.reply(env, "error", code=code, message=message)
