"""The worker's end of the UCX data path (``shadow.transport.ucx``): a listener whose
connections are read message by message and handed, frame by frame, to the worker's
:class:`~shadow.transport.receive.FrameReceiver`. The framing on the stream, the checks
and the fault behaviour are described in ``shadow.transport.ucx``."""

from __future__ import annotations

import collections
import logging
import select
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from shadow.transport.ucx_base import (
    ACK,
    ACKED,
    ACKED_MAGIC,
    MAGIC,
    MAX_CONNECTIONS,
    PREAMBLE,
    PROBE,
    PROBE_SIZES,
    READY,
    SIZE,
    TOKEN_BYTES,
    Held,
    Pending,
    _array,
    _close_endpoint,
    _context,
    _retire,
    lib,
    unpack_door,
)

#: connections a worker holds that have not proved its door yet (their probe is the first
#: thing a trainer sends, once READY comes); the oldest go first beyond it
MAX_UNOPENED = 256
#: seconds a connection has, from its accept, to prove the door in its probe
DOOR_TIMEOUT_S = 10.0

logger = logging.getLogger("shadow.transport.ucx")


class _Conn:
    """One accepted connection: its endpoint, the receive in flight and the state it is in."""

    PRE, BODY = range(2)

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.state = _Conn.PRE
        self.buf: np.ndarray = np.empty(PREAMBLE.size, np.uint8)
        self.req: Any = None
        self.nframes = 0
        self.total = 0
        self.queue: collections.deque[list[memoryview]] = collections.deque()
        self.dead = False
        self.ready: Pending | None = None  # the READY sent
        self.probe = False  # the message being read is a probe, answered with ACK
        self.acks: list[Pending] = []  # ACKs and acknowledgements UCX may still read
        self.proven = False  # a message from it has passed the receiver's checks (vouch)
        self.token: bytes | None = None  # its trainer's channel token, from the probe
        self.before: _Conn | None = None  # the same channel's lost connection, read first
        self.opened = False  # its probe came and proved the door: it may send data messages
        self.since = time.monotonic()  # accepted at
        self.whole = 0  # data messages read whole from it
        self.told = 0  # ... as its peer was last told

    def in_flight(self) -> list[Pending]:
        """What UCX may still read or write for this connection: the receive posted, READY, ACKs."""
        recv = Pending([self.req], [self.buf]) if self.req is not None else None
        return [p for p in (recv, self.ready, *self.acks) if p is not None]


