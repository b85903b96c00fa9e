"""The shadow worker process: receive frames, prepare iterations, apply on the
coordinator's word, serve its shard for restores.

Sockets (all polled by one loop, every wait bounded by the heartbeat period):

* ``data`` (PULL, bound): GRAD / STATE / COMMIT frames from every trainer rank;
* ``ctrl`` (DEALER, connected to the coordinator): register, configure, prepared, apply;
* ``serve`` (ROUTER, bound): ``fetch`` requests from restore clients.

This module imports no torch.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter

import numpy as np
import zmq

from shadow import knobs
from shadow.layout import Layout
from shadow.persist.writer import ShardPersister
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.worker.commit import audit_shard, decode_commit, same
from shadow.worker.inbox import Inbox
from shadow.worker.peer import PeerCopy, PeerMixin
from shadow.worker.serve import ServeMixin
from shadow.worker.state import ShardState

logger = logging.getLogger(__name__)


class _Session:
    """What a worker holds for one attach epoch."""

    def __init__(self, msg: dict) -> None:
        self.config = msg  # sent back if the coordinator restarts (rejoin)
        self.epoch = msg["epoch"]
        self.job = msg["job"]
        self.job_id = msg["job_id"]
        self.layout = Layout.from_dict(msg["layout"])
        self.layout_hash = self.layout.hash
        self.world = msg["world"]
        self.base = msg["iteration"]
        self.state = ShardState(self.layout, msg["start"], msg["stop"], msg["optim"])
        self.exact = bool(msg["optim"].get("bit_exact", True))
        self.inbox = Inbox(
            self.state.size, self.world, knobs.get_int("WORKER_SLOTS"), self.state.expected_grad, self.state.fields()
        )
        self.applied = -1  # nothing installed yet
        self.prepared = self.base - 1  # highest iteration reported PREPARED
        self.seen = self.base - 1
        self.blobs: dict[int, bytes] = {}  # rank -> commit blob of the applied iteration
        self.commit: dict | None = None  # rank 0's replay record of the applied iteration
        self.stale: str | None = None
        persist = msg["persist"]
        self.persister = (ShardPersister(persist, self.job, msg["shard"], msg["shards"], self.state)
                          if persist.get("local", {}).get("dir") else None)


class Worker(PeerMixin, ServeMixin):
    def __init__(self, coordinator: str, host: str = "127.0.0.1", worker_id: int = -1, guard=None,
                 keys=None) -> None:
        self.coordinator = coordinator
        self.host = host
        self.worker_id = worker_id
        self.guard, self.keys = guard, keys  # CURVE: server sockets checked by guard, keys to the coordinator
        self.ctx = zmq.Context.instance()
        self.rejected: Counter[str] = Counter()
        self.frames_in = 0
        self.bytes_in = 0
        self.session: _Session | None = None
        # the previous epoch's state, served to restores until the new epoch has its base:
        # a trainer killed during a (re-)attach bootstrap restores from it
        self.retired: _Session | None = None
        self.pending_fetch: list[tuple[bytes, dict, float]] = []
        self.hold = False  # a replacement replica: leave data frames queued until configured
        self.peer: PeerCopy | None = None  # the state fetch from a peer replica, while in flight
        self._stop = False

    # -- sockets ---------------------------------------------------------------------
    def _open_data(self) -> None:
        self.data = self.ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.RCVHWM, 0)
        if self.guard is not None:
            self.guard.server(self.data)
        port = self.data.bind_to_random_port(f"tcp://{self.host}")
        self.data_ep = f"tcp://{self.host}:{port}"

    def _open(self) -> None:
        self._open_data()
        self.serve = self.ctx.socket(zmq.ROUTER)
        self.serve.setsockopt(zmq.LINGER, 0)
        if self.guard is not None:
            self.guard.server(self.serve)
        port = self.serve.bind_to_random_port(f"tcp://{self.host}")
        self.serve_ep = f"tcp://{self.host}:{port}"
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.apply(self.ctrl)
        self.ctrl.connect(self.coordinator)

    def _close(self) -> None:
        for s in (self.data, self.serve, self.ctrl):
            s.close(linger=0)
        if self.guard is not None:
            self.guard.stop()

    def _to_coord(self, kind: str, **fields) -> None:
        try:
            self.ctrl.send(M.encode(kind, **fields), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is away and the queue is full: it rebuilds from a rejoin
            self.rejected["ctrl_dropped"] += 1

    # -- main loop -------------------------------------------------------------------
    def run(self) -> None:
        from shadow.kernels.plan import warm_up

        t0 = time.monotonic()
        warm_up()
        logger.info("replay kernels ready in %.1f s", time.monotonic() - t0)
        self._open()
        logger.info("worker up: data %s serve %s coordinator %s", self.data_ep, self.serve_ep, self.coordinator)
        self._to_coord("register", data=self.data_ep, serve=self.serve_ep, pid=os.getpid(), worker_id=self.worker_id)
        hb = knobs.get("HEARTBEAT_S")
        next_hb = time.monotonic() + hb
        try:
            while not self._stop:
                wait = min(max(0.0, next_hb - time.monotonic()), 0.05)
                poller = zmq.Poller()
                for s in (self.ctrl, self.serve):
                    poller.register(s, zmq.POLLIN)
                if self.peer is not None:
                    poller.register(self.peer.sock, zmq.POLLIN)
                elif not self.hold:  # a joining replica leaves the trainers' frames queued until it has state
                    poller.register(self.data, zmq.POLLIN)
                events = dict(poller.poll(timeout=wait * 1000))
                if self.ctrl in events:
                    self._drain(self.ctrl, self._on_ctrl)
                if self.peer is not None and self.peer.sock in events:
                    self._peer_reply()
                if self.data in events:
                    self._drain(self.data, self._on_data, limit=256)
                if self.serve in events:
                    self._drain(self.serve, self._on_serve)
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + hb
                    self._heartbeat()
                    self._expire_fetches(now)
                    if self.peer is not None and now > self.peer.deadline:
                        self._peer_failed(f"peer worker {self.peer.id} did not send iteration "
                                          f"{self.peer.iteration} within {knobs.get('FETCH_TIMEOUT_S'):.0f} s")
                self._report_persisted()
        finally:
            self._close()

    def stop(self) -> None:
        self._stop = True

    def _drain(self, sock, handler, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                handler(sock)
            except zmq.Again:
                return

    def _heartbeat(self) -> None:
        s = self.session
        self._to_coord(
            "heartbeat", rejected={**self.rejected, **{"auth_" + k: v for k, v in
                                                       (self.guard.refused if self.guard else {}).items()}},
            epoch=s.epoch if s else -1, applied=s.applied if s else -1,
            seen=s.seen if s else -1, frames_in=self.frames_in,
            bytes_in=self.bytes_in, stale=(s.stale or "") if s else "",
            seq=list(s.inbox.next_seq) if s else [],
        )

    # -- control plane -----------------------------------------------------------------
    def _on_ctrl(self, sock) -> None:
        raw = sock.recv(zmq.NOBLOCK)
        try:
            msg = M.decode(raw)
        except M.MessageError as exc:
            self.rejected["ctrl_" + exc.reason] += 1
            logger.warning("rejected control message from coordinator: %s", exc)
            return
        t = msg["t"]
        if t == "registered":
            self.worker_id, self.hold = msg["worker_id"], msg["hold"]
            logger.info("registered as worker %d%s", self.worker_id,
                        " (joining a running job: waiting for the ranks and a peer copy)" if self.hold else "")
        elif t == "reset":
            self._reset(msg["reason"])
        elif t == "reregister":  # a restarted coordinator: tell it what this worker holds
            s = self.session
            logger.warning("the coordinator restarted; rejoining as worker %d%s", self.worker_id,
                           f" with epoch {s.epoch} at iteration {s.applied}" if s else "")
            self._to_coord("rejoin", data=self.data_ep, serve=self.serve_ep, pid=os.getpid(), worker_id=self.worker_id,
                           session=None if s is None else {"configure": s.config, "prepared": s.prepared,
                                                           "applied": s.applied, "stale": s.stale or ""})
        elif t == "configure":
            self._configure(msg)
        elif t == "apply":
            self._apply_upto(msg["epoch"], msg["iteration"])
        elif t == "persist":
            self._persist(msg)
        elif t == "upload":
            s = self.session
            if s is not None and s.persister is not None and msg["epoch"] == s.epoch:
                s.persister.upload(msg["iteration"], msg["epoch"], msg["bytes"], msg["checksum"])
        elif t == "shutdown":
            self._stop = True
        else:
            self.rejected["ctrl_unexpected"] += 1

    def _configure(self, msg: dict) -> None:
        try:
            sess = _Session(msg)
        except (ValueError, KeyError) as exc:
            logger.error("cannot configure epoch %s: %s", msg.get("epoch"), exc)
            self._to_coord("stale", epoch=msg["epoch"], reason=f"configure failed: {exc}")
            return
        # anything in flight for the old epoch is void
        old = self.session
        self.retired = old if old is not None and old.applied >= 0 and not old.stale and msg["peer"] is None \
            else None
        self.session = sess
        self._answer_fetches()  # waiting fetches of the old epoch get an answer from the retired copy
        if self.peer is not None:  # a peer copy of the old epoch is void too
            self.peer.close()
            self.peer = None
        if msg["peer"] is not None:
            self._start_peer_copy(msg["peer"])
            return
        self.hold = False
        logger.info(
            "configured epoch %d job %s: range [%d, %d) of %d, world %d, from iteration %d",
            sess.epoch, sess.job, sess.state.start, sess.state.stop, sess.layout.total, sess.world, sess.base,
        )
        self._to_coord("configured", epoch=sess.epoch)

    # -- replicas: reset and peer copy ---------------------------------------------------

    def _apply_upto(self, epoch: int, iteration: int) -> None:
        s = self.session
        if s is None or epoch != s.epoch:
            return
        while True:
            k = s.applied + 1 if s.applied >= 0 else s.base
            if k > iteration:
                break
            slot = s.inbox.slots.get(k)
            if slot is None or not s.inbox.complete(slot):
                self._go_stale(f"asked to apply iteration {k} that is not prepared here")
                return
            if slot.kind == F.Kind.STATE:
                c = slot.commits[0]
                s.state.install_meta(c["steps"], c["has_state"])
            else:
                s.state.apply(s.inbox.grad_buffer(slot), slot.commits[0])
            s.inbox.release(k)
            s.applied = k
            if self.retired is not None:  # the new epoch holds its base: the old one is no longer needed
                self.retired = None
            s.blobs = slot.blobs
            s.commit = slot.commits[0]
            fault = knobs.fault("CORRUPT_APPLY_AT")
            if fault and int(fault) == k and s.state.size:  # tests: a silent bit flip in the replica
                s.state.param.view(np.uint32)[:] ^= 1
            audit = next((c.get("audit") for c in slot.commits if c.get("audit")), None)
            if audit:
                result = audit_shard(s.state, audit)
                if not s.exact and not result["ok"]:  # a GPU trainer: report the deviation, do not fail
                    result.update(ok=True, detail="deviation (not bit-exact by design): " + result["detail"])
                self._to_coord("audited", epoch=s.epoch, iteration=k, **result)
        self._answer_fetches()

    def _persist(self, msg: dict) -> None:
        s = self.session
        if s is None or msg["epoch"] != s.epoch or s.persister is None:
            return
        if s.applied != msg["iteration"]:
            self._to_coord("persisted", **s.persister.report(
                msg["iteration"], s.epoch, "local", False, f"worker is at iteration {s.applied}"))
            return
        commit = {k: v for k, v in s.commit.items() if k not in ("steps", "has_state", "sent")} if s.commit else None
        s.persister.snapshot(s.applied, s.epoch, s.world, s.blobs, commit)

    def _report_persisted(self) -> None:
        s = self.session
        if s is None or s.persister is None:
            return
        for rep in s.persister.results():
            self._to_coord("persisted", **rep)

    def _go_stale(self, reason: str) -> None:
        s = self.session
        if s is None or s.stale:
            return
        s.stale = reason
        logger.error("worker %d is stale in epoch %d: %s", self.worker_id, s.epoch, reason)
        self._to_coord("stale", epoch=s.epoch, reason=reason)

    # -- data plane -----------------------------------------------------------------------
    def _discard_rest(self, sock) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()

    def _on_data(self, sock) -> None:
        raw = sock.recv(zmq.NOBLOCK)
        self.frames_in += 1
        try:
            self._take_frame(sock, raw)
        except F.FrameError as exc:
            self.rejected[exc.reason] += 1
            self._discard_rest(sock)
            if exc.reason == "stale":
                logger.debug("dropped frame: %s", exc)
            else:
                logger.warning("rejected frame: %s", exc)
            # a duplicate (sequence already seen) is dropped and counted, and so is a frame whose
            # header does not check out (it consumed no sequence number: if it was a real one,
            # the next frame shows the gap); bytes lost or changed after the sequence check
            # leave this replica unusable until a resync
            if exc.reason in ("gap", "double_commit", "bad_checksum", "truncated_payload", "extra_payload",
                              "overflow", "disagree"):
                self._go_stale(str(exc))

    def _take_frame(self, sock, raw: bytes) -> None:
        h = F.unpack_header(raw, knobs.get_int("MAX_RUNS"))
        s = self.session
        if s is None:
            raise F.FrameError("not_configured", "frame arrived before this worker was configured")
        if h.epoch != s.epoch or h.job != s.job_id:
            raise F.FrameError("wrong_epoch", f"frame for job {h.job:#x} epoch {h.epoch}, serving {s.job_id:#x} epoch {s.epoch}")
        if h.layout != s.layout_hash:
            raise F.FrameError("wrong_layout", f"layout {h.layout:#x} is not {s.layout_hash:#x}")
        if h.world != s.world:
            raise F.FrameError("bad_rank", f"world {h.world} is not {s.world}")
        if s.stale:
            raise F.FrameError("stale", "worker is stale; frames ignored until resync")
        if h.iteration <= s.applied or h.iteration < s.base:
            raise F.FrameError("old_iteration", f"iteration {h.iteration} is not after applied {s.applied}")
        s.inbox.check_seq(h.rank, h.seq)
        s.seen = max(s.seen, h.iteration)
        if h.kind == F.Kind.COMMIT:
            self._take_commit(sock, h)
        else:
            self._take_payload(sock, h)
        self._report_prepared()

    def _recv_part_into(self, sock, target: np.ndarray, nbytes: int) -> None:
        if not sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", "message has fewer payload frames than runs")
        got = sock.recv_into(target)
        if got != nbytes:
            raise F.FrameError("truncated_payload", f"payload is {got} bytes, run says {nbytes}")
        self.bytes_in += got

    def _take_payload(self, sock, h: F.Header) -> None:
        s = self.session
        lo, hi = s.state.start, s.state.stop
        for dst, nelem, _ in h.runs:
            if nelem == 0 or dst < lo or dst + nelem > hi:
                raise F.FrameError("out_of_range", f"run [{dst}, {dst + nelem}) is outside [{lo}, {hi})")
        if h.kind == F.Kind.STATE:
            if h.field == F.Field.GRAD or h.field not in s.state.fields():
                raise F.FrameError("bad_kind", f"STATE frame for field {h.field.name}")
            slot = s.inbox.slot(h.iteration, F.Kind.STATE)
            target = s.state.array(h.field)
        else:
            if h.field != F.Field.GRAD:
                raise F.FrameError("bad_kind", f"GRAD frame for field {h.field.name}")
            slot = s.inbox.slot(h.iteration, F.Kind.GRAD)
            target = s.inbox.grad_buffer(slot)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("after_commit", f"rank {h.rank} sent data for iteration {h.iteration} after its commit")
        total = 0
        for dst, nelem, csum in h.runs:
            view = target[dst - lo: dst - lo + nelem]
            self._recv_part_into(sock, view, nelem * 4)
            if F.checksum(view) != csum:
                raise F.FrameError("bad_checksum", f"payload at flat {dst} (+{nelem}) from rank {h.rank} iteration {h.iteration}")
            total += nelem
        if sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "message has more payload frames than runs")
        slot.received[h.rank] += total
        if h.kind == F.Kind.STATE:
            slot.field_elems[int(h.field)] = slot.field_elems.get(int(h.field), 0) + total

    def _take_commit(self, sock, h: F.Header) -> None:
        s = self.session
        if len(h.runs) != 1:
            raise F.FrameError("bad_commit", f"commit has {len(h.runs)} runs, expected 1")
        _, nbytes, csum = h.runs[0]
        if nbytes > knobs.get_int("MAX_COMMIT_BYTES"):
            raise F.FrameError("bad_commit", f"commit of {nbytes} bytes exceeds the limit")
        if not sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", "commit without body")
        body = sock.recv()
        if len(body) != nbytes or F.checksum(body) != csum:
            raise F.FrameError("bad_checksum", f"commit body of rank {h.rank} iteration {h.iteration}")
        if sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "commit has more than one body frame")
        replay, blob = decode_commit(body, h, len(s.layout.params), s.layout.num_groups)
        kind = F.Kind.STATE if replay["bootstrap"] else F.Kind.GRAD
        if replay["bootstrap"] != (h.iteration == s.base):
            raise F.FrameError("bad_commit", f"bootstrap flag {replay['bootstrap']} at iteration {h.iteration} (base {s.base})")
        slot = s.inbox.slot(h.iteration, kind)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("double_commit", f"second commit from rank {h.rank} for iteration {h.iteration}")
        for other in slot.commits:
            if other is not None and any(not same(other.get(k), replay.get(k)) for k in
                                         ("groups", "skipped", "clip", "inv_scale", "grad_scale", "skip_step")):
                raise F.FrameError("disagree", f"rank {h.rank} commits different hyperparameters for iteration {h.iteration}")
        slot.commits[h.rank] = replay
        if blob is not None:
            slot.blobs[h.rank] = blob

    def _report_prepared(self) -> None:
        s = self.session
        k = s.prepared + 1
        while True:
            slot = s.inbox.slots.get(k)
            if slot is None or not s.inbox.complete(slot):
                break
            k += 1
        if k - 1 > s.prepared:
            s.prepared = k - 1
            c = s.inbox.slots[s.prepared].commits[0]
            self._to_coord("prepared", epoch=s.epoch, iteration=s.prepared, tokens=c.get("tokens"))

    # -- restore serving ----------------------------------------------------------------------




