"""Serving a worker's shard to restore clients (``fetch`` on the serve socket): answered
once the wanted iteration is applied, from the current epoch or, while a re-attach
bootstraps, the retired one. Imports no torch.

Bounds: a client (a connection, i.e. a ROUTER identity) has one fetch pending or being
sent at a time, and a worker ``SERVE_MAX_FETCHES`` in all (replies dropped unread that zmq
still holds included: what never-reading clients hold stays bounded); more are answered at once with
an ``error`` starting "busy:" and counted (``serve_busy`` / ``serve_full``). An apply
waits for a shard being sent from the live state only while its client reads it: a reply
with no part handed to the kernel for ``SERVE_STALL_S`` is dropped and counted
(``serve_dropped``); that client stays busy until zmq lets go of the reply, so one that
never reads costs one such wait, not one per apply.

In mac mode (a keyed cluster with ``security.data=mac``) the serve socket is in clear, as
the data socket is: a fetch must carry a ticket of this worker's configuration and its MAC
(:mod:`shadow.wire.tags`), and the reply is a ``fetch_reply_mac`` whose head and chunks
carry GMAC tags instead of checksums. A fetch without a valid ticket is answered "busy"
(ask the coordinator again) and counted (``serve_bad_ticket``)."""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import zmq

from shadow import security
from shadow.transport import SocketFactory, fetch
from shadow.transport.sockets import DOOR_CONNECTIONS
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.worker.address import Binding
from shadow.worker.state import WorkerState

logger = logging.getLogger(__name__)

#: connections remembered as refused once (:meth:`FetchServer._tell_once`), the oldest forgotten first
TOLD_CONNECTIONS = 4096


@dataclass
class Reply:
    """A shard reply handed to zmq zero-copy: one tracker per part, done in send order."""

    client: str  # for logs: identity and peer address
    session: object  # the session whose arrays the parts point into
    trackers: list
    progress: float  # monotonic time the last part was seen done (at first: when sent)
    sent: int = 0  # parts seen done
    dropped: bool = False  # an apply stopped waiting for it; the client stays busy until zmq is done

    def advance(self, now: float) -> bool:
        """Note the parts zmq is done with since the last look; True once all are."""
        n = self.sent
        while n < len(self.trackers) and self.trackers[n].done:
            n += 1
        if n > self.sent:
            self.sent, self.progress = n, now
        return n == len(self.trackers)


def _client(ident: bytes, frame) -> str:
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        addr = None
    return f"{ident.hex()}" + (f" at {addr}" if addr else "")


