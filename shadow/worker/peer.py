"""A replacement replica copies its shard from a healthy peer (see
:mod:`shadow.coordinator.replicas`): one ``fetch`` of iteration m - 1 on the peer's serve
socket, answered once the peer has applied exactly that iteration (the coordinator holds
the cut there), then installed as this worker's applied state. Imports no torch."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from shadow.transport import SocketFactory, fetch, fetch_limit
from shadow.tuning import Tuning
from shadow.wire import messages as M
from shadow.worker.outbox import Outbox
from shadow.worker.worker_state import WorkerState, go_stale

logger = logging.getLogger(__name__)


class PeerError(ValueError):
    """A peer's reply does not fit this worker's assignment."""


@dataclass
class PeerFetch:
    """One ``fetch`` of iteration ``iteration`` on peer worker ``id``'s serve socket, in flight."""

    id: int
    serve: str
    iteration: int
    sock: zmq.Socket
    deadline: float
    started: float

    @classmethod
    def start(cls, sockets: SocketFactory, peer: dict, epoch: int, iteration: int, tuning: Tuning) -> PeerFetch:
        sock = sockets.dealer(peer["serve"], fetch_limit(tuning))
        sock.send(M.encode("fetch", epoch=epoch, iteration=iteration))
        now = time.monotonic()
        return cls(int(peer["id"]), peer["serve"], iteration, sock, now + tuning.fetch_timeout_s, now)

    def close(self) -> None:
        self.sock.close(linger=0)


def install(session, parts: list[bytes], iteration: int, commit_bytes: int) -> None:
    """Check a peer's ``fetch_reply`` against this session and install it (``commit_bytes``:
    this worker's ``Tuning.max_commit_bytes``)."""
    st = session.state
    src = fetch.ListParts(parts)
    try:
        head = fetch.read_head(
            src,
            epoch=session.epoch,
            iteration=iteration,
            start=st.start,
            stop=st.stop,
            fields=[int(f) for f in st.fields()],
            who="peer",
            commit_bytes=commit_bytes,
        )
        fetch.read_arrays(src, head, lambda fld: fetch.as_bytes(st.array(fld)), "peer")
        extras = fetch.read_extras(src, head, "peer")
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
    session.extras = extras
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
        self.fetch = PeerFetch.start(self.sockets, peer, s.epoch, s.base, self.state.tuning)
        logger.info(
            "fetching iteration %d of range [%d, %d) from peer worker %d",
            s.base,
            s.state.start,
            s.state.stop,
            self.fetch.id,
        )

    def on_reply(self) -> None:
        """The peer answered: install its shard, or give up on the copy."""
        p, s = self.fetch, self.state.assignment
        if p is None or s is None:
            raise RuntimeError("a peer reply with no peer copy in flight")
        parts = p.sock.recv_multipart()
        self.fetch = None
        p.close()
        try:
            install(s, parts, p.iteration, self.state.tuning.max_commit_bytes)
        except (PeerError, M.MessageError) as exc:
            self.failed(f"copy from peer worker {p.id} failed: {exc}")
            return
        except Exception as exc:  # a malformed head that got past validation: the copy failed, the worker lives
            self.state.rejected["peer_error_" + type(exc).__name__] += 1
            logger.exception("copy from peer worker %d failed", p.id)
            self.failed(f"copy from peer worker {p.id} failed: {type(exc).__name__}: {exc}")
            return
        self.state.awaiting_copy = False
        seconds = time.monotonic() - p.started
        logger.info("copied iteration %d from peer worker %d in %.2f s", p.iteration, p.id, seconds)
        self.outbox.to_coord("copied", epoch=s.epoch, iteration=p.iteration, seconds=seconds)

    def check_deadline(self, now: float) -> None:
        """A copy not answered within ``FETCH_TIMEOUT_S`` of its start has failed."""
        p = self.fetch
        if p is not None and now > p.deadline:
            limit = self.state.tuning.fetch_timeout_s
            self.failed(f"peer worker {p.id} did not send iteration {p.iteration} within {limit:.0f} s")

    def failed(self, reason: str) -> None:
        """Give up on the copy: the assignment is stale (the coordinator resyncs it)."""
        self.cancel()
        go_stale(self.state, self.outbox, reason)

    def cancel(self) -> None:
        """Drop the copy in flight, if any (its epoch is over, or the worker resets)."""
        if self.fetch is not None:
            self.fetch.close()
            self.fetch = None
