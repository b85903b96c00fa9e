"""What the coordinator knows about each worker and the attached job (all of it can be
rebuilt from the workers after a coordinator restart: see :mod:`rebuild`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field
from enum import Enum

from shadow.wire import tags


class JobStatus(str, Enum):
    """Where the attached job is: ``configuring`` (workers told the new epoch's ranges),
    ``bootstrapping`` (every worker configured; the first cut not yet reached), ``running``,
    ``degraded`` (the checkpoint is frozen until the trainers resync), ``detached`` (every
    rank detached)."""

    CONFIGURING = "configuring"
    BOOTSTRAPPING = "bootstrapping"
    RUNNING = "running"
    DEGRADED = "degraded"
    DETACHED = "detached"


class Health(str, Enum):
    """A registered worker as the cluster sees it (status ``health``, metric ``shadow_workers``):
    ``lost`` (no heartbeat for SHADOW_WORKER_LOST_S), ``joining`` (a replica copying its
    peer's state), ``stale`` (its state or its data stream is damaged), ``out`` (a replica
    taken out of service), else ``ok``. A process still compiling its kernels, not yet
    registered, shows as ``starting``."""

    OK = "ok"
    JOINING = "joining"
    STALE = "stale"
    OUT = "out"
    LOST = "lost"
    STARTING = "starting"


class JoinStage(str, Enum):
    """Where a replica joining its shard is: ``voting`` (the ranks are telling from which
    iteration each streams to it) or ``copying`` (it copies the iteration before that from
    its peer; the cut is held there until it has)."""

    VOTING = "voting"
    COPYING = "copying"


@dataclass
class Join:
    """One replica join of generation ``gen``: each rank's first streamed iteration
    (``starts``), and the iteration it copies (``at``, once every rank agreed)."""

    gen: int
    starts: dict[int, int] = field(default_factory=dict)  # rank -> first iteration it streams to the replica
    at: int | None = None

    @property
    def stage(self) -> JoinStage:
        return JoinStage.VOTING if self.at is None else JoinStage.COPYING


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
    received: int = -1
    stale: str = ""
    rejected: dict = field(default_factory=dict)
    frames_in: int = 0
    bytes_in: int = 0
    lost: bool = False
    assignment: dict | None = None  # what a rejoining worker holds (coordinator restart)
    seq: list = field(default_factory=list)  # data messages received per rank (its heartbeat)
    busy_at: float = 0.0  # last time its taken-frame counts (seq) moved
    undelivered: str = ""  # frames sent to it never arrived (set here, cleared by the next configure)
    joined_at: float = 0.0  # when its current data stream began (trainer counts before it do not apply)
    out_of_service: bool = False  # a replica taken out of service (the shard goes on on its peer)
    kept: bool = False  # its configure kept the previous epoch's state as the base (``keep``)
    replay_s: float = 0.0  # seconds it spent applying iterations (its heartbeat)
    replayed: int = 0  # iterations it applied
    rate_in: float = 0.0  # bytes/s received, over the last few heartbeats
    replay_per_it: float | None = None  # seconds per applied iteration, over the last few heartbeats
    memory: int = -1  # bytes it has free (its register, rejoin and heartbeats; -1: unknown)
    files: str = ""  # its files socket: the shard files of its local tier (its heartbeats)
    disk: dict | None = None  # {"id", "dir", "host"} of its local tier (its heartbeats; shadow.persist.disks)
    data_mode: str = "plain"  # how its data socket takes frames: plain, mac or curve (its register)
    data_key: bytes | None = None  # a keyed cluster: its current configuration's data key (shadow.wire.tags)
    retired_key: bytes | None = None  # ... of the one before (its state answers while a new epoch bootstraps)
    files_key: bytes | None = None  # mac mode: what tickets for its files socket derive from (its register)
    slot_token: bytes | None = None  # what a restarted process of this slot proves itself with (shadow.worker.slot)
    _last_hb: float = 0.0

    def fetch_ticket(self, retired: bool = False) -> dict:
        """What a fetch from this worker's serve socket needs in mac mode, for one reader:
        a fresh ticket and its key (handed out over CURVE only); ``{}`` otherwise. A ticket
        reads the configuration whose key it derives from and no other: the current one, or
        (``retired``) the one before, which answers while a new epoch bootstraps."""
        key = self.retired_key if retired else self.data_key
        if self.data_mode != "mac" or key is None:
            return {}
        ticket = tags.new_ticket()
        return {"ticket": ticket, "key": tags.ticket_key(tags.serve_key(key), ticket)}

    def files_ticket(self, job: str | None = None) -> dict:
        """What a read from this worker's files socket needs in mac mode, for one reader: a
        fresh ticket and its key (handed out over CURVE only); ``{}`` otherwise. ``job``: the
        ticket reads that job's files only (a job-scoped reader's); None: every job's."""
        if self.data_mode != "mac" or self.files_key is None:
            return {}
        ticket = tags.files_ticket(self.files_key, job)
        return {"ticket": ticket, "key": tags.ticket_key(self.files_key, ticket)}

    def observe(self, now: float, bytes_in: int, replay_s: float, replayed: int) -> None:
        """Fold one heartbeat's counters into the recent rates (exponential average, ~4 beats)."""
        if self._last_hb and now > self._last_hb and bytes_in >= self.bytes_in:
            rate = (bytes_in - self.bytes_in) / (now - self._last_hb)
            self.rate_in = rate if not self.rate_in else 0.75 * self.rate_in + 0.25 * rate
        if replayed > self.replayed and replay_s >= self.replay_s:
            per = (replay_s - self.replay_s) / (replayed - self.replayed)
            self.replay_per_it = per if self.replay_per_it is None else 0.75 * self.replay_per_it + 0.25 * per
        self._last_hb, self.replay_s, self.replayed = now, replay_s, replayed

    def alive(self, now: float, lost_s: float) -> bool:
        """Heard from within the last ``lost_s`` seconds."""
        return now - self.last_seen < lost_s


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
    status: JobStatus = JobStatus.CONFIGURING
    cut: int = -2  # set to base - 1 at start
    cut_time: float = 0.0
    attach_time: float = field(default_factory=time.time)
    detached: set = field(default_factory=set)
    resync_requested: bool = False
    gen: int = 0  # replica joins started
    generation: int = 0  # lineage: raised when an attach goes back behind what the cluster holds
    joining: dict[int, Join] = field(default_factory=dict)  # worker id -> its join in progress
    writers: dict = field(default_factory=dict)  # shard -> ids of the workers last asked to persist it
    verified: int = -1  # the newest iteration a divergence audit found bit-identical to the trainer
    diverged: int | None = None  # once a divergence is found: the last iteration known to be right
    cut_ceiling: int | None = None  # the cut stays at or below this while a replica copies from its peer
    sent: dict = field(default_factory=dict)  # rank -> deque of (time, messages sent per worker)
    reason: str = ""  # why the job is degraded
    created: float = field(default_factory=time.monotonic)  # when the coordinator started (or rebuilt) it
    heard: dict[int, float] = field(default_factory=dict)  # rank -> monotonic time of its last trainer_hb
    dropped: str = ""  # why ``shadow drop`` detached it, or "" (its trainers are told so if they come back)
    degraded_at: float = 0.0  # monotonic time of the last degrade
    launch: dict | None = None  # the launcher's run and restart round the ranks attached in ({"run", "restart"})
    took_over: str = ""  # what the ranks were told when this epoch took over a run that never detached
    keep: int | None = None  # the epoch whose state the workers were offered to keep as this one's base
    # what each rank's token derives from (rank_token): drawn per job, kept by the workers in
    # their configure, so a rebuilt job still knows its ranks
    secret: bytes = field(default_factory=lambda: os.urandom(32))
    audit: dict = field(
        default_factory=lambda: {
            "checked": 0,
            "mismatches": 0,
            "last_iteration": None,
            "max_ulp": 0,
            "last_mismatch": "",
        }
    )

    def rank_token(self, rank: int) -> bytes:
        """What proves a connection is rank ``rank`` of this epoch: given to the rank alone in
        its ``attached`` (over its own connection), carried in its heartbeats, and asked for
        before a rank's messages are taken from another connection."""
        return hmac.digest(self.secret, b"shadow rank v1 %d %d" % (self.epoch, rank), hashlib.sha256)[:16]

    def rank_token_ok(self, rank: int, token: object) -> bool:
        return isinstance(token, bytes) and hmac.compare_digest(token, self.rank_token(rank))

    def last_heard(self, rank: int) -> float:
        """When rank ``rank`` was last heard from (monotonic): its last ``trainer_hb``, else
        when the coordinator started the job (its attach, or a rebuild after a restart)."""
        return self.heard.get(rank, self.created)

    def ranks_heard(self, now: float, window_s: float) -> list[int]:
        """The ranks heard from within the last ``window_s`` seconds."""
        return [r for r in range(self.world) if now - self.last_heard(r) < window_s]


def job_id_for(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