class FetchServer:
    """The serve socket (a ROUTER) and the fetches on it: those waiting for their iteration
    (``pending``: ``(client identity, fetch, deadline)``) and the shard replies zmq is still
    sending zero-copy (``replies``: client identity -> :class:`Reply`).

    Reads the assignment (or the retired one) from ``state`` and counts refusals in
    ``state.rejected``. Call order: :meth:`open` (binds; the endpoint to advertise), then
    :meth:`on_message` when the socket is readable, :meth:`answer` whenever the applied
    iteration moves, :meth:`wait_for_readers` before it does, :meth:`expire` every heartbeat
    period; :meth:`close`. Owned by the worker's main thread."""

    def __init__(self, state: WorkerState, sockets: SocketFactory, binding: Binding, tickets: bool = False) -> None:
        """``tickets``: mac mode (a socket in clear; every fetch needs a ticket)."""
        self.state, self.sockets, self.binding, self.tickets = state, sockets, binding, tickets
        self.sock: zmq.Socket | None = None
        self.endpoint = ""
        self.pending: list[tuple[bytes, dict, float]] = []
        self.replies: dict[bytes, Reply] = {}
        self._told: OrderedDict[bytes, None] = OrderedDict()  # connections refused once already (_tell_once)

    def open(self) -> str:
        """Bind the serve socket; returns the endpoint restore clients and peers connect to."""
        # a reply's parts are separate messages, references to the live arrays: never drop one
        self.sock = self.sockets.router(
            M.socket_limit("serve"), sndhwm=0, curve=not self.tickets, door=self.door, door_cap=self.door_cap
        )
        self.endpoint = self.binding.bind(self.sock)
        return self.endpoint

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)

    def forget_pending(self) -> None:
        """Drop the fetches waiting for an iteration, unanswered (a reset)."""
        self.pending = []

    def on_message(self, sock: zmq.Socket) -> None:
        """One message off the serve socket (``zmq.Again`` if none): a ``fetch`` is refused
        at once when over a cap, else waits for its iteration."""
        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(parts) != 2:
            self.state.rejected["serve_malformed"] += 1
            return
        ident, raw = parts[0].bytes, parts[1]
        try:
            msg = M.decode(raw.bytes)
            if msg["t"] != "fetch":
                raise M.MessageError("unexpected", f"serve socket got {msg['t']!r}")
        except M.MessageError as exc:
            self.state.rejected["serve_" + exc.reason] += 1
            self._tell_once(sock, ident, "malformed", str(exc))
            return
        if self.tickets:
            key = self.ticket_key(msg)
            if key is None:
                self.state.rejected["serve_bad_ticket"] += 1
                self._tell_once(
                    sock,
                    ident,
                    "busy",
                    "busy: this fetch carries no valid ticket of this worker's configuration "
                    "(none, forged, or from before the worker was configured again): ask the "
                    "coordinator for the restore info again",
                )
                return
            msg["key"] = key
        else:  # curve mode: a job-scoped reader fetches its jobs' state only
            peer = security.peer_of(raw)
            problem = self._scope_problem(peer, msg["epoch"]) if peer is not None else None
            if problem is not None:
                self.state.rejected["serve_scope"] += 1
                sock.send_multipart([ident, M.encode("error", code="refused", message=problem)])
                return
        refused = self.refuse(ident)
        if refused is not None:
            reason, text = refused
            self.state.rejected[reason] += 1
            sock.send_multipart([ident, M.encode("error", code="busy", message=text)])
            return
        msg["client"] = _client(ident, raw)
        self.pending.append((ident, msg, time.monotonic() + self.state.tuning.fetch_timeout_s))
        self.answer()

    def _scope_problem(self, peer: security.Peer, epoch: int) -> str | None:
        """Why ``peer`` (a job-scoped key) may not fetch epoch ``epoch``, or None."""
        if peer.jobs is None:
            return None
        for s in (self.state.assignment, self.state.retired):
            if s is not None and s.epoch == epoch:
                if peer.may(s.job):
                    return None
                return f"this {peer.role} key may not read job {s.job!r} (it is limited to jobs {', '.join(peer.jobs)})"
        return None  # no such epoch here: answered as a wrong epoch

    def door(self, user: bytes, password: bytes) -> str:
        """Admit a connection to the serve socket in clear (on the guard's thread): the holder
        of a ticket of the current or the retired configuration proving its key
        (:func:`shadow.wire.tags.door`); else the reason it is refused."""
        ticket = tags.user_ticket(user)
        if ticket is None:
            return "user"
        for s in (self.state.assignment, self.state.retired):
            if s is not None and s.serve_key is not None:
                if hmac.compare_digest(tags.door(tags.ticket_key(s.serve_key, ticket)), password):
                    return ""
        return "key"

    def door_cap(self) -> int:
        """The most connections the serve socket in clear holds: two per rank of the job and
        :data:`~shadow.transport.sockets.DOOR_CONNECTIONS` more (readers, a peer copy)."""
        a = self.state.assignment
        return 2 * (a.world if a is not None else 0) + DOOR_CONNECTIONS

    def ticket_key(self, msg: dict) -> bytes | None:
        """The key of the fetch's ticket if the ticket is one of the current or the retired
        configuration's, the fetch asks for that configuration's epoch (a ticket reads the
        job it was handed out for, no other) and its MAC checks under it; else None."""
        ticket, mac = msg.get("ticket"), msg.get("mac")
        if not isinstance(ticket, bytes) or len(ticket) != tags.TICKET_SIZE or not isinstance(mac, bytes):
            return None
        for s in (self.state.assignment, self.state.retired):
            if s is None or s.serve_key is None or s.epoch != msg["epoch"]:
                continue
            key = tags.ticket_key(s.serve_key, ticket)
            if tags.fetch_mac_ok(key, msg["epoch"], msg["iteration"], mac):
                return key
        return None

    def refuse(self, ident: bytes) -> tuple[str, str] | None:
        """``(reason, message)`` if a fetch from ``ident`` is over a cap, else None."""
        self._forget_sent(time.monotonic())
        r = self.replies.get(ident)
        if r is not None:
            why = (
                "its previous shard reply was dropped unread and is still queued; a new connection can fetch"
                if r.dropped
                else "its previous shard reply is still being sent"
            )
            return "serve_busy", f"busy: one fetch at a time per client; {why}"
        if any(p[0] == ident for p in self.pending):
            return "serve_busy", "busy: one fetch at a time per client; its previous fetch is still waiting"
        cap = self.state.tuning.serve_max_fetches
        live = len(self.pending) + len(self.replies)  # a reply dropped unread still holds its parts
        if live >= cap:
            return "serve_full", (
                f"busy: this worker is serving {live} fetches, its limit (SERVE_MAX_FETCHES); fetch again later"
            )
        return None

    def _forget_sent(self, now: float) -> None:
        """Drop the replies zmq is done with (sent, or their client gone)."""
        for ident in [i for i, r in self.replies.items() if r.advance(now)]:
            del self.replies[ident]

    def answer(self) -> None:
        """Answer each waiting fetch whose iteration is applied (its shard), passed or of
        another epoch (an error); the others keep waiting."""
        keep = []
        retired = self.state.retired
        for ident, msg, deadline in self.pending:
            want = msg["iteration"]
            s = retired if retired is not None and msg["epoch"] == retired.epoch else self.state.assignment
            if s is None or msg["epoch"] != s.epoch:
                self._error(ident, "wrong_epoch", f"worker serves epoch {s.epoch if s else None}, not {msg['epoch']}")
            elif s.applied == want or (want < 0 and s.applied >= 0):
                try:
                    ranges = msg.get("ranges")
                    if ranges is not None:
                        ranges = fetch.check_ranges(ranges, s.state.start, s.state.stop)
                except ValueError as exc:
                    self.state.rejected["serve_malformed"] += 1
                    self._error(ident, "malformed", f"fetch ranges: {exc}")
                    continue
                self._send_state(ident, s, msg.get("client") or ident.hex(), msg.get("key"), ranges)
            elif s.applied > want:
                self._error(
                    ident, "moved_on", f"worker has moved on to iteration {s.applied}; fetch {want} again later"
                )
            else:
                keep.append((ident, msg, deadline))
        self.pending = keep

    def expire(self, now: float) -> None:
        """Answer the fetches past their deadline with a ``timeout`` error; forget the sent replies."""
        keep = []
        for ident, msg, deadline in self.pending:
            if now > deadline:
                self._error(ident, "timeout", f"iteration {msg['iteration']} was not applied here in time")
            else:
                keep.append((ident, msg, deadline))
        self.pending = keep
        self._forget_sent(now)

    def _tell_once(self, sock: zmq.Socket, ident: bytes, code: str, text: str) -> None:
        """Refuse a request that proved nothing (malformed, or without a valid ticket, on a
        socket in clear): the first refusal of a connection is answered, the next ones are
        dropped and counted (``serve_reply_dropped``). This socket queues without a limit
        (a reply's parts must never be dropped), so a peer that sends and never reads would
        otherwise grow the worker by every answer (about 160 MB per 10 s of such fetches);
        now it holds one answer per connection at most."""
        if not self.tickets:  # CURVE: every peer proved a key; each refusal is answered
            sock.send_multipart([ident, M.encode("error", code=code, message=text)])
            return
        if ident in self._told:
            self.state.rejected["serve_reply_dropped"] += 1
            return
        self._told[ident] = None
        while len(self._told) > TOLD_CONNECTIONS:
            self._told.popitem(last=False)
        sock.send_multipart([ident, M.encode("error", code=code, message=text)])

    def _error(self, ident: bytes, code: str, text: str) -> None:
        self._sock().send_multipart([ident, M.encode("error", code=code, message=text)])

    def _send_state(
        self, ident: bytes, s, client: str = "", key: bytes | None = None, ranges: list | None = None
    ) -> None:
        """Send session ``s``'s shard (``ranges``: only those element ranges of it, checked
        by the caller, echoed in the head): a head (with each chunk's xxh3, or with a ticket's
        ``key`` its GMAC tag, the head tagged too), then each field in chunks of at most
        ``FETCH_CHUNK_BYTES``, zero-copy from the live arrays, each part a message of its
        own, tracked. The next apply waits (:meth:`wait_for_readers`) while zmq sends them; a
        client still reading after that gets chunks that fail their sums and fetches again,
        so it never installs a torn shard."""
        st = s.state
        fields = st.fields()
        idx = np.flatnonzero(st.in_range)
        chunk = self.state.tuning.fetch_chunk_bytes // 4 * 4
        views = []
        spans = [(0, st.stop - st.start)] if ranges is None else [(a - st.start, b - st.start) for a, b in ranges]
        for f in fields:
            raw = st.array(f).view(np.uint8)
            for a, b in spans:
                views += [raw[i : min(i + chunk, b * 4)] for i in range(a * 4, b * 4, chunk)]
        extras = sorted(s.extras.items())  # chunks of the model state outside the optimizer, after the arrays
        if key is not None:
            salt = os.urandom(tags.SALT_SIZE)
            rk = tags.ReplyKey(key, salt)
            sums: list = [rk.tag(1 + i, v) for i, v in enumerate(views)]
            ex_sums: list = [rk.tag(1 + len(views) + j, b) for j, (_, b) in enumerate(extras)]
        else:
            sums = [F.checksum(v) for v in views]
            ex_sums = [F.checksum(b) for _, b in extras]
        head = M.encode(
            "fetch_reply",
            epoch=s.epoch,
            iteration=s.applied,
            start=st.start,
            stop=st.stop,
            arrays=[int(f) for f in fields],
            steps=[[int(i), float(st.steps[i])] for i in idx],
            has_state=[int(i) for i in idx if st.has_state[i]],
            commits=[[int(r), b] for r, b in sorted(s.blobs.items())],
            replay=s.commit,
            chunk=chunk,
            sums=sums,
            extras=[[k, len(b), c] for (k, b), c in zip(extras, ex_sums, strict=True)],
            **({} if ranges is None else {"ranges": ranges}),
        )
        if key is not None:
            head = M.encode("fetch_reply_mac", salt=salt, tag=rk.tag(0, head), head=head)
        parts = [head] + [memoryview(v) for v in views] + [b for _, b in extras]
        sock = self._sock()
        # each part its own message, so that the client takes chunks as they arrive (zmq hands
        # over a multipart message only once all of it is there); each tracked, so that an
        # apply can tell a client that reads (parts done one after another) from one that does
        # not (parts below zmq's copy threshold are done at once). The serve socket's send
        # queue is unbounded (SNDHWM 0): a ROUTER drops what is over it, and the parts are
        # zero-copy references to the live arrays, not copies
        trackers = []
        for p in parts:
            sock.send(ident, zmq.SNDMORE)
            trackers.append(sock.send(p, copy=False, track=True))
        self.replies[ident] = Reply(client or ident.hex(), s, trackers, time.monotonic())

    def wait_for_readers(self) -> None:
        """Before the live state changes: let zmq finish sending the shards served from it,
        waiting only while they make progress (a part done within ``SERVE_STALL_S``) and
        ``SERVE_HOLD_S`` at most in all. A reply that stalls, or is still going at the end,
        is dropped: its client's copy fails its checksums, and the client stays busy (see
        :meth:`refuse`) until zmq is done with it, so it costs no further waits."""
        stall, hold = self.state.tuning.serve_stall_s, self.state.tuning.serve_hold_s
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            self._forget_sent(now)
            waiting = False
            for r in self.replies.values():
                if r.dropped or r.session is not self.state.assignment:  # a retired epoch's arrays do not change
                    continue
                if now - r.progress > stall:
                    self._drop_reply(r, f"no part of it was sent for {now - r.progress:.2f} s")
                elif now - t0 >= hold:
                    self._drop_reply(r, f"it is still being sent after {hold:.1f} s (SERVE_HOLD_S)")
                else:
                    waiting = True
            if not waiting:
                return
            time.sleep(0.002)

    def _drop_reply(self, r: Reply, why: str) -> None:
        r.dropped = True
        self.state.rejected["serve_dropped"] += 1
        logger.warning(
            "restore client %s: stopped waiting for its shard reply (%s; %d of %d parts sent); applying: "
            "its copy will fail its checksums, and it gets no other fetch until zmq is done with this "
            "reply",
            r.client,
            why,
            r.sent,
            len(r.trackers),
        )

    def _sock(self) -> zmq.Socket:
        if self.sock is None:
            raise RuntimeError("the serve socket is not open: call open() first")
        return self.sock
