"""The coordinator: membership, the consistent cut, status and restore discovery.

One ROUTER socket; every peer (worker, trainer rank, CLI) talks to it with a DEALER.
The cut rule: iteration k is declared applied only when every worker has reported
PREPARED(k); then every worker is told to apply through k and every trainer rank
learns the new cut (its flow-control credit).
"""

from __future__ import annotations

import logging
import time

import zmq

from shadow import knobs
from shadow.coordinator.attach import AttachMixin
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.queries import QueryMixin
from shadow.coordinator.rebuild import RejoinMixin
from shadow.coordinator.records import JobRec, WorkerRec
from shadow.coordinator.replicas import ReplicaMixin
from shadow.coordinator.trainers import TrainerMixin
from shadow.transport import SocketFactory
from shadow.wire import messages as M

logger = logging.getLogger(__name__)

#: what only a registered worker sends (from anyone else it is counted and dropped)
WORKER_ONLY = frozenset({"configured", "prepared", "persisted", "audited", "stale", "copied"})


class Coordinator(AttachMixin, ReplicaMixin, RejoinMixin, QueryMixin, TrainerMixin):
    """Membership, the committed cut, attaches, replicas and persistence of one cluster.

    Threads: :meth:`run` (the ``coordinator`` thread, or the process's main thread for
    ``shadow coordinator``) owns the ROUTER socket and every field: each message and each
    periodic step runs there, one at a time, so nothing is locked. :meth:`stop` (a signal
    handler) only sets a flag the loop reads. The metrics endpoint's HTTP thread reads the
    fields without a lock (``coordinator.metrics.samples`` copies what it reads and never
    writes); the :class:`~shadow.security.Guard` has its own thread and counters."""

    def __init__(self, bind: str, workers: int, persist: dict | None = None, guard=None, replicas: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"a cluster needs at least one worker, got workers={workers}")
        if replicas < 1 or workers % replicas:
            raise ValueError(
                f"replicas={replicas} must be >= 1 and divide workers={workers} "
                "(each shard is held by `replicas` workers)"
            )
        self.bind = bind
        self.expected = workers
        self.replicas, self.nshards = replicas, workers // replicas
        self.ctx = zmq.Context.instance()
        self.workers: list[WorkerRec] = []
        self.job: JobRec | None = None
        # job name -> {"ranks": {rank: (ident, msg)}, "bytes": {rank: size held}, "held": their sum,
        #              "deadline": t, ...}
        self.pending: dict[str, dict] = {}
        self._msg_bytes = 0  # raw size of the message being handled (the pending attach bound)
        self._failed_at: dict[str, float] = {}  # handler or periodic call -> when its failure was last logged
        self.rejected: dict[str, int] = {}
        self.epoch = 0
        self._stop = False
        self.started = time.time()
        self.persist = Persistence(persist or {})
        self.tokens: dict[int, int] = {}  # iteration -> tokens seen, for token schedules
        self.guard = guard  # shadow.security.Guard when CURVE is on
        self.retired: dict | None = None  # memory info of the previous epoch, while the new one bootstraps
        self.resyncs: dict[str, int] = {}  # job -> resyncs asked of its trainers
        self.starting: dict[int, dict] = {}  # pid -> a worker still compiling its kernels (not registered yet)

    def run(self) -> None:
        self.sock = SocketFactory(self.ctx, guard=self.guard).router(M.socket_limit("coordinator"))
        self.sock.bind(self.bind)
        logger.info("coordinator listening on %s, expecting %d workers", self.bind, self.expected)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop:
                if poller.poll(timeout=200):
                    for _ in range(256):
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(parts)
                for name in ("start_attaches", "expire_attaches", "check_workers"):
                    self._survive(name)
        finally:
            self.sock.close(linger=0)
            if self.guard is not None:
                self.guard.stop()

    def stop(self) -> None:
        self._stop = True

    # -- plumbing --------------------------------------------------------------------
    def _reply(self, envelope: list[bytes], kind: str, **fields) -> None:
        self.sock.send_multipart(envelope + [M.encode(kind, **fields)])

    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _survive(self, name: str) -> None:
        """Run periodic step ``_<name>``; an exception (state built from some message) is
        counted and logged, and the loop goes on."""
        try:
            getattr(self, "_" + name)()
        except Exception:
            self._failed("periodic_" + name, f"periodic step {name}")

    def _failed(self, reason: str, what: str) -> None:
        """Count a failure under ``reason`` (status ``rejected``, metric
        ``shadow_rejected_frames{worker="coordinator"}``); log it with its traceback, once
        a minute per reason at most."""
        self._count(reason)
        now = time.monotonic()
        if now - self._failed_at.get(reason, float("-inf")) >= 60.0:
            self._failed_at[reason] = now
            logger.exception("%s failed (%d times so far); the coordinator carries on", what, self.rejected[reason])

    def _on_message(self, parts: list[bytes]) -> None:
        if len(parts) < 2:
            self._count("malformed")
            return
        envelope, raw = parts[:-1], parts[-1]
        try:
            msg = M.decode(raw)
        except M.MessageError as exc:
            self._count(exc.reason)
            logger.warning("rejected control message: %s", exc)
            self._reply(envelope, "error", code="malformed", message=f"rejected: {exc}")
            return
        handler = getattr(self, "_on_" + msg["t"], None)
        if handler is None:
            self._count("unexpected")
            self._reply(envelope, "error", code="refused", message=f"coordinator does not accept {msg['t']!r} messages")
            return
        if msg["t"] in WORKER_ONLY and self._worker(envelope) is None:
            self._count("not_a_worker")  # (or a worker of a previous coordinator, not rejoined yet)
            return
        self._msg_bytes = len(raw)
        try:
            handler(envelope, msg)
        except Exception as exc:  # a bug meeting an input: count it, answer, and carry on
            self._failed("handler_" + msg["t"], f"the {msg['t']} handler")
            try:
                self._reply(
                    envelope,
                    "error",
                    code="internal",
                    message=f"the coordinator could not handle this {msg['t']} message "
                    f"({type(exc).__name__}: {exc}); it was dropped",
                )
            except Exception:  # the envelope itself may be the problem
                logger.debug("could not answer a failed %s message", msg["t"], exc_info=True)

    def _worker(self, envelope: list[bytes]) -> WorkerRec | None:
        for w in self.workers:
            if w.ident == envelope[0]:
                return w
        return None

    # -- workers ------------------------------------------------------------------------
    def _on_starting(self, env, msg) -> None:
        """A worker process is up and compiling its kernels; it registers when they are ready."""
        self.starting[msg["pid"]] = {
            "worker_id": msg["worker_id"],
            "pid": msg["pid"],
            "seconds": msg["seconds"],
            "last_seen": time.monotonic(),
        }

    def ready_workers(self, now: float | None = None) -> list[WorkerRec]:
        """Registered workers that answer: kernels compiled, sockets bound."""
        now = time.monotonic() if now is None else now
        return [w for w in self.workers if w.alive(now)]

    def _on_register(self, env, msg) -> None:
        self.starting.pop(msg["pid"], None)
        w = self._enrol(env, msg, fresh=True)
        if w is not None:
            self._maybe_resync()
            self._start_attaches()

    def _enrol(self, env, msg, fresh: bool) -> WorkerRec | None:
        """A worker (re)takes a slot: its own ``worker_id`` if it names one, else the first free.
        ``fresh``: it holds no state (a register, not a rejoin)."""
        now = time.monotonic()
        w = self._worker(env)
        slot = msg["worker_id"] if w is None else w.id
        taken = {x.id: x for x in self.workers}
        awaiting_copy = False
        if slot in taken and (w is None or fresh):
            # a restarted (or reset) worker takes its slot back: it has no state
            w = taken[slot]
            logger.warning("worker %d re-registered (pid %d -> %d, data %s)", slot, w.pid, msg["pid"], msg["data"])
            w.ident, w.data, w.serve, w.pid, w.last_seen = env[0], msg["data"], msg["serve"], msg["pid"], now
            w.lost, w.stale, w.transit, w.configured = False, "restarted", "", -1
            w.prepared, w.applied, w.seen, w.seq, w.joined_at = -1, -1, -1, [], now
            self._cancel_join(w)
            awaiting_copy = self._start_join(w)
            if not awaiting_copy:
                w.out = False
                self._degrade(f"worker {slot} restarted")
        elif w is None:
            if slot < 0:
                slot = next((i for i in range(self.expected) if i not in taken), -1)
            if not 0 <= slot < self.expected:
                self._reply(
                    env,
                    "error",
                    code="refused",
                    message=f"cluster already has its {self.expected} workers "
                    f"(or worker_id={msg['worker_id']} is out of range)",
                )
                return None
            w = WorkerRec(env[0], slot, msg["data"], msg["serve"], msg["pid"], now)
            self.workers.append(w)
            self.workers.sort(key=lambda x: x.id)
        w.memory = msg.get("memory", -1)
        logger.info("worker %d registered (pid %d, data %s)", w.id, w.pid, w.data)
        self._reply(env, "registered", worker_id=w.id, awaiting_copy=awaiting_copy)
        if len(self.ready_workers(now)) == self.expected:
            logger.info("all %d workers ready", self.expected)
        return w

    def _on_heartbeat(self, env, msg) -> None:
        w = self._worker(env)
        if w is None:  # a worker of a previous coordinator: ask what it holds
            self._reply(env, "reregister")
            return
        w.last_seen = time.monotonic()
        if msg["seq"] != w.seq:  # frames taken (not merely received: rejected ones do not count)
            w.busy_at = w.last_seen
        w.seq = msg["seq"]
        w.epoch, w.applied, w.seen, w.stale = msg["epoch"], msg["applied"], msg["seen"], msg["stale"]
        w.observe(w.last_seen, msg["bytes_in"], msg["replay_s"], msg["replayed"])
        w.rejected, w.frames_in, w.bytes_in = msg["rejected"], msg["frames_in"], msg["bytes_in"]
        w.memory = msg.get("memory", -1)
        if self.job is not None and self.job.status == "degraded":
            self._maybe_resync()

    def _check_workers(self) -> None:
        now = time.monotonic()
        for pid in [p for p, st in self.starting.items() if now - st["last_seen"] > knobs.get("WORKER_LOST_S")]:
            del self.starting[pid]  # died while compiling (shadow cluster starts another)
        for w in self.workers:
            alive = w.alive(now)
            if not alive and not w.lost:
                w.lost = True
                logger.error("worker %d (pid %d) is lost: no heartbeat for %.1f s", w.id, w.pid, now - w.last_seen)
                self._replica_down(w, f"worker {w.id} lost")
            elif alive and w.lost:
                w.lost = False
                logger.info("worker %d is back", w.id)
                self._maybe_resync()
        self._check_transit(now)

    def _degrade(self, reason: str) -> None:
        job = self.job
        if job is None or job.status in ("detached", "configuring"):
            return
        job.status, job.reason, job.degraded_at = "degraded", reason, time.monotonic()
        for ident in job.trainers.values():
            self._reply([ident], "degraded", epoch=job.epoch, reason=f"{reason}; checkpoint frozen at {job.cut}")
        self._maybe_resync()

    def _maybe_resync(self) -> None:
        """Once every worker slot is alive again, ask the trainers to resync the cluster
        (a new epoch bootstrapped from their state at an iteration boundary)."""
        job, now = self.job, time.monotonic()
        if job is None or job.status != "degraded" or job.resync_requested:
            return
        if len(self.workers) < self.expected or not all(w.alive(now) for w in self.workers):
            return
        if not all(w.last_seen > job.degraded_at for w in self.workers):
            return  # every worker must have answered since the failure (a frozen one has not)
        job.resync_requested = True
        self.resyncs[job.name] = self.resyncs.get(job.name, 0) + 1
        logger.info("job %s: all %d workers alive; asking the trainers to resync", job.name, len(self.workers))
        for ident in job.trainers.values():
            self._reply([ident], "resync", epoch=job.epoch)

    def _on_configured(self, env, msg) -> None:
        w, job = self._worker(env), self.job
        if w is None or job is None or msg["epoch"] != job.epoch:
            return
        w.configured = msg["epoch"]
        w.prepared, w.stale = job.base - 1, ""
        if job.status == "configuring" and all(x.configured == job.epoch for x in self.workers):
            job.status = "bootstrapping"
            workers = [
                {
                    "id": x.id,
                    "data": x.data,
                    "start": job.ranges[x.id][0],
                    "stop": job.ranges[x.id][1],
                    "shard": self.shard_of(x),
                }
                for x in self.workers
            ]
            for _rank, ident in sorted(job.trainers.items()):
                self._reply([ident], "attached", epoch=job.epoch, job_id=job.job_id, workers=workers)
            logger.info("job %s epoch %d attached: %d ranks, %d workers", job.name, job.epoch, job.world, len(workers))

    def _on_prepared(self, env, msg) -> None:
        w, job = self._worker(env), self.job
        if w is None or job is None or msg["epoch"] != job.epoch:
            return
        w.prepared = max(w.prepared, msg["iteration"])
        if msg["tokens"] is not None:
            self.tokens[msg["iteration"]] = msg["tokens"]
        self._advance_cut()

    def _advance_cut(self) -> None:
        """The cut: the newest iteration every healthy worker has prepared (and, while a
        replica copies from its peer, no further than the copied iteration)."""
        job = self.job
        now = time.monotonic()
        live = (
            [x for x in self.workers if not x.out and not x.transit and x.alive(now)]
            if self.replicas > 1
            else self.workers
        )
        if job is None or not live:
            return
        cut = min(x.prepared for x in live)
        if job.cut_ceiling is not None:
            cut = min(cut, job.cut_ceiling)
        if cut <= job.cut:
            return
        job.cut, job.cut_time = cut, time.time()
        if job.status == "bootstrapping":
            job.status = "running"
        persist = self.persist.local_due(cut, self.tokens.get(cut))
        writers = {self.shard_of(x): x for x in reversed(live)}  # one replica per shard writes
        for x in live:
            writes = bool(persist) and writers.get(self.shard_of(x)) is x
            if writes:
                job.writers[self.shard_of(x)] = x.id
            # the writer snapshots the cut in the apply pass itself
            self._reply([x.ident], "apply", epoch=job.epoch, iteration=cut, persist=writes)
        for ident in job.trainers.values():
            self._reply([ident], "progress", epoch=job.epoch, applied=cut)
        for it in [i for i in self.tokens if i < cut]:
            del self.tokens[it]

    def _on_persisted(self, env, msg) -> None:
        job = self.job
        if job is None or msg["epoch"] != job.epoch:
            return
        for kind, iteration, per_shard in self.persist.on_report(job, msg, self.nshards):
            if kind == "upload":
                for shard, r in per_shard.items():
                    x = self.workers[job.writers.get(shard, shard)]
                    self._reply(
                        [x.ident],
                        "upload",
                        epoch=job.epoch,
                        iteration=iteration,
                        bytes=r["bytes"],
                        checksum=r["checksum"],
                    )

    def _on_audited(self, env, msg) -> None:
        job = self.job
        if job is None or msg["epoch"] != job.epoch:
            return
        a = job.audit
        a["checked"] += msg["checked"]
        a["last_iteration"] = msg["iteration"]
        a["max_ulp"] = max(a["max_ulp"], msg["max_ulp"])
        if msg["ok"] and msg["detail"]:
            a["last_deviation"] = f"iteration {msg['iteration']}: {msg['detail']}"
        if not msg["ok"]:
            a["mismatches"] += 1
            a["last_mismatch"] = f"iteration {msg['iteration']}: {msg['detail']}"
            logger.error(
                "divergence audit failed at iteration %d (max %d ulp): %s",
                msg["iteration"],
                msg["max_ulp"],
                msg["detail"],
            )
            for ident in job.trainers.values():
                self._reply(
                    [ident], "audit", epoch=job.epoch, iteration=msg["iteration"], ok=False, detail=msg["detail"]
                )

    def _on_stale(self, env, msg) -> None:
        w = self._worker(env)
        if w is not None:
            w.stale = msg["reason"]
            logger.error("worker %d reports stale state: %s", w.id, msg["reason"])
            if self.job is not None and msg["epoch"] == self.job.epoch and self.job.status != "degraded":
                if w.id in self.job.joining:  # the peer copy failed
                    self._cancel_join(w)
                    w.out = False
                self._replica_down(w, f"worker {w.id} is stale ({msg['reason']})")

    def _on_shutdown(self, env, msg) -> None:
        for w in self.workers:
            self._reply([w.ident], "shutdown")
        self._stop = True
