"""A replacement replica copies its shard from a healthy peer (see
:mod:`shadow.coordinator.replicas`): one ``fetch`` of iteration m - 1 on the peer's serve
socket, answered once the peer has applied exactly that iteration (the coordinator holds
the cut there), then installed as this worker's applied state. Imports no torch."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from shadow import security
from shadow.config.tuning import Tuning
from shadow.transport import SocketFactory, fetch, fetch_limit
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.worker.outbox import Outbox
from shadow.worker.state import WorkerState, go_stale

logger = logging.getLogger(__name__)


class PeerError(ValueError):
    """A peer's reply does not fit this worker's assignment."""


@dataclass
class PeerFetch:
    """One ``fetch`` of iteration ``iteration`` on peer worker ``id``'s serve socket, in
    flight: its reply is read straight into the session's arrays, part by part (``reader``),
    as the worker's event loop finds them. ``deadline``: ``FETCH_TIMEOUT_S`` after the last
    part (or the request)."""

    id: int
    serve: str
    iteration: int
    sock: zmq.Socket
    deadline: float
    started: float
    reader: fetch.ReplyReader

    @classmethod
    def start(cls, sockets: SocketFactory, peer: dict, session, tuning: Tuning) -> PeerFetch:
        st = session.state
        rcvhwm = max(2, PEER_BUFFER_BYTES // max(1, tuning.fetch_chunk_bytes))
        ticket, key = peer.get("ticket"), peer.get("key")
        if not (isinstance(ticket, bytes) and isinstance(key, bytes)):
            ticket = key = None
        if ticket is not None and key is not None:  # mac mode: the peer's serve socket is in clear
            door = security.ticket_door(ticket, key)
            sock = sockets.dealer(peer["serve"], fetch_limit(tuning), keys=door, rcvhwm=rcvhwm)
            mac = tags.fetch_mac(key, session.epoch, session.base)
            sock.send(M.encode("fetch", epoch=session.epoch, iteration=session.base, ticket=ticket, mac=mac))
        else:
            sock = sockets.dealer(peer["serve"], fetch_limit(tuning), rcvhwm=rcvhwm)
            sock.send(M.encode("fetch", epoch=session.epoch, iteration=session.base))
        reader = fetch.ReplyReader(
            epoch=session.epoch,
            iteration=session.base,
            start=st.start,
            stop=st.stop,
            fields=[int(f) for f in st.fields()],
            who="peer",
            target=lambda fld: fetch.as_bytes(st.array(fld)),
            commit_bytes=tuning.max_commit_bytes,
            key=key,
        )
        now = time.monotonic()
        return cls(int(peer["id"]), peer["serve"], session.base, sock, now + tuning.fetch_timeout_s, now, reader)

    def read(self, timeout_s: float) -> bool:
        """Feed the reader every part already here; True once the reply is complete
        (raises :class:`PeerError` for a reply that cannot be installed)."""
        parts = fetch.SocketParts(self.sock, zmq.NOBLOCK)
        try:
            while not self.reader.done:
                try:
                    self.reader.feed(parts)
                except zmq.Again:
                    return False
                self.deadline = time.monotonic() + timeout_s
            self.reader.finish(parts)
        except fetch.FetchError as exc:
            raise PeerError(str(exc)) from None
        return True

    def close(self) -> None:
        self.sock.close(linger=0)


PEER_BUFFER_BYTES = 64 << 20  # what zmq may hold of a peer's reply before the event loop takes it


def install(session, reader: fetch.ReplyReader, iteration: int) -> None:
    """Install a peer's complete ``fetch_reply`` (its arrays are in place already) as this
    session's applied state at ``iteration``."""
    st, head = session.state, reader.head
    if head is None or not reader.done:
        raise PeerError("the peer's reply is not complete")
    try:
        nparams = len(st.steps)
        steps = fetch.param_indices(head["steps"], nparams, "peer", "a step")
        flags = fetch.param_indices(head["has_state"], nparams, "peer", "state flags")
    except fetch.FetchError as exc:
        raise PeerError(str(exc)) from None
    st.has_state[:] = False
    for i, v in steps:
        st.steps[int(i)] = float(v)
    for i in flags:
        st.has_state[int(i)] = True
    session.blobs = {int(r): bytes(b) for r, b in head["commits"]}
    session.extras = reader.extras
    session.commit = head["replay"]
    session.applied = session.prepared = session.seen = iteration


