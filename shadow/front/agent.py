"""``shadow agent``: a host that runs jobs for a shared cluster's front on another host.

Every second the agent tells the front what this host gives jobs (``memory_gb``, the cores
it may pin them to) and how each job it runs is doing (its coordinator's port, its
process, its exit status, its coordinator's latest report). The front answers with every
job this host is to run (``agent_jobs``), and the agent makes it so
(:meth:`Agent.reconcile`): it starts each new job's processes as the front starts its own
(:class:`~shadow.front.jobs.JobProcs`: a ``shadow cluster`` of the job's own, pinned to
its cores), asks a job whose memory is wanted for its last iteration on the local tier,
and stops the jobs the front no longer lists. The whole set comes each time, so a message
lost, or a restart of the agent or of the front, is repaired at the next beat. Jobs go on
while the front is away (their trainers talk to their own coordinators)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

from shadow.config import AgentConfig
from shadow.core.jobs import job_name_problem
from shadow.front.admission import Budget, Need, memory_budget
from shadow.front.agents import AGENT_LOST_S, HOST
from shadow.front.jobs import START_TRIES, JobProcs
from shadow.transport import SocketFactory
from shadow.wire import messages as M
from shadow.worker.outbox import routing_id, silence_options

logger = logging.getLogger(__name__)

#: seconds between two beats to the front
BEAT_S = 1.0
#: the most worker processes one job may ask of an agent
MAX_WORKERS = 1024
#: the coordinator a spread job's workers here join: tcp://HOST:PORT
JOIN = re.compile(r"tcp://(?:" + HOST.pattern + r"):[0-9]{1,5}")


class Agent:
    """The jobs this host runs for its front. One thread: :meth:`beat` says what to send,
    :meth:`reconcile` carries out the front's answer, :meth:`tick` restarts a job whose
    cluster exited before it came up. ``spawn`` makes a job's processes (tests stand in)."""

    def __init__(
        self, cfg: AgentConfig, host: str, workdir: str, spawn: Callable[..., Any] = JobProcs, memory: int = 0
    ) -> None:
        self.cfg, self.host, self.workdir, self.spawn = cfg, host, workdir, spawn
        self.name = cfg.name or socket.gethostname().split(".")[0][:64] or "agent"
        self.cores = Budget(memory or memory_budget(cfg.memory_gb), os.sched_getaffinity(0))
        self.jobs: dict[str, Any] = {}
        self.asked_last: set[str] = set()

    def beat(self) -> dict[str, Any]:
        """The fields of this beat's ``agent`` message."""
        rows = []
        for job, procs in sorted(self.jobs.items()):
            rep = procs.report()
            rows.append(
                {
                    "job": job,
                    "port": procs.port,
                    "pid": procs.proc.pid if procs.proc is not None else None,
                    "exited": procs.exited() if procs.reported or procs.tries >= START_TRIES else None,
                    "report": rep,
                }
            )
        return {
            "name": self.name,
            "host": self.host,
            "memory": self.cores.memory,
            "cores": len(self.cores.cores),
            "cores_per_job": self.cfg.cores_per_job,
            "jobs": rows,
        }

    def reconcile(self, wanted: list) -> None:
        """Run exactly the jobs of the front's ``agent_jobs``: start the new ones, ask for the
        last iteration where it is wanted, stop the ones it left out. An entry that does not
        hold what the front sends is logged and skipped."""
        want: dict[str, dict] = {}
        for entry in wanted:
            why = _entry_problem(entry)
            if why is not None:
                logger.error("the front's agent_jobs holds %s; skipped", why)
                continue
            want[entry["job"]] = entry
        for job in [j for j in self.jobs if j not in want]:
            self._stop(job, "the front no longer lists it")
        for job, entry in want.items():
            if job in self.jobs and self.jobs[job].join != entry.get("join", ""):
                self._stop(job, f"its coordinator is now at {entry['join']}")
            if job not in self.jobs:
                self._start(job, entry)
            if entry["last"] and job not in self.asked_last and job in self.jobs:
                self.asked_last.add(job)
                logger.info("job %r: its memory is wanted; writing its last iteration to the local tier", job)
                self.jobs[job].ask_last()

    def tick(self) -> None:
        for job, procs in list(self.jobs.items()):
            code = procs.exited()
            if code is not None and not procs.reported and procs.tries < START_TRIES:
                logger.warning("job %r: its cluster exited (%s) before it came up; starting it again", job, code)
                procs.start()

    def stop_all(self) -> None:
        for job in list(self.jobs):
            self._stop(job, "the agent stopped")

    def _start(self, job: str, entry: dict) -> None:
        cfg = self.cfg.cluster(entry["workers"], entry["replicas"])
        slots = tuple(entry.get("slots", ()))  # a spread job's: the slots this host runs
        here = len(slots) or entry["workers"]
        given = self.cores.admit(job, Need(0, 0, 1, here, 0, self.cfg.cores_per_job), "", {})
        if isinstance(given, str):  # the front counts the same cores: only a front out of step comes here
            logger.error("job %r: no %d cores free here for it; started unpinned", job, self.cfg.cores_per_job)
            given = ()
            self.cores.held[job] = (0, ())
        need = Need(0, 0, entry["replicas"], here, 0, len(given))
        procs = self.spawn(job, cfg, need, given, self.workdir, slots=slots, join=entry.get("join", ""))
        try:
            procs.start()
        except Exception as exc:  # no port left in job_ports, no process could start: said, tried at the next beat
            logger.error("job %r: its cluster could not start: %s", job, exc)
            self.cores.release(job)
            return
        self.jobs[job] = procs
        if slots and entry.get("join"):
            logger.info("job %r: its workers %s started for its coordinator at %s", job, list(slots), entry["join"])
        else:
            logger.info("job %r: started for the front (coordinator %s)", job, procs.address)

    def _stop(self, job: str, why: str) -> None:
        procs = self.jobs.pop(job)
        procs.stop()
        procs.kill()
        self.cores.release(job)
        self.asked_last.discard(job)
        logger.info("job %r stopped (%s)", job, why)


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("job"), str):
        return "an entry that is not a job"
    why = job_name_problem(entry["job"])
    if why is not None:
        return why
    workers, replicas = entry.get("workers"), entry.get("replicas")
    if not (isinstance(workers, int) and isinstance(replicas, int) and 1 <= replicas <= workers <= MAX_WORKERS):
        return f"job {entry['job']!r} with workers={workers!r}, replicas={replicas!r}"
    if workers % replicas or not isinstance(entry.get("last"), bool):
        return f"job {entry['job']!r} with workers={workers}, replicas={replicas} or last={entry.get('last')!r}"
    slots, join = entry.get("slots", ()), entry.get("join", "")
    if not (
        isinstance(slots, (list, tuple))
        and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < workers for s in slots)
        and len(set(slots)) == len(slots)
    ):
        return f"job {entry['job']!r} with slots {str(slots)[:80]} (each a slot below workers={workers}, once)"
    if not isinstance(join, str) or (join and not JOIN.fullmatch(join)):
        return f"job {entry['job']!r} to join {str(join)[:80]!r}, not a coordinator's tcp://HOST:PORT"
    return None


