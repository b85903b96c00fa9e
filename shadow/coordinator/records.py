"""What the coordinator knows about each worker and the attached job (all of it can be
rebuilt from the workers after a coordinator restart: see :mod:`rebuild`)."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from shadow import knobs


@dataclass
class WorkerRec:
    ident: bytes
    id: int
    data: str
    serve: str
    pid: int
    last_seen: float
    epoch: int = -1
    configured: int = -1
    prepared: int = -1
    applied: int = -1
    seen: int = -1
    stale: str = ""
    rejected: dict = field(default_factory=dict)
    frames_in: int = 0
    bytes_in: int = 0
    lost: bool = False
    session: dict | None = None  # what a rejoining worker holds (coordinator restart)
    seq: list = field(default_factory=list)  # data messages received per rank (its heartbeat)
    busy_at: float = 0.0  # last time its received-frame count moved
    transit: str = ""  # frames sent to it never arrived (set here, cleared by the next configure)
    joined_at: float = 0.0  # when its current data stream began (trainer counts before it do not apply)
    out: bool = False  # a replica taken out of service (the shard goes on on its peer)

    def alive(self, now: float) -> bool:
        return now - self.last_seen < knobs.get("WORKER_LOST_S")


@dataclass
class JobRec:
    name: str
    job_id: int
    epoch: int
    layout: dict
    layout_hash: int
    world: int
    optim: dict
    base: int
    ranges: list
    trainers: dict  # rank -> ident
    status: str = "configuring"
    cut: int = -2  # set to base - 1 at start
    cut_time: float = 0.0
    attach_time: float = field(default_factory=time.time)
    detached: set = field(default_factory=set)
    resync_requested: bool = False
    gen: int = 0  # replica joins started
    joining: dict = field(default_factory=dict)  # worker id -> {"gen", "from": {rank: m}, "at": m - 1}
    writers: dict = field(default_factory=dict)  # shard -> worker id asked to persist it
    hold: int | None = None  # the cut stays at or below this while a replica copies from its peer
    sent: dict = field(default_factory=dict)  # rank -> deque of (time, messages sent per worker)
    reason: str = ""  # why the job is degraded
    degraded_at: float = 0.0  # monotonic time of the last degrade
    audit: dict = field(default_factory=lambda: {"checked": 0, "mismatches": 0, "last_iteration": None,
                                                  "max_ulp": 0, "last_mismatch": ""})


def job_id_for(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
