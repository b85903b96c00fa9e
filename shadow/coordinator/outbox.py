"""Where the coordinator's messages go: the :class:`Outbox` protocol.

The components never touch a socket. In the service, :class:`ZmqOutbox` writes to the
ROUTER every peer talks to; in unit tests, :class:`RecordingOutbox` keeps what would have
been sent (each message encoded and decoded, so it is checked against its schema).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import zmq

from shadow.coordinator.records import JobRec, WorkerRec
from shadow.transport.sockets import send_if_connected
from shadow.wire import messages as M


class Outbox(Protocol):
    """Sends control messages from the coordinator."""

    def reply(self, envelope: list[bytes], kind: str, **fields: Any) -> None:
        """To the peer whose ROUTER envelope is ``envelope`` (the sender of a message)."""

    def reply_encoded(self, envelope: list[bytes], raw: bytes) -> None:
        """As :meth:`reply`, a message already encoded (:func:`shadow.wire.messages.encode`):
        the same bytes may go to many peers, held once however many wait to read them."""

    def to_worker(self, w: WorkerRec, kind: str, **fields: Any) -> None:
        """To registered worker ``w``."""

    def to_trainers(
        self, job: JobRec, kind: str, each: Callable[[int], dict[str, Any]] | None = None, **fields: Any
    ) -> None:
        """To every trainer rank of ``job`` the coordinator knows, in rank order; ``each(rank)``:
        fields of that rank's message alone (its own keys)."""

    def still_there(self, ident: bytes, kind: str, **fields: Any) -> bool:
        """Send to connection ``ident`` only if it is still connected; whether it was."""


class _Addressed:
    """:meth:`Outbox.to_worker` and :meth:`Outbox.to_trainers`, by way of ``reply``."""

    def reply(self, envelope: list[bytes], kind: str, **fields: Any) -> None:
        raise NotImplementedError

    def to_worker(self, w: WorkerRec, kind: str, **fields: Any) -> None:
        self.reply([w.ident], kind, **fields)

    def to_trainers(
        self, job: JobRec, kind: str, each: Callable[[int], dict[str, Any]] | None = None, **fields: Any
    ) -> None:
        for rank, ident in sorted(job.trainers.items()):
            self.reply([ident], kind, **fields, **(each(rank) if each is not None else {}))


class ZmqOutbox(_Addressed):
    """The :class:`Outbox` on the coordinator's ROUTER socket (set by the coordinator's loop
    once it has bound it)."""

    def __init__(self, sock: zmq.Socket | None = None) -> None:
        self.sock = sock

    def reply(self, envelope: list[bytes], kind: str, **fields: Any) -> None:
        if self.sock is None:
            raise RuntimeError("the coordinator sends nothing before run() opens its socket")
        self.sock.send_multipart(envelope + [M.encode(kind, **fields)])

    def reply_encoded(self, envelope: list[bytes], raw: bytes) -> None:
        if self.sock is None:
            raise RuntimeError("the coordinator sends nothing before run() opens its socket")
        self.sock.send_multipart(envelope + [raw], copy=False)  # zero-copy: every queue holds the one buffer

    def still_there(self, ident: bytes, kind: str, **fields: Any) -> bool:
        if self.sock is None:
            raise RuntimeError("the coordinator sends nothing before run() opens its socket")
        return send_if_connected(self.sock, [ident, M.encode(kind, **fields)])


class RecordingOutbox(_Addressed):
    """An :class:`Outbox` that keeps ``(ident, kind, fields)`` for each message instead of
    sending it; each is encoded and decoded on the way, as on the wire."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str, dict[str, Any]]] = []
        self.gone: set[bytes] = set()  # connections :meth:`still_there` finds closed

    def reply(self, envelope: list[bytes], kind: str, **fields: Any) -> None:
        self.reply_encoded(envelope, M.encode(kind, **fields))

    def reply_encoded(self, envelope: list[bytes], raw: bytes) -> None:
        msg = M.decode(raw)
        self.sent.append((envelope[0], msg["t"], {k: v for k, v in msg.items() if k not in ("t", "v")}))

    def still_there(self, ident: bytes, kind: str, **fields: Any) -> bool:
        if ident in self.gone:
            return False
        self.reply([ident], kind, **fields)
        return True

    def kinds(self, ident: bytes | None = None) -> list[str]:
        """The kinds sent (to ``ident`` only, if given), in order."""
        return [k for i, k, _ in self.sent if ident is None or i == ident]

    def last(self, kind: str, ident: bytes | None = None) -> dict[str, Any]:
        """The fields of the last message of ``kind`` (to ``ident``, if given)."""
        for i, k, f in reversed(self.sent):
            if k == kind and (ident is None or i == ident):
                return f
        raise AssertionError(f"no {kind!r} message was sent{f' to {ident!r}' if ident else ''}: {self.kinds()}")

    def clear(self) -> None:
        self.sent.clear()