def run_agent(cfg: AgentConfig) -> int:
    """Serve the front in the foreground until SIGTERM or Ctrl-C, then stop every job this
    host runs. ``cfg.security`` is already resolved (:func:`shadow.cli._services.secure`)."""
    from shadow import security
    from shadow.worker.address import bind_and_advertise

    bind, host = bind_and_advertise(cfg.host, cfg.front)
    cfg.host = bind
    workdir = tempfile.mkdtemp(prefix="shadow-agent-")  # 0700: the jobs' configs and reports
    agent = Agent(cfg, host, workdir)
    keys = security.client_from_config(cfg.security)
    sock = SocketFactory(zmq.Context.instance(), keys=keys).dealer(None, M.socket_limit("agent"))
    # as a worker's control socket: a connection silent past the front's loss timeout is
    # replaced, under the same routing id (the front hands it over), so the front knows it
    sock.setsockopt(zmq.ROUTING_ID, routing_id())
    for option, value in silence_options(AGENT_LOST_S).items():
        sock.setsockopt(option, value)
    sock.connect(cfg.front)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    logger.info("agent %s serving the front at %s: jobs here at %s", agent.name, cfg.front, host)
    heard, told = time.monotonic(), 0.0
    try:
        while not stopping:
            now = time.monotonic()
            if now - told >= BEAT_S:
                told = now
                try:
                    sock.send(M.encode("agent", **agent.beat()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the front is away: the next beat says it all again
            if sock.poll(200):
                try:
                    msg = M.decode(sock.recv(zmq.NOBLOCK))
                except (zmq.Again, M.MessageError) as exc:
                    logger.warning("rejected a message from the front: %s", exc)
                    continue
                if msg["t"] == "agent_jobs":
                    heard = time.monotonic()
                    agent.reconcile(msg["jobs"])
                elif msg["t"] == "error":
                    logger.error("the front at %s refused this agent: %s", cfg.front, msg["message"])
            if time.monotonic() - heard > 30 and agent.jobs:
                heard = time.monotonic()
                logger.warning("the front at %s has not answered for 30 s; the jobs here go on", cfg.front)
            agent.tick()
    finally:
        agent.stop_all()
        sock.close(linger=0)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
