"""The shadow worker process: receive frames, prepare iterations, apply on the
coordinator's word, serve its shard for restores.

Sockets (all polled by one loop, every wait bounded by the heartbeat period):

* ``data`` (PULL, bound): GRAD / STATE / COMMIT frames from every trainer rank
  (:class:`~shadow.worker.data.DataPath`);
* ``ctrl`` (DEALER, connected to the coordinator): register, configure, prepared, apply
  (:class:`~shadow.worker.outbox.ZmqOutbox` sends; :data:`ROUTES` dispatches what arrives);
* ``serve`` (ROUTER, bound): ``fetch`` requests from restore clients and peers
  (:class:`~shadow.worker.fetches.FetchServer`);
* while a replacement replica copies its shard, a DEALER to the peer
  (:class:`~shadow.worker.peer.PeerCopy`).

This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from shadow.config.tuning import Tuning
from shadow.transport import SocketFactory
from shadow.wire import messages as M
from shadow.wire.commit import ApplyCut
from shadow.worker import memory, slot
from shadow.worker.address import Binding, bind_and_advertise
from shadow.worker.apply import Apply
from shadow.worker.configure import Configure
from shadow.worker.data import DataPath
from shadow.worker.fetches import FetchServer
from shadow.worker.files import FileServer
from shadow.worker.outbox import ZmqOutbox
from shadow.worker.peer import PeerCopy
from shadow.worker.startup import compile_kernels
from shadow.worker.state import WorkerState, go_stale

logger = logging.getLogger(__name__)


class Worker:
    """One shadow worker: receives its range of every bucket, applies the cut, serves
    fetches and peer copies, and snapshots for persistence.

    A small handle over its parts, each built here around the one :class:`WorkerState`
    (``state``) and the :class:`~shadow.worker.outbox.ZmqOutbox` to the coordinator
    (``outbox``): ``data`` (:class:`DataPath`), ``apply`` (:class:`Apply`), ``fetches``
    (:class:`FetchServer`), ``peer`` (:class:`PeerCopy`) and ``configure``
    (:class:`~shadow.worker.configure.Configure`). The coordinator's control
    messages go through :data:`ROUTES` to the handlers below.

    Threads: :meth:`run`, on the process's main thread, owns the sockets, the state and
    every part: receive, apply, serve and peer copy all run there. Other threads own only
    what they were handed: the kernel warm-up thread at start-up (the worker reports
    "starting" until it is done), an assignment's :class:`~shadow.persist.writer.ShardPersister`
    threads (their images and a queue of reports the main thread drains), the guard's ZAP
    thread, and the metrics endpoint's HTTP thread, which reads the state without a lock
    and never writes."""

    def __init__(
        self,
        coordinator: str,
        host: str = "127.0.0.1",
        worker_id: int = -1,
        guard=None,
        keys=None,
        tuning: Tuning | None = None,
        local_dir: str = "",
        data_mode: str = "",
        transport: str = "zmq",
    ) -> None:
        """``data_mode``: how the data socket takes frames (``SecurityConfig.data_mode``):
        ``plain`` without a guard; with one, ``mac`` (default: a socket in clear, every frame
        under its rank's MAC; the serve socket in clear too, every fetch with a ticket and every
        reply under its MAC) or ``curve`` (CURVE sockets as well). ``transport``: what the
        trainers stream over (``transport.data``): ``zmq`` or ``ucx`` (not with ``curve``)."""
        self.coordinator = coordinator
        self.data_mode = data_mode or ("mac" if guard is not None else "plain")
        if (self.data_mode == "plain") != (guard is None):
            raise ValueError(
                f"data_mode={self.data_mode!r} {'needs' if guard is None else 'cannot go with'} keys "
                "(security.server_key): plain without them, mac or curve with them"
            )
        if transport not in ("zmq", "ucx") or (transport == "ucx" and self.data_mode == "curve"):
            raise ValueError(
                f"transport={transport!r} with data_mode={self.data_mode!r}: zmq, or ucx with plain or mac "
                "(UCX carries no CURVE)"
            )
        self.bind_host, self.host = bind_and_advertise(host, coordinator)
        self.guard, self.keys = guard, keys  # CURVE: server sockets checked by guard, keys to the coordinator
        self.ctx: zmq.Context = zmq.Context.instance()
        self.sockets = SocketFactory(self.ctx, guard=guard, keys=keys)
        binding = Binding(self.bind_host, self.host)
        self.state = WorkerState(tuning=tuning if tuning is not None else Tuning.load(), worker_id=worker_id)
        self.outbox = ZmqOutbox(self.sockets, coordinator, self.state.rejected, self.state.tuning.worker_lost_s)
        self.data = DataPath(
            self.state, self.outbox, self.sockets, binding, curve=self.data_mode == "curve", transport=transport
        )
        self.fetches = FetchServer(self.state, self.sockets, binding, tickets=self.data_mode == "mac")
        self.files = FileServer(
            self.sockets, binding, local_dir, keyed=self.data_mode == "mac", rejected=self.state.rejected
        )
        self.apply = Apply(self.state, self.outbox, self.fetches)
        self.peer = PeerCopy(self.state, self.outbox, self.sockets)
        self.configure = Configure(self.state, self.outbox, self.files, self.fetches, self.peer, self.data_mode)

    def _close(self) -> None:
        for sess in (self.state.assignment, self.state.retired):
            if sess is not None:
                sess.close()
        self.data.close()
        self.fetches.close()
        self.files.close()
        self.outbox.close()
        if self.guard is not None:
            self.guard.stop()

    # -- main loop -------------------------------------------------------------------
    def run(self) -> None:
        ctrl = self.outbox.open()
        if not self._warm_up():
            self._close()
            return
        self.data.open()
        self.fetches.open()
        self.files.open()
        logger.info(
            "worker up: data %s serve %s coordinator %s", self.data.endpoint, self.fetches.endpoint, self.coordinator
        )
        self._register(memory.report())
        st = self.state
        hb = st.tuning.heartbeat_s
        next_hb = time.monotonic() + hb
        try:
            while not st.stopping:
                wait = min(max(0.0, next_hb - time.monotonic()), 0.05)
                poller = zmq.Poller()
                for s in (ctrl, self.fetches.sock):
                    poller.register(s, zmq.POLLIN)
                # a joining replica leaves the trainers' frames queued until it has state
                reading = self.peer.sock is None and not st.awaiting_copy
                if self.peer.sock is not None:
                    poller.register(self.peer.sock, zmq.POLLIN)
                elif reading:
                    poller.register(self.data.pollable, zmq.POLLIN)
                if self.data.pump() and reading:  # UCX: whole messages already wait
                    wait = 0.0
                events = dict(poller.poll(timeout=int(wait * 1000)))
                if ctrl in events:
                    self._drain(ctrl, self._on_ctrl, "ctrl")
                if self.peer.sock is not None and self.peer.sock in events:
                    self.peer.on_reply()
                ready = self.data.pump()
                if reading and (self.data.pollable in events or ready):
                    self._drain(self.data.source, self.data.on_message, "data", limit=256)
                if self.fetches.sock in events:
                    self._drain(self.fetches.sock, self.fetches.on_message, "serve")
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + hb
                    self._heartbeat()
                    self.fetches.expire(now)
                    self.peer.check_deadline(now)
                self.apply.report_persisted()
        finally:
            self._close()

    def stop(self) -> None:
        self.state.stopping = True

    def _warm_up(self) -> bool:
        """Compile the replay kernels, saying "starting" every heartbeat period meanwhile;
        False if the worker was stopped first."""

        def tick(seconds: float) -> bool:
            self.outbox.to_coord("starting", pid=os.getpid(), worker_id=self.state.worker_id, seconds=round(seconds, 3))
            self._drain(self.outbox.sock, self._on_ctrl_starting, "ctrl_starting")
            return not self.state.stopping

        return compile_kernels(tick, self.state.tuning.heartbeat_s) and not self.state.stopping

    def _on_ctrl_starting(self, sock) -> None:
        """Control messages while the kernels compile: the worker has not registered yet, so
        only an ``error`` means anything (it is logged); the rest is read and dropped."""
        try:
            msg = M.decode(sock.recv(zmq.NOBLOCK))
        except M.MessageError as exc:
            self.state.rejected["ctrl_" + exc.reason] += 1
            return
        if msg["t"] == "error":
            self._on_error(msg)

    def _drain(self, sock, handler: Callable[[Any], None], where: str, limit: int = 64) -> None:
        """Call ``handler(sock)`` until the socket has nothing more (``zmq.Again``), ``limit``
        times at most; ``where`` names the handler in counters and logs."""
        for _ in range(limit):
            try:
                handler(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                raise
            except Exception as exc:  # a bug meeting an input: count it and carry on
                self._handler_failed(sock, where, exc)

    def _handler_failed(self, sock, where: str, exc: Exception) -> None:
        """A handler raised: the rest of the message is discarded, the failure counted by
        handler and exception type (status and metrics) and logged with its traceback. A
        control message may have been half carried out (an apply, a configure), so the
        session is no longer trusted: stale until the coordinator resyncs it."""
        self.state.rejected[f"{where}_error_{type(exc).__name__}"] += 1
        logger.exception("the %s handler failed; the worker carries on", where)
        if isinstance(sock, zmq.Socket):
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv()
        else:  # a data channel's frame source
            while sock.more():
                sock.recv_next()
        if sock is self.outbox.sock:
            go_stale(
                self.state, self.outbox, f"a control message could not be carried out ({type(exc).__name__}: {exc})"
            )

    def _register(self, free: int) -> None:
        self.outbox.to_coord(
            "register",
            data=self.data.endpoint,
            serve=self.fetches.endpoint,
            pid=os.getpid(),
            worker_id=self.state.worker_id,
            memory=free,
            files=self.files.endpoint,
            disk=self.files.disk,
            data_mode=self.data_mode,
            **self._register_extras(),
        )

    def _register_extras(self) -> dict:
        """What the tickets for the files socket derive from (mac mode), and the token of the
        slot this worker names, kept from an earlier process (shadow.worker.slot)."""
        out: dict = {"files_key": self.files.key} if self.files.key is not None else {}
        token = slot.load(self.coordinator, self.state.worker_id)
        if token is not None:
            out["slot_token"] = token
        return out

    def _heartbeat(self) -> None:
        st = self.state
        s = st.assignment
        self.outbox.to_coord(
            "heartbeat",
            rejected={
                **st.rejected,
                **{"auth_" + k: v for k, v in (self.guard.refused if self.guard else {}).items()},
            },
            epoch=s.epoch if s else -1,
            applied=s.applied if s else -1,
            seen=s.seen if s else -1,
            frames_in=self.data.frames_in,
            bytes_in=self.data.bytes_in,
            stale=(s.stale or "") if s else "",
            seq=list(s.inbox.next_seq) if s else [],
            replay_s=st.replay_s,
            replayed=st.replayed,
            memory=memory.report(),
            files=self.files.endpoint,
            disk=self.files.disk,
        )

    # -- control plane: the handlers of ROUTES -------------------------------------------
    def _on_ctrl(self, sock) -> None:
        raw = sock.recv(zmq.NOBLOCK)
        try:
            msg = M.decode(raw)
        except M.MessageError as exc:
            self.state.rejected["ctrl_" + exc.reason] += 1
            logger.warning("rejected control message from coordinator: %s", exc)
            return
        self.dispatch(msg)

    def dispatch(self, msg: dict) -> None:
        """Carry out one decoded control message from the coordinator: its handler in
        :data:`ROUTES`; a type with none is counted as ``ctrl_unexpected``."""
        handler = ROUTES.get(msg["t"])
        if handler is None:
            self.state.rejected["ctrl_unexpected"] += 1
            return
        handler(self, msg)

    def _on_registered(self, msg: dict) -> None:
        st = self.state
        st.worker_id, st.awaiting_copy = msg["worker_id"], msg["awaiting_copy"]
        if isinstance(msg.get("slot_token"), bytes):
            slot.save(self.coordinator, st.worker_id, msg["slot_token"])
        self.files.learn(msg.get("local_dir", ""))
        logger.info(
            "registered as worker %d%s",
            st.worker_id,
            " (joining a running job: waiting for the ranks and a peer copy)" if st.awaiting_copy else "",
        )

    def _on_reset(self, msg: dict) -> None:
        """A damaged replica: drop the session and every queued frame (a fresh data socket),
        then register again; the coordinator brings it back through a peer copy."""
        st = self.state
        logger.warning("resetting worker %d: %s", st.worker_id, msg["reason"])
        self.data.reopen()
        if st.assignment is not None:
            st.assignment.close()
        st.assignment = None
        self.fetches.forget_pending()
        self.peer.cancel()
        self._register(memory.available_bytes())

    def _on_reregister(self, msg: dict) -> None:
        """A restarted coordinator: tell it what this worker holds."""
        st = self.state
        s = st.assignment
        logger.warning(
            "the coordinator restarted; rejoining as worker %d%s",
            st.worker_id,
            f" with epoch {s.epoch} at iteration {s.applied}" if s else "",
        )
        self.outbox.to_coord(
            "rejoin",
            data=self.data.endpoint,
            serve=self.fetches.endpoint,
            pid=os.getpid(),
            worker_id=st.worker_id,
            assignment=None
            if s is None
            else {"configure": s.config, "prepared": s.prepared, "applied": s.applied, "stale": s.stale or ""},
            memory=memory.report(),
            files=self.files.endpoint,
            disk=self.files.disk,
            data_mode=self.data_mode,
            **self._register_extras(),
        )

    def _on_apply(self, msg: dict) -> None:
        cut = ApplyCut(msg["epoch"], msg["iteration"], msg["persist"])
        self.apply.through(cut.epoch, cut.iteration, cut.persist)

    def _on_upload(self, msg: dict) -> None:
        s = self.state.assignment
        if s is not None and s.persister is not None and msg["epoch"] == s.epoch:
            s.persister.upload(msg["iteration"], msg["epoch"], msg["bytes"], msg["checksum"])

    def _on_configure(self, msg: dict) -> None:
        self.configure.carry_out(msg)

    def _on_forget(self, msg: dict) -> None:
        """Checkpoints the coordinator's retention dropped (or that failed): gone from this
        worker's disk too (deleted on the files thread)."""
        self.files.forget(msg["job"], [d for d in msg["dirs"] if isinstance(d, str)])

    def _on_error(self, msg: dict) -> None:
        """The coordinator refused something of this worker's (e.g. a register for a slot a
        live process holds): it says why; the worker goes on (a heartbeat asks again)."""
        self.state.rejected["coordinator_" + msg["code"]] += 1
        logger.warning("the coordinator refused a message of this worker (%s): %s", msg["code"], msg["message"])


#: The coordinator's control messages to a worker, by type, and their handlers (any other
#: type is counted as ``ctrl_unexpected``). Each runs on the worker's main thread.
ROUTES: dict[str, Callable[[Worker, dict], None]] = {
    "registered": Worker._on_registered,
    "reset": Worker._on_reset,
    "reregister": Worker._on_reregister,
    "configure": Worker._on_configure,
    "forget": Worker._on_forget,
    "apply": Worker._on_apply,
    "upload": Worker._on_upload,
    "error": Worker._on_error,
}
