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

import zmq

from shadow import knobs
from shadow.kernels import powtab
from shadow.layout import Layout
from shadow.transport import SocketFactory, data_limit
from shadow.transport.receive import FrameReceiver
from shadow.wire import messages as M
from shadow.worker import memory
from shadow.worker.address import bind_and_advertise
from shadow.worker.apply import ApplyMixin
from shadow.worker.assignment import Assignment
from shadow.worker.data import DataMixin
from shadow.worker.fetches import FetchMixin
from shadow.worker.peer import PeerCopy, PeerMixin
from shadow.worker.startup import compile_kernels

logger = logging.getLogger(__name__)


class Worker(ApplyMixin, PeerMixin, FetchMixin, DataMixin):
    """One shadow worker: receives its range of every bucket, applies the cut, serves
    fetches and peer copies, and snapshots for persistence.

    Threads: :meth:`run`, on the process's main thread, owns the data, control and serve
    sockets, the sessions (``session``, ``retired``) and their state arrays: receive,
    apply, serve and peer copy all run there. Other threads own only what they were handed:
    the kernel warm-up thread at start-up (the worker reports "starting" until it is done), a session's
    :class:`~shadow.persist.writer.ShardPersister` threads (their images and a queue of
    reports the main thread drains), the guard's ZAP thread, and the metrics endpoint's
    HTTP thread, which reads fields without a lock and never writes."""

    def __init__(self, coordinator: str, host: str = "127.0.0.1", worker_id: int = -1, guard=None, keys=None) -> None:
        self.coordinator = coordinator
        self.bind_host, self.host = bind_and_advertise(host, coordinator)
        self.worker_id = worker_id
        self.guard, self.keys = guard, keys  # CURVE: server sockets checked by guard, keys to the coordinator
        self.ctx = zmq.Context.instance()
        self.sockets = SocketFactory(self.ctx, guard=guard, keys=keys)
        self.rejected: Counter[str] = Counter()
        self.rx: FrameReceiver | None = None  # reads the data socket; its counters outlive a reset's fresh socket
        self.assignment: Assignment | None = None
        # the previous epoch's state, served to restores until the new epoch has its base:
        # a trainer killed during a (re-)attach bootstrap restores from it
        self.retired: Assignment | None = None
        self.pending_fetch: list[tuple[bytes, dict, float]] = []
        self.replies: dict = {}  # client identity -> its shard reply sent zero-copy (serve.Reply), until zmq is done
        self.awaiting_copy = False  # a replacement replica: leave data frames queued until configured
        self.peer: PeerCopy | None = None  # the state fetch from a peer replica, while in flight
        self._stop = False
        self.started = time.monotonic()
        self.replay_s, self.replayed = 0.0, 0  # time in the apply kernels, iterations applied
        self.configures = 0  # epochs configured: the first bootstrap, then every resync or peer copy
        self.persisted: dict[str, list] = {}  # tier -> [seconds, shards, bytes, failures]

    # -- sockets ---------------------------------------------------------------------
    def _open_data(self) -> None:
        # bounded: a sender stops after MAX_LAG iterations past the cut, so a few iterations' messages
        self.data = self.sockets.pull(data_limit(), knobs.get_int("DATA_RCVHWM"))
        port = self.data.bind_to_random_port(f"tcp://{self.bind_host}")
        self.data_ep = f"tcp://{self.host}:{port}"
        if self.rx is None:
            self.rx = FrameReceiver(self.data)
        else:
            self.rx.sock = self.data

    @property
    def frames_in(self) -> int:
        """Data messages whose header was read."""
        return self.rx.frames_in if self.rx is not None else 0

    @property
    def bytes_in(self) -> int:
        """Payload bytes received on the data socket."""
        return self.rx.bytes_in if self.rx is not None else 0

    def _ctrl_open(self) -> None:
        self.ctrl = self.sockets.dealer(self.coordinator, M.socket_limit("worker"))

    def _open(self) -> None:
        self._open_data()
        self.serve = self.sockets.router(M.socket_limit("serve"))
        port = self.serve.bind_to_random_port(f"tcp://{self.bind_host}")
        self.serve_ep = f"tcp://{self.host}:{port}"

    def _close(self) -> None:
        for sess in (self.assignment, self.retired):
            if sess is not None:
                sess.close()
        for s in (getattr(self, "data", None), getattr(self, "serve", None), self.ctrl):
            if s is not None:
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
        self._ctrl_open()
        if not self._warm_up():
            self._close()
            return
        self._open()
        logger.info("worker up: data %s serve %s coordinator %s", self.data_ep, self.serve_ep, self.coordinator)
        self._to_coord(
            "register",
            data=self.data_ep,
            serve=self.serve_ep,
            pid=os.getpid(),
            worker_id=self.worker_id,
            memory=memory.report(),
        )
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
                elif not self.awaiting_copy:  # a joining replica leaves the trainers' frames queued until it has state
                    poller.register(self.data, zmq.POLLIN)
                events = dict(poller.poll(timeout=int(wait * 1000)))
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
                        self._peer_failed(
                            f"peer worker {self.peer.id} did not send iteration "
                            f"{self.peer.iteration} within {knobs.get('FETCH_TIMEOUT_S'):.0f} s"
                        )
                self._report_persisted()
        finally:
            self._close()

    def stop(self) -> None:
        self._stop = True

    def _warm_up(self) -> bool:
        """Compile the replay kernels, saying "starting" every heartbeat period meanwhile;
        False if the worker was stopped first."""

        def tick(seconds: float) -> bool:
            self._to_coord("starting", pid=os.getpid(), worker_id=self.worker_id, seconds=round(seconds, 3))
            self._drain(self.ctrl, self._on_ctrl_starting)
            return not self._stop

        return compile_kernels(tick, knobs.get("HEARTBEAT_S")) and not self._stop

    def _on_ctrl_starting(self, sock) -> None:
        """Control messages while the kernels compile: only ``shutdown`` means anything yet."""
        try:
            msg = M.decode(sock.recv(zmq.NOBLOCK))
        except M.MessageError as exc:
            self.rejected["ctrl_" + exc.reason] += 1
            return
        if msg["t"] == "shutdown":
            self._stop = True

    def _drain(self, sock, handler, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                handler(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                raise
            except Exception as exc:  # a bug meeting an input: count it and carry on
                self._handler_failed(sock, handler, exc)

    def _handler_failed(self, sock, handler, exc: Exception) -> None:
        """A handler raised: the rest of the message is discarded, the failure counted by
        handler and exception type (status and metrics) and logged with its traceback. A
        control message may have been half carried out (an apply, a configure), so the
        session is no longer trusted: stale until the coordinator resyncs it."""
        where = handler.__name__.lstrip("_").removeprefix("on_")
        self.rejected[f"{where}_error_{type(exc).__name__}"] += 1
        logger.exception("the %s handler failed; the worker carries on", where)
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
        if sock is self.ctrl:
            self._go_stale(f"a control message could not be carried out ({type(exc).__name__}: {exc})")

    def _heartbeat(self) -> None:
        s = self.assignment
        self._to_coord(
            "heartbeat",
            rejected={
                **self.rejected,
                **{"auth_" + k: v for k, v in (self.guard.refused if self.guard else {}).items()},
            },
            epoch=s.epoch if s else -1,
            applied=s.applied if s else -1,
            seen=s.seen if s else -1,
            frames_in=self.frames_in,
            bytes_in=self.bytes_in,
            stale=(s.stale or "") if s else "",
            seq=list(s.inbox.next_seq) if s else [],
            replay_s=self.replay_s,
            replayed=self.replayed,
            memory=memory.report(),
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
            self.worker_id, self.awaiting_copy = msg["worker_id"], msg["awaiting_copy"]
            logger.info(
                "registered as worker %d%s",
                self.worker_id,
                " (joining a running job: waiting for the ranks and a peer copy)" if self.awaiting_copy else "",
            )
        elif t == "reset":
            self._reset(msg["reason"])
        elif t == "reregister":  # a restarted coordinator: tell it what this worker holds
            s = self.assignment
            logger.warning(
                "the coordinator restarted; rejoining as worker %d%s",
                self.worker_id,
                f" with epoch {s.epoch} at iteration {s.applied}" if s else "",
            )
            self._to_coord(
                "rejoin",
                data=self.data_ep,
                serve=self.serve_ep,
                pid=os.getpid(),
                worker_id=self.worker_id,
                assignment=None
                if s is None
                else {"configure": s.config, "prepared": s.prepared, "applied": s.applied, "stale": s.stale or ""},
                memory=memory.report(),
            )
        elif t == "configure":
            self._configure(msg)
        elif t == "apply":
            self._apply_upto(msg["epoch"], msg["iteration"], msg["persist"])
        elif t == "upload":
            s = self.assignment
            if s is not None and s.persister is not None and msg["epoch"] == s.epoch:
                s.persister.upload(msg["iteration"], msg["epoch"], msg["bytes"], msg["checksum"])
        elif t == "shutdown":
            self._stop = True
        else:
            self.rejected["ctrl_unexpected"] += 1

    def _configure(self, msg: dict) -> None:
        try:
            problem = self._configure_problem(msg)
            if problem is not None:
                raise ValueError(problem)
            sess = Assignment(msg)
        except (ValueError, KeyError, TypeError, OverflowError, MemoryError) as exc:
            logger.error("cannot configure epoch %s: %s", msg.get("epoch"), exc)
            self._to_coord("stale", epoch=msg["epoch"], reason=f"configure failed: {exc}")
            return
        # anything in flight for the old epoch is void
        old = self.assignment
        self.retired = old if old is not None and old.applied >= 0 and not old.stale and msg["peer"] is None else None
        self.assignment = sess
        if old is not None:  # its persister would otherwise live on, with its threads and images
            old.close()
        self.configures += 1
        self._answer_fetches()  # waiting fetches of the old epoch get an answer from the retired copy
        if self.peer is not None:  # a peer copy of the old epoch is void too
            self.peer.close()
            self.peer = None
        if msg["peer"] is not None:
            self._start_peer_copy(msg["peer"])
            return
        self.awaiting_copy = False
        logger.info(
            "configured epoch %d job %s: range [%d, %d) of %d, world %d, from iteration %d",
            sess.epoch,
            sess.job,
            sess.state.start,
            sess.state.stop,
            sess.layout.total,
            sess.world,
            sess.base,
        )
        self._to_coord("configured", epoch=sess.epoch)

    @staticmethod
    def _configure_problem(msg: dict) -> str | None:
        """What makes a ``configure`` impossible to carry out here, checked before
        anything is allocated: a range outside the layout, or more memory than is free."""
        layout = Layout.from_dict(msg["layout"])
        start, stop = msg["start"], msg["stop"]
        if not 0 <= start <= stop <= layout.total:
            return f"range [{start}, {stop}) is outside the layout's {layout.total} elements"
        if not 1 <= msg["world"] <= 1 << 20:
            return f"world size {msg['world']} is out of bounds"
        pow_problem = powtab.check_entries(msg["optim"].get("pow"))
        if pow_problem is not None:
            return f"the replay descriptor is malformed: {pow_problem}"
        persist = msg["persist"]
        local = (
            isinstance(persist, dict) and isinstance(persist.get("local"), dict) and bool(persist["local"].get("dir"))
        )
        need = memory.session_bytes(stop - start, memory.nfields(msg["optim"]), len(layout.params), local)
        free = memory.available_bytes()
        if 0 <= free < need:
            return (
                f"the range [{start}, {stop}) needs {memory.human(need)} and this worker has "
                f"{memory.human(free)} free; add workers, or free memory on this host"
            )
        return None

    def _go_stale(self, reason: str) -> None:
        s = self.assignment
        if s is None or s.stale:
            return
        s.stale = reason
        logger.error("worker %d is stale in epoch %d: %s", self.worker_id, s.epoch, reason)
        self._to_coord("stale", epoch=s.epoch, reason=reason)
