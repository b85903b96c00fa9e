"""Doors: what a peer proves to connect to a socket in clear (``mac`` mode's data, serve and
files sockets), checked by the guard at ZeroMQ's PLAIN handshake (:meth:`Guard.door
<shadow.security.guard.Guard.door>`)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from shadow.wire import tags

#: a door's refusals that may pass by themselves (a worker not configured yet, a socket full).
#: Such a handshake is held (its ZAP answer deferred, checked again every poll) for up to
#: DOOR_WAIT_S; then answered as temporary (300), which closes the connection without an
#: ERROR, so that the peer's ZeroMQ socket connects again instead of giving up for good as
#: it does after a 400
TEMPORARY = frozenset({"unconfigured", "crowded"})
DOOR_WAIT_S = 5.0
DOOR_DOMAIN = b"shadow-door"  # a door's ZAP domain: b"shadow-door:" and the door's number in its guard


@dataclass(frozen=True)
class Door:
    """What a peer proves at the door of a socket in clear (:meth:`Guard.door`): ZeroMQ
    PLAIN's user name and password, at most 255 bytes each. The password derives from a key
    handed out over CURVE (:func:`shadow.wire.tags.door`), never the key itself: PLAIN sends
    it in clear."""

    user: bytes
    password: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.plain_username = self.user
        sock.plain_password = self.password


def ticket_door(ticket: bytes, key: bytes) -> Door:
    """What the holder of ``ticket`` (and its ``key``, from the coordinator) proves at the door
    of a worker's serve or files socket in clear."""
    return Door(tags.ticket_user(ticket), tags.door(key))
