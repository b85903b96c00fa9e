"""The trainer's state of one UCX channel (``shadow.transport.ucx``): a message sent on it
(:class:`Sent`, done once its worker acknowledges it), the stand-in for one dropped
(:data:`DROPPED`), and :class:`Channel`, a worker's unacknowledged messages and its current
connection's handshake. :class:`~shadow.transport.ucx_send.UcxDataSender` drives them."""

from __future__ import annotations

import collections
import os
from typing import Any, Protocol

from shadow.security import Door
from shadow.transport.ucx_base import READY, TOKEN_BYTES, Pending


class Owner(Protocol):
    """The sender a message went through: a message's ``done`` asks it to move that
    message's channel along."""

    def poll_one(self, worker: int) -> None: ...


class Sent(Pending):
    """One message: its buffers and the send requests of its latest submission. ``done``
    once its worker has acknowledged it (it reached the worker whole) or it was given up
    (its channel broke or was dropped); its buffers are not read for it after that, except
    by UCX on a connection that is gone (they stay referenced until UCX lets go).
    ``ep``: the connection it was last handed to (None: not yet)."""

    __slots__ = ("ep", "owner", "worker", "settled")

    def __init__(self, reqs: list, bufs: list, ep: Any, owner: Owner | None = None, worker: int = -1) -> None:
        super().__init__(reqs, bufs)
        self.ep, self.owner, self.worker, self.settled = ep, owner, worker, False

    @property
    def done(self) -> bool:
        if not self.settled and self.owner is not None:
            self.owner.poll_one(self.worker)  # reads its acknowledgements, moves its connection along
        return self.settled


class Dropped:
    """A message that was never handed to UCX (its channel is broken)."""

    done = True


DROPPED = Dropped()


class Channel:
    """A trainer's channel to one worker over UCX: its unacknowledged messages, kept across
    the connections made to that worker, and where the current connection stands."""

    def __init__(self, endpoint: str, door: Door | None = None) -> None:
        self.endpoint = endpoint
        self.door = door  # what each connection's probe proves at the worker's door
        self.token = os.urandom(TOKEN_BYTES)  # names this channel to the worker across its connections
        self.ep: Any = None
        #: unacknowledged messages in order: those handed to the current connection first
        self.out: collections.deque[Sent] = collections.deque()
        self.broken: str | None = None
        self.dropped = 0
        # the worker's READY, then ACK, on the current connection: the receive of the one
        # awaited, which, since when, which attempt; the probe sent between
        self.ready = False
        self.hello: Sent | None = None
        self.expect = READY
        self.probe: Sent | None = None
        self.since = 0.0
        self.attempts = 0  # connections made in a row that failed before their handshake
        self.lost = 0  # ready connections lost in a row, no message acknowledged between
        # once ready: the receive of the worker's next acknowledgement; messages handed to
        # the connection and acknowledged on it
        self.acks: Sent | None = None
        self.submitted = 0
        self.acked = 0
        self.resent = 0  # messages handed to a new connection again
        self.failure: str | None = None  # why a call on the current connection failed
