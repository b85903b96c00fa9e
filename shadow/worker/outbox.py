"""Where a worker's messages to the coordinator go: the :class:`Outbox` protocol.

The worker's parts never touch the control socket. In the service, :class:`ZmqOutbox`
writes to the DEALER connected to the coordinator; in unit tests, :class:`RecordingOutbox`
keeps what would have been sent (each message encoded and decoded, so it is checked
against its schema). Imports no torch."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Protocol

import zmq

from shadow.transport import SocketFactory
from shadow.wire import messages as M


class Outbox(Protocol):
    """Sends control messages from a worker to its coordinator."""

    def to_coord(self, kind: str, **fields: Any) -> None:
        """Send ``kind`` with ``fields``; never blocks."""


def silence_options(lost_s: float) -> dict[int, int]:
    """The control socket's options that replace a connection gone silent with a fresh one,
    for a coordinator that marks a silent worker lost after ``lost_s`` seconds.

    Once a link is back after a long or flapping partition, the connection that lived
    through it can stay silent for tens of seconds: TCP retransmits on it at growing
    intervals (up to two minutes), while a new connection goes through at once. So the
    socket pings the coordinator (ZMTP heartbeats, answered by libzmq's I/O thread, however
    busy the coordinator's loop is) every ``lost_s / 3`` seconds (at least 0.1 s, at most
    1 s). A connection with no traffic for ``lost_s`` plus one ping period after a ping is
    dropped and connected again (every 0.1 s, each try given one ping period plus a second).
    The coordinator's end drops it after the same silence (the ping's TTL). By then the
    coordinator has marked this worker lost, so the control messages of the dropped
    connection belong to an epoch that the resync replaces. The worker keeps its routing id
    (:func:`routing_id`), and the coordinator hands it over to the new connection
    (``ROUTER_HANDOVER``)."""
    ping_ms = int(1000 * min(1.0, max(0.1, lost_s / 3)))
    silence_ms = int(1000 * lost_s) + ping_ms
    return {
        zmq.HEARTBEAT_IVL: ping_ms,
        zmq.HEARTBEAT_TIMEOUT: silence_ms,
        zmq.HEARTBEAT_TTL: silence_ms,
        zmq.CONNECT_TIMEOUT: ping_ms + 1000,
        zmq.RECONNECT_IVL: 100,
    }


def routing_id() -> bytes:
    """A worker process's routing id at the coordinator: 16 random bytes, the first never 0
    (libzmq keeps those for the ids it makes up itself), so no other peer can name it."""
    return bytes([1 + os.urandom(1)[0] % 255]) + os.urandom(15)


class ZmqOutbox:
    """The :class:`Outbox` on the worker's control socket (a DEALER connected to the
    coordinator, also read for the coordinator's messages). A send that would block (the
    coordinator is away and the queue is full) is dropped and counted in ``rejected`` as
    ``ctrl_dropped``: the coordinator rebuilds from a rejoin. With ``lost_s``, a connection
    gone silent is replaced (:func:`silence_options`).

    Call order: :meth:`open`, then sends, then :meth:`close`. Owned by the worker's main
    thread."""

    def __init__(
        self, sockets: SocketFactory, coordinator: str, rejected: Counter[str], lost_s: float | None = None
    ) -> None:
        self.sockets, self.coordinator, self.rejected, self.lost_s = sockets, coordinator, rejected, lost_s
        self.sock: zmq.Socket | None = None

    def open(self) -> zmq.Socket:
        sock = self.sockets.dealer(None, M.socket_limit("worker"))
        try:
            sock.setsockopt(zmq.ROUTING_ID, routing_id())
            for option, value in (silence_options(self.lost_s) if self.lost_s is not None else {}).items():
                sock.setsockopt(option, value)
            sock.connect(self.coordinator)
        except BaseException:
            sock.close(linger=0)
            raise
        self.sock = sock
        return sock

    def to_coord(self, kind: str, **fields: Any) -> None:
        if self.sock is None:
            raise RuntimeError("the control socket is not open: call open() first")
        try:
            self.sock.send(M.encode(kind, **fields), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is away and the queue is full: it rebuilds from a rejoin
            self.rejected["ctrl_dropped"] += 1

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)


class RecordingOutbox:
    """An :class:`Outbox` that keeps ``(kind, fields)`` for each message instead of sending
    it; each is encoded and decoded on the way, as on the wire."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def to_coord(self, kind: str, **fields: Any) -> None:
        msg = M.decode(M.encode(kind, **fields))
        self.sent.append((kind, {k: v for k, v in msg.items() if k not in ("t", "v")}))

    def kinds(self) -> list[str]:
        """The kinds sent, in order."""
        return [k for k, _ in self.sent]

    def last(self, kind: str) -> dict[str, Any]:
        """The fields of the last message of ``kind``."""
        for k, f in reversed(self.sent):
            if k == kind:
                return f
        raise AssertionError(f"no {kind!r} message was sent: {self.kinds()}")
