"""A replacement replica copies its shard from a healthy peer (see
:mod:`shadow.coordinator.replicas`): one ``fetch`` of iteration m - 1 on the peer's serve
socket, answered once the peer has applied exactly that iteration (the coordinator holds
the cut there), then installed as this worker's applied state. Imports no torch."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from shadow import knobs
from shadow.transport import SocketFactory, fetch, fetch_limit
from shadow.wire import messages as M
from shadow.worker._host import WorkerHost
from shadow.worker.memory import available_bytes

logger = logging.getLogger(__name__)


class PeerError(ValueError):
    pass


@dataclass
class PeerCopy:
    id: int
    serve: str
    iteration: int
    sock: zmq.Socket
    deadline: float
    started: float

    @classmethod
    def start(cls, ctx: zmq.Context, peer: dict, epoch: int, iteration: int, keys=None) -> PeerCopy:
        sock = SocketFactory(ctx, keys=keys).dealer(peer["serve"], fetch_limit())
        sock.send(M.encode("fetch", epoch=epoch, iteration=iteration))
        now = time.monotonic()
        return cls(int(peer["id"]), peer["serve"], iteration, sock, now + knobs.get("FETCH_TIMEOUT_S"), now)

    def close(self) -> None:
        self.sock.close(linger=0)


def install(session, parts: list[bytes], iteration: int) -> None:
    """Check a peer's ``fetch_reply`` against this session and install it."""
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


class PeerMixin(WorkerHost):
    """Worker handlers: ``reset`` (a damaged replica) and the peer copy of a joining one."""

    def _reset(self, reason: str) -> None:
        """A damaged replica: drop the session and every queued frame (a fresh data socket),
        then register again; the coordinator brings it back through a peer copy."""
        logger.warning("resetting worker %d: %s", self.worker_id, reason)
        self.data.close(linger=0)
        self._open_data()
        if self.assignment is not None:
            self.assignment.close()
        self.assignment, self.pending_fetch = None, []
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._to_coord(
            "register",
            data=self.data_ep,
            serve=self.serve_ep,
            pid=os.getpid(),
            worker_id=self.worker_id,
            memory=available_bytes(),
        )

    def _start_peer_copy(self, peer: dict) -> None:
        s = self.assignment
        if s is None:
            raise RuntimeError("a peer copy needs the session it fills: configure first")
        if self.peer is not None:
            self.peer.close()
        self.peer = PeerCopy.start(self.ctx, peer, s.epoch, s.base, self.keys)
        logger.info(
            "fetching iteration %d of range [%d, %d) from peer worker %d",
            s.base,
            s.state.start,
            s.state.stop,
            self.peer.id,
        )

    def _peer_reply(self) -> None:
        p, s = self.peer, self.assignment
        if p is None or s is None:
            raise RuntimeError("a peer reply with no peer copy in flight")
        parts = p.sock.recv_multipart()
        self.peer = None
        p.close()
        try:
            install(s, parts, p.iteration)
        except (PeerError, M.MessageError) as exc:
            self._peer_failed(f"copy from peer worker {p.id} failed: {exc}")
            return
        except Exception as exc:  # a malformed head that got past validation: the copy failed, the worker lives
            self.rejected["peer_error_" + type(exc).__name__] += 1
            logger.exception("copy from peer worker %d failed", p.id)
            self._peer_failed(f"copy from peer worker {p.id} failed: {type(exc).__name__}: {exc}")
            return
        self.awaiting_copy = False
        seconds = time.monotonic() - p.started
        logger.info("copied iteration %d from peer worker %d in %.2f s", p.iteration, p.id, seconds)
        self._to_coord("copied", epoch=s.epoch, iteration=p.iteration, seconds=seconds)

    def _peer_failed(self, reason: str) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._go_stale(reason)