class UcxDataSocket:
    """A worker's data channel over UCX: a listener on ``port`` (0: any free port) of every
    interface (see ``door``), each accepted connection read message by message into fresh buffers, whole
    messages queued per connection and handed out in turn, frame by frame, to a
    :class:`~shadow.transport.receive.FrameReceiver` (:meth:`recv_first`, :meth:`more`,
    :meth:`recv_next`; "nothing queued" is ``zmq.Again``, as on a ZeroMQ socket).

    Progress is the caller's: :meth:`pump` (non-blocking) before and after waiting on
    :attr:`fd` (UCX's event file descriptor, readable when there is work). ``limit``: the
    largest frame taken; ``max_frames``: the most frames in a message; ``rcvhwm``: whole
    messages queued per connection before that connection is closed; ``rejected``: where
    refusals are counted by reason. Owned by one thread.

    ``max_connections``: connections held at once. When a new one would pass it, the oldest
    connection that has not yet been *proven* is closed to make room (``ucx_evicted``),
    and what it queued is dropped. A connection is proven once a message of its own has
    passed the receiver's checks (:meth:`vouch`): with keys, only a key holder proves one.

    ``door``: with keys, the check of what a connection's first message proves (the
    trainer's probe, whose second frame carries its rank's credential,
    :func:`~shadow.transport.ucx_base.pack_door`), as :meth:`shadow.security.Guard.door`
    takes it: ``door(user, password)`` returns "" to admit. A connection's first message must
    be a probe of :data:`~shadow.transport.ucx_base.PROBE_SIZES` (else ``ucx_door``), and
    nothing else is read from it before the probe proves the door (``ucx_door_<reason>``):
    a stranger never makes this worker allocate more than a probe. Connections that have not
    proved it are at most :data:`MAX_UNOPENED` (the oldest go, ``ucx_door_crowded``) and
    each has :data:`DOOR_TIMEOUT_S` (``ucx_door_timeout``). UCX for Python takes no address
    for a listener: it listens on every interface, and the door is what keeps strangers out.
    Connections that open and never send what a key holder sends can therefore not crowd
    out a trainer. Only when every connection is proven is the new one refused
    (``ucx_too_many_connections``)."""

    def __init__(
        self,
        limit: int,
        max_frames: int,
        rcvhwm: int,
        rejected: collections.Counter | None = None,
        port: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        door: Callable[[bytes, bytes], str] | None = None,
    ) -> None:
        self.L = lib()
        self.limit, self.max_frames, self.rcvhwm = limit, max_frames, max(1, rcvhwm)
        self.max_connections = max(1, max_connections)
        self.door = door
        self.rejected = rejected if rejected is not None else collections.Counter()
        self.ctx = _context(self.L)
        self.worker = self.L.UCXWorker(self.ctx)
        self.worker.init_blocking_progress_mode()
        self.conns: list[_Conn] = []
        self._accepted: list[Any] = []
        self.listener = self._listen(port)
        self.port: int = self.listener.port
        self.fd: int = self.worker.epoll_file_descriptor
        self._held = Held()  # receives and sends of dropped connections UCX still holds
        self._cur: list[memoryview] | None = None  # the message being read
        self._cur_conn: _Conn | None = None  # the connection it came from
        self._pos = 0
        self._turn = 0
        self.closed = False

    # -- progress --------------------------------------------------------------------------------
    def _listen(self, port: int) -> Any:
        """A listener on ``port`` whose connections come to :meth:`_on_connect` with it."""
        box: list = []
        listener = self.L.UCXListener.create(self.worker, port, lambda req, *_: self._on_connect(box[0], req))
        box.append(listener)  # before any callback: those run when the owner progresses the worker
        return listener

    def _on_connect(self, listener: Any, conn_request: Any) -> None:
        try:
            ep = listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:
            self.rejected["ucx_accept_failed"] += 1
            logger.warning("a UCX connection could not be accepted: %s", exc)
            return
        if listener is not self.listener:  # a listener retired by a reset: its port is no longer ours
            logger.debug("closed a UCX connection to a port this worker left (%d)", listener.port)
            _close_endpoint(ep)
            return
        self._accepted.append(ep)

    def pump(self) -> bool:
        """Progress UCX and every connection without blocking, then arm the event file
        descriptor; True when whole messages wait to be read."""
        if self.closed:
            return False
        assert self.worker is not None
        while True:
            while self.worker.progress_once():
                pass
            self._advance()
            if self.worker.arm():
                break
        return self.pending()

    def wait(self, timeout: float) -> bool:
        """Block until UCX's event file descriptor is readable or ``timeout`` seconds pass
        (call :meth:`pump` first); whether it is. ``poll``, not ``select``: a process with
        many descriptors open has this one above ``select``'s limit of 1024."""
        if self.closed:
            return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))

    def pending(self) -> bool:
        return self.more() or any(c.queue for c in self.conns)

    def _advance(self) -> None:
        self._close_unopened()
        while self._accepted:
            ep = self._accepted.pop(0)
            if not self._room():
                self.rejected["ucx_too_many_connections"] += 1
                logger.warning(
                    "refused a UCX connection: %d are open and proven (max_connections)", self.max_connections
                )
                self._close(ep)
                continue
            conn = _Conn(ep)
            self.conns.append(conn)
            logger.debug("accepted a UCX data connection (%d open)", len(self.conns))
            self._post(conn)
            if not conn.dead:  # the trainer sends nothing before this
                buf = np.frombuffer(READY, np.uint8).copy()
                try:
                    conn.ready = Pending([conn.ep.stream_send(_array(buf))], [buf])
                except Exception as exc:
                    self._drop(conn, "ucx_send_failed", f"READY could not be sent: {exc}")
        self._held.prune()
        for conn in self.conns:
            if not conn.dead and not conn.ep.alive and (conn.req is None or not conn.req.completed):
                self._drop(conn, None, "closed by its peer")
                continue
            while not conn.dead and conn.req is not None and conn.req.completed:
                try:
                    self._step(conn)
                except Exception as exc:  # a bug meeting an input: that connection goes, the worker stays
                    logger.exception("a UCX data connection could not be read")
                    self._drop(conn, f"ucx_error_{type(exc).__name__}", f"{type(exc).__name__}: {exc}")
            if not conn.dead and conn.whole != conn.told:
                self._acknowledge(conn)
        if any(c.dead for c in self.conns):
            self.conns = [c for c in self.conns if not c.dead or c.queue]

    def _room(self) -> bool:
        """Whether a new connection can be held, closing the oldest unproven one if that
        makes room."""
        live = [c for c in self.conns if not c.dead]
        if len(live) < self.max_connections:
            return True
        victim = next((c for c in live if not c.proven), None)
        if victim is None:
            return False
        # what it queued goes too: a trainer whose connection this was lost the messages
        # after them anyway (a resync), and a stranger's queue is not kept for it
        self._drop(
            victim, "ucx_evicted", f"{len(live)} connections are open: the oldest unproven one makes room", keep=False
        )
        return True

    def _post(self, conn: _Conn) -> None:
        try:
            conn.req = conn.ep.stream_recv(_array(conn.buf))
        except Exception as exc:
            self._drop(conn, "ucx_recv_failed", f"a receive could not be posted: {exc}")

    def _step(self, conn: _Conn) -> None:
        """The receive in flight on ``conn`` completed: check what it brought, post the next."""
        try:
            conn.req.check_error()
        except Exception as exc:  # the peer went away (or the connection was closed here)
            self._drop(conn, None, f"closed: {exc}")
            return
        if conn.state == _Conn.PRE:
            magic, n, total = PREAMBLE.unpack(conn.buf.tobytes())
            conn.probe = magic == PROBE
            if not conn.opened and (magic != PROBE or n != len(PROBE_SIZES) or total != sum(PROBE_SIZES)):
                return self._drop(conn, "ucx_door", "its first message is not a probe", keep=False)
            if magic != MAGIC and not conn.probe:
                return self._drop(conn, "ucx_bad_preamble", "a message that does not start with shadow's preamble")
            if not 1 <= n <= self.max_frames or not 0 < total <= n * self.limit:
                return self._drop(conn, "ucx_bad_preamble", f"a message of {n} frames, {total} bytes")
            try:  # the frame sizes, then the frames, in one receive
                buf = np.empty(n * SIZE.size + total, np.uint8)
            except MemoryError:
                return self._drop(conn, "ucx_no_memory", f"no memory for a message of {total} bytes")
            conn.nframes, conn.total, conn.state, conn.buf = n, total, _Conn.BODY, buf
        else:
            table = conn.nframes * SIZE.size
            sizes = [s for (s,) in SIZE.iter_unpack(conn.buf[:table].tobytes())]
            if any(s > self.limit for s in sizes) or sum(sizes) != conn.total or sizes[0] == 0:
                return self._drop(
                    conn, "ucx_bad_preamble", f"frame sizes {sizes[:8]} do not add up or exceed {self.limit}"
                )
            body, frames, off = memoryview(conn.buf.data), [], table
            for s in sizes:
                frames.append(body[off : off + s])
                off += s
            if conn.probe:  # a trainer trying its new connection: answer, hand nothing on
                if not conn.opened:
                    why = self._check_door(frames)
                    if why:
                        return self._drop(
                            conn, "ucx_door_" + why, f"its probe did not prove the door ({why})", keep=False
                        )
                    conn.opened = True
                self._adopt(conn, bytes(frames[0][:TOKEN_BYTES]))
                conn.acks = [a for a in conn.acks if not a.finished]
                ack = np.frombuffer(ACK, np.uint8).copy()
                try:
                    conn.acks.append(Pending([conn.ep.stream_send(_array(ack))], [ack]))
                except Exception as exc:  # closed by its peer meanwhile
                    return self._drop(conn, None, f"closed before its probe was answered ({exc})")
            else:
                conn.queue.append(frames)
                conn.whole += 1
            if len(conn.queue) + len(conn.acks) > self.rcvhwm:
                return self._drop(
                    conn, "ucx_overflow", f"more than {self.rcvhwm} messages queued (SHADOW_DATA_RCVHWM)", keep=False
                )
            conn.state = _Conn.PRE
            conn.buf = np.empty(PREAMBLE.size, np.uint8)
        self._post(conn)

    def _check_door(self, frames: list[memoryview]) -> str:
        """Why a probe's door frame does not admit its connection ("": it does)."""
        if [len(f) for f in frames] != list(PROBE_SIZES):
            return "malformed"
        if self.door is None:  # no keys: the probe's shape is all it proves
            return ""
        creds = unpack_door(frames[1])
        if creds is None:
            return "malformed"
        return self.door(*creds)

    def _close_unopened(self) -> None:
        """Close the connections that have not proved the door within :data:`DOOR_TIMEOUT_S`,
        and the oldest beyond :data:`MAX_UNOPENED`: what a stranger holds."""
        now = time.monotonic()
        waiting = [c for c in self.conns if not c.dead and not c.opened]
        over = len(waiting) + len(self._accepted) - MAX_UNOPENED
        for c in waiting:
            if over > 0:
                over -= 1
                self._drop(c, "ucx_door_crowded", f"more than {MAX_UNOPENED} connections await their probe", keep=False)
            elif now - c.since > DOOR_TIMEOUT_S:
                self._drop(c, "ucx_door_timeout", f"no probe within {DOOR_TIMEOUT_S:g} s", keep=False)

    def _adopt(self, conn: _Conn, token: bytes) -> None:
        """``conn``'s probe carries its trainer's channel token. A connection of the same
        channel seen before was lost (the trainer made this one to send again what it had
        not seen acknowledged): it is closed, and what it queued whole is read before
        anything of ``conn`` (:meth:`recv_first`). Messages that arrive twice that way are
        dropped by their sequence numbers."""
        if len(token) != TOKEN_BYTES or not any(token):
            return
        for old in self.conns:
            if old is conn or old.token != token:
                continue
            old.token, conn.before = None, old
            if not old.dead:
                self._drop(old, None, "replaced by a new connection of its trainer's channel")
        conn.token = token

    def _acknowledge(self, conn: _Conn) -> None:
        """Tell ``conn``'s trainer how many data messages have reached this worker whole on it
        (once per progress round, not per message)."""
        conn.acks = [a for a in conn.acks if not a.finished]
        buf = np.frombuffer(ACKED.pack(ACKED_MAGIC, conn.whole), np.uint8).copy()
        try:
            conn.acks.append(Pending([conn.ep.stream_send(_array(buf))], [buf]))
        except Exception as exc:
            self._drop(conn, "ucx_send_failed", f"an acknowledgement could not be sent: {exc}")
            return
        conn.told = conn.whole

    def _drop(self, conn: _Conn, reason: str | None, why: str, keep: bool = True) -> None:
        """Close ``conn``; what it queued whole is still read unless ``keep`` is False."""
        if reason is not None:
            self.rejected[reason] += 1
            logger.warning("closed a UCX data connection: %s", why)
        else:
            logger.debug("a UCX data connection %s", why)
        # UCX may not complete a receive whose connection failed: its buffer stays
        # referenced until it does, or until this channel closes
        self._held.add(*conn.in_flight())
        conn.dead, conn.req = True, None
        if not keep:
            conn.queue.clear()
        self._close(conn.ep)

    def _close(self, ep: Any) -> None:
        _close_endpoint(ep)

    # -- frames ----------------------------------------------------------------------------------
    def recv_first(self) -> bytes:
        """The next message's first frame (its header); ``zmq.Again`` if none is queued. The
        rest of the previous message, if unread, is dropped first."""
        self._cur = self._cur_conn = None
        live = self.conns
        for i in range(len(live)):
            conn = live[(self._turn + i) % len(live)]
            if conn.before is not None:  # its channel's lost connection is read first
                if conn.before.queue:
                    continue
                conn.before = None
            if conn.queue:
                self._turn = (self._turn + i + 1) % max(1, len(live))
                self._cur, self._pos, self._cur_conn = conn.queue.popleft(), 1, conn
                return bytes(self._cur[0])
        raise zmq.Again()

    def vouch(self) -> None:
        """The current message's header passed the receiver's checks: its connection is
        proven, and is never closed to make room for another."""
        if self._cur_conn is not None:
            self._cur_conn.proven = True

    def more(self) -> bool:
        return self._cur is not None and self._pos < len(self._cur)

    def recv_next(self) -> memoryview:
        """The current message's next frame, zero-copy (a view of its receive buffer)."""
        assert self._cur is not None and self._pos < len(self._cur)
        frame = self._cur[self._pos]
        self._pos += 1
        if self._pos == len(self._cur):
            self._cur = None
        return frame

    def reset(self) -> int:
        """Close every connection, dropping what was queued, and listen on a new port (a
        worker's reset: no message sent before it is read after it); the new port. The UCX
        worker and context stay: a reset retires one listener, whose later connections are
        closed as they come."""
        assert not self.closed
        self._close_connections()
        old, self.listener = self.listener, self._listen(0)
        self.port = self.listener.port
        _retire(old)
        return self.port

    def close(self) -> None:
        """Close every connection and the listener; what was queued is dropped."""
        if self.closed:
            return
        self.closed = True
        self._close_connections()
        # let UCX carry the closes out before its worker goes; the connections are closed
        # (their peers have heard). UCX's listener, worker and context are kept for the life
        # of the process, never destroyed: destroying them crashed a test process (UCX for
        # Python, in the listener's or worker's destructor)
        left = self._held.settle(self.worker, 0.5)
        _retire(self.listener, self.worker, self.ctx, left)
        self.listener = self.worker = self.ctx = None

    def _close_connections(self) -> None:
        for conn in self.conns:
            conn.queue.clear()
            _close_endpoint(conn.ep)
            self._held.add(*conn.in_flight())
        for ep in self._accepted:
            _close_endpoint(ep)
        self.conns, self._accepted, self._cur, self._cur_conn = [], [], None, None