class PeerCopy:
    """Fills a joining replica's assignment from a healthy peer: the ``configure`` of such a
    replica names the peer, :meth:`start` sends the fetch, :meth:`on_reply` installs the
    reply and tells the coordinator ``copied``; a failed or late copy makes the assignment
    stale (:meth:`failed`, :meth:`check_deadline`). One copy at a time (``fetch``); a new
    epoch or a reset cancels it (:meth:`cancel`).

    Connects with ``sockets`` (the process's CURVE client keys), reads and writes ``state``
    and sends through ``outbox``. Owned by the worker's main thread."""

    def __init__(self, state: WorkerState, outbox: Outbox, sockets: SocketFactory) -> None:
        self.state, self.outbox, self.sockets = state, outbox, sockets
        self.fetch: PeerFetch | None = None  # the state fetch from a peer replica, while in flight

    @property
    def sock(self) -> zmq.Socket | None:
        """The socket the peer's reply arrives on, while a copy is in flight."""
        return self.fetch.sock if self.fetch is not None else None

    def start(self, peer: dict) -> None:
        """Fetch the assignment's base iteration from ``peer`` (``{"id", "serve"}``)."""
        s = self.state.assignment
        if s is None:
            raise RuntimeError("a peer copy needs the session it fills: configure first")
        if self.fetch is not None:
            self.fetch.close()
        self.fetch = PeerFetch.start(self.sockets, peer, s, self.state.tuning)
        logger.info(
            "fetching iteration %d of range [%d, %d) from peer worker %d",
            s.base,
            s.state.start,
            s.state.stop,
            self.fetch.id,
        )

    def on_reply(self) -> None:
        """Parts of the peer's reply arrived: read them into place; once all are here,
        install the shard, or give up on the copy."""
        p, s = self.fetch, self.state.assignment
        if p is None or s is None:
            raise RuntimeError("a peer reply with no peer copy in flight")
        try:
            if not p.read(self.state.tuning.fetch_timeout_s):
                return
            install(s, p.reader, p.iteration)
        except (PeerError, M.MessageError) as exc:
            self.failed(f"copy from peer worker {p.id} failed: {exc}")
            return
        except Exception as exc:  # a malformed head that got past validation: the copy failed, the worker lives
            self.state.rejected["peer_error_" + type(exc).__name__] += 1
            logger.exception("copy from peer worker %d failed", p.id)
            self.failed(f"copy from peer worker {p.id} failed: {type(exc).__name__}: {exc}")
            return
        self.fetch = None
        p.close()
        self.state.awaiting_copy = False
        seconds = time.monotonic() - p.started
        logger.info("copied iteration %d from peer worker %d in %.2f s", p.iteration, p.id, seconds)
        self.outbox.to_coord("copied", epoch=s.epoch, iteration=p.iteration, seconds=seconds)

    def check_deadline(self, now: float) -> None:
        """A copy with no part of its reply for ``FETCH_TIMEOUT_S`` has failed."""
        p = self.fetch
        if p is not None and now > p.deadline:
            limit = self.state.tuning.fetch_timeout_s
            self.failed(f"peer worker {p.id} sent nothing of iteration {p.iteration} for {limit:.0f} s")

    def failed(self, reason: str) -> None:
        """Give up on the copy: the assignment is stale (the coordinator resyncs it)."""
        self.cancel()
        go_stale(self.state, self.outbox, reason)

    def cancel(self) -> None:
        """Drop the copy in flight, if any (its epoch is over, or the worker resets)."""
        if self.fetch is not None:
            self.fetch.close()
            self.fetch = None
