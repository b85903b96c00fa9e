"""The trainer's end of the UCX data path (``shadow.transport.ucx``, where the stream, the
handshake and the faults are described): :class:`UcxDataSender`, one connection per
worker, its handshake, acknowledgements, reconnects and broken channels."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shadow.security import Door
from shadow.transport.send import open_each
from shadow.transport.ucx_base import (
    ACK,
    ACK_TIMEOUT_S,
    ACKED,
    ACKED_MAGIC,
    CONNECT_ATTEMPTS,
    MAGIC,
    PREAMBLE,
    PROBE,
    PROBE_SIZES,
    READY,
    READY_TIMEOUT_S,
    RECONNECTS,
    SIZE,
    TOKEN_BYTES,
    Held,
    Pending,
    _array,
    _as_bytes,
    _close_endpoint,
    _context,
    lib,
    pack_door,
    parse,
)
from shadow.transport.ucx_channel import DROPPED, Channel, Sent

logger = logging.getLogger("shadow.transport.ucx")

#: sends UCX never completed, kept for the life of the process rather than freed under it
_LEAKED: list = []


class UcxDataSender:
    """A :class:`~shadow.transport.send.DataSender` over UCX: one connection per worker,
    driven by UCX's progress thread (it sleeps on UCX's event file descriptor). ``hwm``:
    unacknowledged messages per worker before :meth:`send` waits (as a ZeroMQ send blocks
    at its high-water mark). ``endpoints``: ``ucx://host:port`` per worker, or "" for a
    worker not reached over UCX.

    A new connection carries no data message before it has been tried both ways: the
    worker's READY arrives, then the trainer sends a probe (a message sent as a data
    message is, carrying the channel's token) and the worker's ACK of it arrives. Messages
    sent before wait here (up to ``hwm``) and go, in order, once it has. UCX over TCP lost
    the stream of a connection that had just been set up (its first bytes arrived, the rest
    never did, with every send reported complete), and a listener that is not a shadow
    worker never says READY. A connection that fails, or does not answer within
    :data:`READY_TIMEOUT_S` (READY) or :data:`ACK_TIMEOUT_S` (ACK), is made again.

    Delivery is acknowledged: the worker says how many messages reached it whole on the
    connection, and a message is done (its ring slots free) only then. A ready connection
    that closes (its worker may live: UCX over TCP closed one under load with no fault) is
    made again, and what it had not acknowledged is sent again, in order; the worker reads
    what the old connection brought first and drops what arrives twice. After
    :data:`CONNECT_ATTEMPTS` connections in a row that fail before their handshake is done
    (a dead or reset worker refuses them), or :data:`RECONNECTS` ready ones lost in a row
    with no message acknowledged between, the channel is broken: its messages are given up
    and later ones dropped until :meth:`open`."""

    def __init__(self, endpoints: Sequence[str], hwm: int, curve: Sequence[bool | Door] | None = None) -> None:
        if curve is not None and any(c is True for c, ep in zip(curve, endpoints, strict=False) if ep):
            raise ValueError(
                "a worker's data socket takes CURVE, which UCX does not carry: stream over UCX with "
                "security.data=mac (frames under MACs) or keep transport.data=zmq"
            )
        self.L = lib()
        self.hwm = max(1, hwm)
        #: whether a ready connection that is lost is made again (a peer standing for one
        #: that never does, in tests, turns it off)
        self.reconnect = True
        self.ctx = _context(self.L)
        # requests are handed to the progress thread, which submits them (delayed submission):
        # calling into UCX from this thread while that one progresses the same worker is a race.
        # It sleeps on UCX's event descriptor for at most 1 ms: an idle thread wakes ~1000
        # times a second, where a polling thread would take a core
        self.worker = self.L.UCXWorker(self.ctx, enable_delayed_submission=True)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self.chans: list[Channel | None] = [None] * len(endpoints)
        # per worker: what its probe proves at the worker's door (None: nothing, no keys)
        self.doors: list[Door | None] = [c if isinstance(c, Door) else None for c in (curve or [])] or [None] * len(
            endpoints
        )
        self._connecting: dict[int, Channel] = {}  # channels awaiting their worker's READY or ACK
        self._held = Held()  # sends of closed connections UCX has not let go of yet
        open_each(self, endpoints)

    # -- DataSender ------------------------------------------------------------------------------
    def send(self, worker: int, frames: Sequence, track: bool) -> Any:
        ch = self.chans[worker] if 0 <= worker < len(self.chans) else None
        if ch is None:
            raise ValueError(f"no channel to shadow worker {worker}: it was dropped and not opened again")
        self._advance_connecting()
        self._reap(worker, ch)
        while len(ch.out) >= self.hwm and ch.broken is None:
            time.sleep(0.0002)
            self._advance_connecting()
            self._reap(worker, ch)
        if ch.broken is not None:  # until open() gives this worker a channel again (a resync, a replica_in)
            if not ch.dropped:
                logger.warning(
                    "shadow worker %d: %s; its messages are dropped until it is reached again", worker, ch.broken
                )
            ch.dropped += 1
            return DROPPED if track else None
        bufs = [_as_bytes(f) if track else np.frombuffer(bytes(f), dtype=np.uint8) for f in frames]
        head = bytearray(PREAMBLE.pack(MAGIC, len(bufs), sum(b.nbytes for b in bufs)))
        for b in bufs:
            head += SIZE.pack(b.nbytes)
        sent = Sent([], [np.frombuffer(bytes(head), dtype=np.uint8), *bufs], None, self, worker)
        ch.out.append(sent)
        if ch.ready:
            self._submit(ch, sent)
        return sent if track else None

    def open(self, worker: int, endpoint: str, curve: bool | Door | None = None) -> None:
        if curve is True:
            raise ValueError(f"shadow worker {worker} takes CURVE on its data socket, which UCX does not carry")
        parse(endpoint)
        self.drop(worker)
        if curve is not None:
            self.doors[worker] = curve if isinstance(curve, Door) else None
        ch = Channel(endpoint, self.doors[worker])
        self.chans[worker] = ch
        self._connect(worker, ch)

    def drop(self, worker: int) -> None:
        ch, self.chans[worker] = self.chans[worker], None
        self._connecting.pop(worker, None)
        if ch is not None:
            self._close_connection(ch)
            self._give_up(ch)

    def poll(self) -> None:
        self._advance_connecting()
        for worker, ch in enumerate(self.chans):
            if ch is not None and ch.ready:
                self._reap(worker, ch)

    def poll_one(self, worker: int) -> None:
        """Move ``worker``'s channel along, without waiting (a message's ``done`` asks)."""
        ch = self.chans[worker]
        if ch is None:
            return
        if worker in self._connecting:
            self._check_ready(worker, ch)
        elif ch.ready:
            self._reap(worker, ch)

    def close(self) -> None:
        for w in range(len(self.chans)):
            self.drop(w)
        try:
            self.worker.stop_progress_thread()
        except Exception:  # already stopped, or never started
            logger.debug("stopping UCX's progress thread", exc_info=True)
        left = self._held.settle(self.worker, 0.25)
        if left:  # held for good: UCX may still read them
            _LEAKED.extend(left)
            logger.warning("%d UCX sends never completed after their connections closed", len(left))

    # -- connections -----------------------------------------------------------------------------
    def _connect(self, worker: int, ch: Channel) -> None:
        """Make ``ch``'s next connection and post the receive of the worker's READY."""
        host, port = parse(ch.endpoint)
        ch.broken, ch.ready, ch.attempts, ch.expect = None, False, ch.attempts + 1, READY
        ch.submitted = ch.acked = 0
        ch.failure = None
        try:
            ep = self.L.UCXEndpoint.create(self.worker, host, port, True)
        except Exception as exc:  # UCX refuses the address at once (most failures come later, as errors)
            self._break(worker, ch, f"cannot connect to {ch.endpoint}: {exc}")
            return
        # no close callback: UCX would call it on its progress thread, which then waits for the GIL
        # while holding the worker's lock, and a send on this thread waits for that lock
        ch.ep = ep
        buf = np.zeros(len(READY), np.uint8)
        try:
            ch.hello = Sent([ep.stream_recv(_array(buf))], [buf], ep)
        except Exception as exc:  # the connection failed at once
            self._close_connection(ch)
            self._retry(worker, ch, f"the connection failed before the worker's READY ({exc})")
            return
        ch.since = time.monotonic()
        self._connecting[worker] = ch

    def _advance_connecting(self) -> None:
        """Move every connection awaiting its READY or ACK along, without waiting."""
        for worker, ch in list(self._connecting.items()):
            self._check_ready(worker, ch)

    def _check_ready(self, worker: int, ch: Channel) -> None:
        hello = ch.hello
        assert hello is not None and ch.ep is not None
        why = None
        what = "READY" if ch.expect == READY else "ACK of its probe"
        timeout = READY_TIMEOUT_S if ch.expect == READY else ACK_TIMEOUT_S
        if hello.finished:
            try:
                hello.reqs[0].check_error()
            except Exception as exc:
                why = f"the connection failed before the worker's {what} ({exc})"
            else:
                if hello.bufs[0].tobytes() != ch.expect:
                    why = f"the listener answered with something other than a shadow worker's {what}"
        elif not ch.ep.alive:
            why = f"the connection failed before the worker's {what}"
        elif time.monotonic() - ch.since > timeout:
            why = f"no {what} within {timeout:g} s"
        else:
            return  # still waiting
        if why is None and ch.expect == READY:
            try:
                self._send_probe(ch)
                return
            except Exception as exc:  # the connection failed since READY
                why = f"the connection failed after the worker's READY ({exc})"
        del self._connecting[worker]
        if why is None:
            self._held.add(ch.probe)  # acknowledged, but UCX may not have completed its send yet
            ch.ready, ch.hello, ch.probe, ch.attempts = True, None, None, 0
            try:
                ch.acks = self._post_ack(ch)
            except Exception as exc:  # _reap finds it and connects again
                ch.failure = f"the UCX connection to {ch.endpoint} failed ({exc})"
            for sent in ch.out:
                if sent.ep is not None:
                    ch.resent += 1
                self._submit(ch, sent)
            return
        self._close_connection(ch)
        self._retry(worker, ch, why)

    def _retry(self, worker: int, ch: Channel, why: str) -> None:
        """``ch``'s connection failed: make it again, or break the channel (see the class)."""
        if ch.attempts >= CONNECT_ATTEMPTS or not self.reconnect:
            self._break(worker, ch, f"no working UCX connection to {ch.endpoint} after {ch.attempts} attempts: {why}")
            return
        if ch.lost > RECONNECTS:
            self._break(
                worker, ch, f"{ch.lost} UCX connections to {ch.endpoint} in a row lost with nothing acknowledged: {why}"
            )
            return
        logger.warning(
            "shadow worker %d: connecting to %s again (%d messages to send again): %s",
            worker,
            ch.endpoint,
            len(ch.out),
            why,
        )
        self._connect(worker, ch)

    def _send_probe(self, ch: Channel) -> None:
        """READY came: send the probe, as a data message is sent, and await its ACK."""
        frames = [np.zeros(PROBE_SIZES[0], np.uint8), np.zeros(PROBE_SIZES[1], np.uint8)]
        frames[0][:TOKEN_BYTES] = np.frombuffer(ch.token, np.uint8)
        door = pack_door(ch.door.user, ch.door.password) if ch.door is not None else pack_door(b"", b"")
        frames[1][: len(door)] = np.frombuffer(door, np.uint8)
        head = PREAMBLE.pack(PROBE, len(frames), sum(f.nbytes for f in frames))
        head += b"".join(SIZE.pack(f.nbytes) for f in frames)
        probe = Sent([], [np.frombuffer(head, np.uint8), *frames], None)
        self._submit(ch, probe, data=False)
        if ch.failure is not None:
            raise ConnectionError(ch.failure)
        buf = np.zeros(len(ACK), np.uint8)
        ch.hello = Sent([ch.ep.stream_recv(_array(buf))], [buf], ch.ep)
        ch.probe, ch.expect, ch.since = probe, ACK, time.monotonic()

    def _post_ack(self, ch: Channel) -> Sent:
        buf = np.zeros(ACKED.size, np.uint8)
        return Sent([ch.ep.stream_recv(_array(buf))], [buf], ch.ep)

    def _submit(self, ch: Channel, sent: Sent, data: bool = True) -> None:
        """Hand a message to UCX on ``ch``'s ready connection: the preamble and sizes, then
        each frame from where it lies."""
        if sent.reqs:  # handed to a connection that is gone: UCX may hold those requests still
            self._held.add(Pending(sent.reqs, sent.bufs))
        sent.reqs, sent.ep = [], ch.ep
        if data:
            ch.submitted += 1
        if ch.failure is not None:  # the connection is gone: it goes again on the next one
            return
        try:
            for b in sent.bufs:
                if b.nbytes:
                    sent.reqs.append(ch.ep.stream_send(_array(b)))
        except Exception as exc:  # UCX closed the connection under us (a failure, or its peer)
            ch.failure = f"a send to {ch.endpoint} could not be posted: {exc}"

    def _reap(self, worker: int, ch: Channel) -> None:
        """Take the worker's acknowledgements on ``ch``'s ready connection (those messages
        are done); a connection that failed is made again."""
        self._held.prune()
        if not ch.ready or ch.broken is not None:
            return
        why = ch.failure
        acks = ch.acks
        while why is None and acks is not None and acks.finished:
            try:
                acks.reqs[0].check_error()
            except Exception as exc:
                why = f"the UCX connection to {ch.endpoint} failed ({exc})"
                break
            magic, n = ACKED.unpack(acks.bufs[0].tobytes())
            if magic != ACKED_MAGIC or not ch.acked <= n <= ch.submitted:
                why = f"{ch.endpoint} acknowledged {n} of {ch.submitted} messages ({magic!r})"
                break
            for _ in range(n - ch.acked):
                sent = ch.out.popleft()
                sent.settled, sent.owner = True, None
            if n > ch.acked:
                ch.lost = 0  # this connection carried messages through
            ch.acked = n
            if not ch.ep.alive:
                break
            try:
                ch.acks = acks = self._post_ack(ch)
            except Exception as exc:  # closed under us since
                why = f"the UCX connection to {ch.endpoint} failed ({exc})"
        if why is None and not ch.ep.alive:
            why = f"the UCX connection to {ch.endpoint} closed"
        if why is None and ch.out and ch.out[0].finished:
            try:
                for r in ch.out[0].reqs:
                    r.check_error()
            except Exception as exc:
                why = f"a send to {ch.endpoint} failed: {exc}"
        if why is not None:
            ch.lost += 1
            self._close_connection(ch)
            self._retry(worker, ch, why)

    def _break(self, worker: int, ch: Channel, why: str) -> None:
        ch.broken = why
        n = self._give_up(ch)
        if n:  # the first of the messages dropped from now on is counted and logged here
            ch.dropped += n
            logger.warning("shadow worker %d: %s; its messages are dropped until it is reached again", worker, why)

    def _give_up(self, ch: Channel) -> int:
        """Every message of ``ch`` is done, never to be sent (again); how many there were."""
        for sent in ch.out:
            sent.settled, sent.owner = True, None
            if sent.reqs:
                self._held.add(sent)
        n = len(ch.out)
        ch.out.clear()
        return n

    def _close_connection(self, ch: Channel) -> None:
        """Close ``ch``'s connection; what UCX may still read or write for it is held until
        it lets go. Its messages stay, to be sent again or given up."""
        ep, ch.ep = ch.ep, None
        if ep is not None:
            _close_endpoint(ep)
        self._held.add(ch.hello, ch.probe, ch.acks)
        ch.hello = ch.probe = ch.acks = None
        ch.ready = False
