"""The credentials a test's peer shows at a keyed worker's doors (``mac`` mode's sockets in
clear admit only peers proving a key at the handshake): a rank's, from its session, and a
reader's, from a ticket the coordinator hands out. What someone who saw them go by in clear
would have; the frames and messages behind them are still checked one by one."""

from __future__ import annotations

import zmq

from shadow import security
from shadow.restore.memory import restore_info
from shadow.wire import tags


def rank_door(session, worker: int) -> security.Door | None:
    """The session's rank's credential at ``worker``'s data socket (None without keys)."""
    t = session.sender.tags[worker]
    return security.Door(tags.rank_user(session.sender.rank), t.door) if isinstance(t, tags.DataKey) else None


def reader_door(address: str, worker: int) -> security.Door | None:
    """A reader's credential at ``worker``'s serve socket: a fresh ticket from the coordinator
    at ``address`` (None without keys)."""
    mem = restore_info(address, None, 10.0)["memory"]
    (w,) = [w for w in mem["workers"] if w["id"] == worker]
    ticket, key = w.get("ticket"), w.get("key")
    return security.ticket_door(ticket, key) if isinstance(ticket, bytes) and isinstance(key, bytes) else None


def push(endpoint: str, door: security.Door | None, linger_ms: int = 5000) -> zmq.Socket:
    """A PUSH connected to a worker's data socket through its door."""
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, linger_ms)
    if door is not None:
        door.apply(s)
    s.connect(endpoint)
    return s
