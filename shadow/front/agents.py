"""A shared cluster's other hosts, as its front sees them: each runs a ``shadow agent`` that
says every second what the host gives jobs (memory, cores) and how each job it runs is
doing (:class:`AgentRec`), and hears back which jobs it is to run (``agent_jobs``, the whole
set each time, so a lost message or a restart on either side is repaired at the next beat).

A job placed on an agent is a :class:`RemoteProcs`: the same face as
:class:`~shadow.front.jobs.JobProcs` (address, report, exit, ask for the last iteration,
stop), built from what the agent reports. :func:`shadow.front.spread.place` picks the
hosts for a job."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from shadow.core.jobs import job_name_problem
from shadow.front import report
from shadow.front.admission import Budget, Need
from shadow.front.jobs import START_TRIES

logger = logging.getLogger(__name__)

#: seconds after which an agent that has not been heard counts as lost: no job is placed
#: there, and its jobs show no report (they may well run on; the agent picks up when heard)
AGENT_LOST_S = 10.0
#: agents a front keeps at once
MAX_AGENTS = 1024
#: jobs one agent's message may name
MAX_AGENT_JOBS = 4096
#: an agent's name, and a host it names
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-_]{0,252}|\[?[0-9A-Fa-f:.]{2,45}\]?")


class AgentRec:
    """One agent: where it is, what it gives jobs, when it was last heard, and the jobs it
    reports (job -> its row: port, pid, exit status, report)."""

    def __init__(self, name: str, env: list[bytes], msg: dict) -> None:
        self.name, self.env = name, env
        self.host = msg["host"]
        self.budget = Budget(msg["memory"], range(msg["cores"]))
        self.cores_per_job = msg["cores_per_job"]
        self.heard = time.monotonic()
        self.rows: dict[str, dict] = {}

    def update(self, env: list[bytes], msg: dict) -> None:
        self.env, self.host, self.heard = env, msg["host"], time.monotonic()
        self.budget.memory, self.budget.cores = msg["memory"], list(range(msg["cores"]))
        self.cores_per_job = msg["cores_per_job"]
        self.rows = {row["job"]: row for row in msg["jobs"]}

    def alive(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self.heard < AGENT_LOST_S


def checked(msg: dict) -> str | None:
    """Why an ``agent`` message does not hold what an agent says (None: it does); its job
    rows' reports are cleaned in place (:func:`~shadow.front.report.checked`)."""
    if not NAME.fullmatch(msg["name"]):
        return f"agent name {msg['name'][:80]!r} is not 1-64 letters, digits, '.', '_' or '-'"
    if not HOST.fullmatch(msg["host"]):
        return f"agent {msg['name']}: host {msg['host'][:80]!r} is not a host name or address"
    if msg["memory"] < 0 or not 0 <= msg["cores_per_job"] <= msg["cores"] <= 1 << 16:
        return f"agent {msg['name']}: memory, cores or cores_per_job out of range"
    if len(msg["jobs"]) > MAX_AGENT_JOBS:
        return f"agent {msg['name']}: {len(msg['jobs'])} jobs, over {MAX_AGENT_JOBS}"
    for row in msg["jobs"]:
        if not (
            isinstance(row, dict)
            and isinstance(row.get("job"), str)
            and job_name_problem(row["job"]) is None
            and _int(row.get("port"), 0, 65535)
            and (row.get("pid") is None or _int(row.get("pid"), 1, 1 << 31))
            and (row.get("exited") is None or _int(row.get("exited"), -(1 << 16), 1 << 16))
        ):
            return f"agent {msg['name']}: a malformed job row"
        row["report"] = report.checked(row.get("report"))
    return None


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


class RemoteProcs:
    """A job the front placed on ``agent``: what the agent reports of it, with the face of
    :class:`~shadow.front.jobs.JobProcs`. Its processes start when the agent next hears
    the front (its port is known once the agent reports it)."""

    def __init__(
        self, name: str, agent: AgentRec, need: Need, cores: tuple[int, ...], slots: tuple[int, ...] = ()
    ) -> None:
        self.name, self.agent, self.need, self.cores, self.slots = name, agent, need, cores, slots
        self.join = ""  # a spread job's part: its coordinator's address, once known
        self.since = time.monotonic()
        self.proc = None
        self.port = 0
        self.pid: int | None = None
        self.tries = 0
        self.reported = False
        self.ended_why = ""
        self.last_asked = False  # its memory is wanted: the agent asks its coordinator for the last iteration

    @property
    def where(self) -> str:
        return self.agent.name

    @property
    def address(self) -> str:
        return f"tcp://{self.agent.host}:{self.port}"

    def start(self) -> None:
        self.tries = START_TRIES  # the agent starts it again itself if it exits before it came up

    def row(self) -> dict | None:
        """The agent's row of this job while the agent is heard from."""
        return self.agent.rows.get(self.name) if self.agent.alive() else None

    def report(self) -> dict[str, Any] | None:
        row = self.row()
        if row is None:
            return None
        self.port, self.pid = row["port"], row.get("pid")
        rep = row.get("report")
        if rep is not None and time.time() - rep["time"] <= report.STALE_S:
            self.reported = True
            return rep
        return None

    def ask_last(self) -> None:
        self.last_asked = True

    def exited(self) -> int | None:
        row = self.row()
        return None if row is None else row.get("exited")

    def stop(self, wait_s: float = 10.0) -> None:
        """Nothing to do here: the agent stops the job's processes once the front's next
        ``agent_jobs`` leaves it out."""

    def kill(self) -> None:
        """As :meth:`stop`."""

    def wanted(self, workers: int, replicas: int) -> dict[str, Any]:
        """This job's entry in the agent's ``agent_jobs`` (a spread job's: with the slots it
        runs there, and the coordinator they join when that is elsewhere)."""
        entry = {"job": self.name, "workers": workers, "replicas": replicas, "last": self.last_asked}
        if self.slots:
            entry.update(slots=list(self.slots), join=self.join)
        return entry
