"""Worker membership: processes starting, registering (or taking their slot back after a
restart), heartbeats, and workers lost or reporting stale state."""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any

from shadow.coordinator.attach import Attach
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.cut import Cut
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.records import JobStatus, WorkerRec
from shadow.coordinator.replicas import Replicas
from shadow.wire import tags

logger = logging.getLogger(__name__)

Msg = dict[str, Any]


def starting_cap(expected: int) -> int:
    """How many worker processes still compiling the coordinator keeps track of: a
    cluster's workers starting twice over (restarts while the first ones compile)."""
    return max(8, 2 * expected)


class Membership:
    """Handlers ``starting``, ``register``, ``heartbeat`` and ``stale`` (workers), and the
    periodic :meth:`check_workers`."""

    def __init__(self, state: ClusterState, out: Outbox, cut: Cut, replicas: Replicas, attach: Attach) -> None:
        self.state, self.out, self.cut, self.replicas, self.attach = state, out, cut, replicas, attach

    def on_starting(self, env: list[bytes], msg: Msg) -> None:
        """A worker process is up and compiling its kernels; it registers when they are ready.
        At most :func:`starting_cap` are kept (the least recently heard goes first): a flood
        of them costs a bounded table, and a status a bounded list."""
        starting = self.state.starting
        if msg["pid"] not in starting and len(starting) >= starting_cap(self.state.expected):
            del starting[min(starting, key=lambda pid: starting[pid]["last_seen"])]
            self.state.rejected.add("starting_evicted")
        starting[msg["pid"]] = {
            "worker_id": msg["worker_id"],
            "pid": msg["pid"],
            "seconds": msg["seconds"],
            "last_seen": time.monotonic(),
        }

    def on_register(self, env: list[bytes], msg: Msg) -> None:
        self.state.starting.pop(msg["pid"], None)
        w = self.enrol(env, msg, fresh=True)
        if w is not None:
            self.cut.maybe_resync()
            self.attach.start_attaches()

    def enrol(self, env: list[bytes], msg: Msg, fresh: bool) -> WorkerRec | None:
        """A worker (re)takes a slot: its own ``worker_id`` if it names one, else the first free.
        ``fresh``: it holds no state (a register, not a rejoin)."""
        st, now = self.state, time.monotonic()
        mode = msg.get("data_mode", "curve" if st.keyed else "plain")
        if mode not in (("mac", "curve") if st.keyed else ("plain",)):
            self.out.reply(
                env,
                "error",
                code="refused",
                message=f"this worker's data socket is {mode!r} and the coordinator "
                f"{'has keys: mac or curve' if st.keyed else 'has none: plain'}; give both the same security.* keys",
            )
            return None
        w = st.worker(env[0])
        slot = msg["worker_id"] if w is None else w.id
        taken = {x.id: x for x in st.workers}
        awaiting_copy = False
        if slot in taken and (w is None or fresh):
            w = self._take_back(env, msg, taken[slot], now)
            if w is None:
                return None
            awaiting_copy = self.replicas.start_join(w)
            if not awaiting_copy:
                w.out_of_service = False
                self.cut.degrade(f"worker {slot} restarted")
        elif w is None:
            w = self._new_slot(env, msg, slot, taken, now)
            if w is None:
                return None
        w.memory = msg.get("memory", -1)
        w.files, w.disk = msg.get("files", ""), msg.get("disk")
        w.data_mode = mode
        token = msg.get("slot_token")
        if not (isinstance(token, bytes) and len(token) == 16 and (w.slot_token is None or w.slot_token == token)):
            token = os.urandom(16)  # a new slot, or one taken over after its grace period: a token of its own
        w.slot_token = token
        key = msg.get("files_key")
        w.files_key = key if mode == "mac" and isinstance(key, bytes) and len(key) == tags.KEY_SIZE else None
        logger.info("worker %d registered (pid %d, data %s)", w.id, w.pid, w.data)
        local_dir = self.cut.persist.config.local.dir  # where the worker's shards are unless it has its own
        extra = {"local_dir": local_dir} if local_dir else {}
        self.out.reply(env, "registered", worker_id=w.id, awaiting_copy=awaiting_copy, slot_token=token, **extra)
        if len(st.ready_workers(now)) == st.expected:
            logger.info("all %d workers ready", st.expected)
        return w

    def _take_back(self, env: list[bytes], msg: Msg, held: WorkerRec, now: float) -> WorkerRec | None:
        """A restarted (or reset) worker takes slot ``held`` back, holding no state; None
        (refused, answered) while its previous process is alive and connected, or while the
        slot is kept for its own worker's token."""
        st, slot = self.state, held.id
        if held.ident != env[0] and not held.lost and self._holder_connected(held, msg["pid"]):
            st.refuse(st.sender_role, "slot_taken")
            logger.warning(
                "refused a register for slot %d (pid %d): worker %d (pid %d) is alive and still connected",
                slot,
                msg["pid"],
                held.id,
                held.pid,
            )
            self.out.reply(
                env,
                "error",
                code="busy",
                message=f"worker slot {slot} is held by a live, connected worker (pid {held.pid}); "
                "a worker takes a slot back once its previous process is gone",
            )
            return None
        left = self._reserved_for(held, msg, now)
        if held.ident != env[0] and left > 0:
            st.refuse(st.sender_role, "slot_reserved")
            logger.warning(
                "refused a register for slot %d (pid %d) without its token: kept for its own worker %.0f s more",
                slot,
                msg["pid"],
                left,
            )
            self.out.reply(
                env,
                "error",
                code="busy",
                message=f"worker slot {slot} is kept for its restarted worker (which brings the slot's token) "
                f"for {left:.0f} s more (tuning.slot_grace_s); a worker of another host or account takes it after",
            )
            return None
        w = held
        logger.warning("worker %d re-registered (pid %d -> %d, data %s)", slot, w.pid, msg["pid"], msg["data"])
        w.ident, w.data, w.serve, w.pid, w.last_seen = env[0], msg["data"], msg["serve"], msg["pid"], now
        w.lost, w.stale, w.undelivered, w.configured = False, "restarted", "", -1
        w.prepared, w.applied, w.received, w.seq, w.joined_at = -1, -1, -1, [], now
        self.replicas.cancel_join(w)
        return w

    def _new_slot(self, env: list[bytes], msg: Msg, slot: int, taken: dict, now: float) -> WorkerRec | None:
        """A new worker takes slot ``slot`` (negative: the first free); None (refused,
        answered) when the cluster has all its workers or the slot is out of range."""
        st = self.state
        if slot < 0:
            slot = next((i for i in range(st.expected) if i not in taken), -1)
        if not 0 <= slot < st.expected:
            self.out.reply(
                env,
                "error",
                code="refused",
                message=f"cluster already has its {st.expected} workers "
                f"(or worker_id={msg['worker_id']} is out of range)",
            )
            return None
        w = WorkerRec(env[0], slot, msg["data"], msg["serve"], msg["pid"], now)
        st.workers.append(w)
        st.workers.sort(key=lambda x: x.id)
        return w

    def _reserved_for(self, held: WorkerRec, msg: Msg, now: float) -> float:
        """Seconds slot ``held`` stays kept from a register that lacks its token (0: it may be
        taken): a dead worker's slot waits ``tuning.slot_grace_s`` after it was last heard."""
        token = msg.get("slot_token")
        if held.slot_token is None or (isinstance(token, bytes) and hmac.compare_digest(token, held.slot_token)):
            return 0.0
        return max(0.0, self.state.tuning.slot_grace_s - (now - held.last_seen))

    def _holder_connected(self, held: WorkerRec, pid: int) -> bool:
        """Whether the process holding a slot is still connected: asked by sending it a notice
        (a process that died has closed its connection at once; a live one learns that another
        process claimed its slot)."""
        return self.out.still_there(
            held.ident, "error", code="refused", message=f"another process (pid {pid}) asked for this worker's slot"
        )

    def on_heartbeat(self, env: list[bytes], msg: Msg) -> None:
        w = self.state.worker(env[0])
        if w is None:  # a worker of a previous coordinator: ask what it holds
            self.out.reply(env, "reregister")
            return
        w.last_seen = time.monotonic()
        if msg["seq"] != w.seq:  # frames taken (not merely received: rejected ones do not count)
            w.busy_at = w.last_seen
        w.seq = msg["seq"]
        w.epoch, w.applied, w.received, w.stale = msg["epoch"], msg["applied"], msg["seen"], msg["stale"]
        w.observe(w.last_seen, msg["bytes_in"], msg["replay_s"], msg["replayed"])
        w.rejected, w.frames_in, w.bytes_in = msg["rejected"], msg["frames_in"], msg["bytes_in"]
        w.memory = msg.get("memory", -1)
        w.files, w.disk = msg.get("files", ""), msg.get("disk")
        if self.state.status_is(JobStatus.DEGRADED):
            self.cut.maybe_resync()

    def check_workers(self) -> None:
        """Periodic: forget processes that died while compiling; mark workers lost (or back)."""
        st, now = self.state, time.monotonic()
        for pid in [p for p, x in st.starting.items() if now - x["last_seen"] > st.tuning.worker_lost_s]:
            del st.starting[pid]  # died while compiling (shadow cluster starts another)
        for w in st.workers:
            alive = st.alive(w, now)
            if not alive and not w.lost:
                w.lost = True
                logger.error("worker %d (pid %d) is lost: no heartbeat for %.1f s", w.id, w.pid, now - w.last_seen)
                self.replicas.down(w, f"worker {w.id} lost")
                self.cut.writer_lost(w)
            elif alive and w.lost:
                w.lost = False
                logger.info("worker %d is back", w.id)
                self.cut.maybe_resync()

    def on_stale(self, env: list[bytes], msg: Msg) -> None:
        st = self.state
        w = st.worker(env[0])
        if w is None:
            return
        w.stale = msg["reason"]
        logger.error("worker %d reports stale state: %s", w.id, msg["reason"])
        job = st.job
        if job is not None and msg["epoch"] == job.epoch and job.status != JobStatus.DEGRADED:
            if w.id in job.joining:  # the peer copy failed
                self.replicas.cancel_join(w)
                w.out_of_service = False
            self.replicas.down(w, f"worker {w.id} is stale ({msg['reason']})")
