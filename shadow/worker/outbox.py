"""Where a worker's messages to the coordinator go: the :class:`Outbox` protocol.

The worker's parts never touch the control socket. In the service, :class:`ZmqOutbox`
writes to the DEALER connected to the coordinator; in unit tests, :class:`RecordingOutbox`
keeps what would have been sent (each message encoded and decoded, so it is checked
against its schema). Imports no torch."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import zmq

from shadow.transport import SocketFactory
from shadow.wire import messages as M


class Outbox(Protocol):
    """Sends control messages from a worker to its coordinator."""

    def to_coord(self, kind: str, **fields: Any) -> None:
        """Send ``kind`` with ``fields``; never blocks."""


class ZmqOutbox:
    """The :class:`Outbox` on the worker's control socket (a DEALER connected to the
    coordinator, also read for the coordinator's messages). A send that would block (the
    coordinator is away and the queue is full) is dropped and counted in ``rejected`` as
    ``ctrl_dropped``: the coordinator rebuilds from a rejoin.

    Call order: :meth:`open`, then sends, then :meth:`close`. Owned by the worker's main
    thread."""

    def __init__(self, sockets: SocketFactory, coordinator: str, rejected: Counter[str]) -> None:
        self.sockets, self.coordinator, self.rejected = sockets, coordinator, rejected
        self.sock: zmq.Socket | None = None

    def open(self) -> zmq.Socket:
        self.sock = self.sockets.dealer(self.coordinator, M.socket_limit("worker"))
        return self.sock

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
