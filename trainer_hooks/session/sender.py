"""The background sender: owns every socket of a session after the handshake.

Work arrives on a queue in order (gradient slots, bootstrap state, commits). The sender
waits for each gradient slot's device-to-host copy (its event: the training thread never
does), computes checksums, frames it, sends payloads zero-copy from the staging ring,
frees ring slots when the transport is done with them, and listens to the coordinator for the
committed cut (the flow-control credit). A commit arrives unbuilt (:class:`CommitItem`
``make``): the sender resolves what the step copied non-blocking (scalars, probes,
audit samples, rank 0's state) and builds its frames; a commit whose check fails is
refused (:meth:`SenderEvents.on_refused`) and nothing of that iteration or later leaves.
What it hears and what goes wrong reaches the session through one :class:`SenderEvents`
object (the session's ``RecoveryController``).

Messages leave through a :class:`shadow.transport.send.DataSender` (one ordered channel
per worker), opened on the sender's thread by the ``channels`` function it is given
(:func:`data_channels` unless told otherwise). An attachment makes its sender with the
sender factory it is given (:class:`Sender` unless told otherwise; a session passes the
one it was built with, by default :data:`SENDER_FACTORY`'s in the context that built it).
Fault injection wraps from the outside through these two (``trainer_hooks.testing``): a
``FaultyDataSender`` around the channels, and a sender subclass overriding
:meth:`Sender._send` and :meth:`Sender._send_commit` to die mid-step.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq

from shadow.config.tuning import Tuning
from shadow.core.errors import ShadowError
from shadow.security import Door
from shadow.transport.channels import Channels as TransportChannels
from shadow.transport.send import DataSender
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire.tags import PLAIN, DataKey, Tags, rank_user
from trainer_hooks.session.items import (
    CommitItem,
    ExtraItem,
    FlushItem,
    GradItem,
    JoinItem,
    NoticeItem,
    Refused,
    SenderEvents,
    StateItem,
)

logger = logging.getLogger(__name__)

#: opens the channels to the workers: ``(context, endpoints, send high-water mark, curve per worker)``
Channels = Callable[[zmq.Context, list[str], int, list[bool | Door] | None], DataSender]


def data_channels(ctx: zmq.Context, endpoints: list[str], hwm: int, curve: list[bool | Door] | None) -> DataSender:
    """A channel per worker over the transport its endpoint names: a ZeroMQ PUSH socket
    (CURVE where ``curve`` says so) for ``tcp://``, UCX for ``ucx://``."""
    return TransportChannels(ctx, endpoints, hwm, curve)


class Sender(threading.Thread):
    """The trainer's sender thread for one epoch.

    Threads: after the handshake this thread owns every socket (the coordinator DEALER and
    one PUSH per worker), the sequence numbers, pending ring slots and the heartbeat clock.
    The training thread and the comm hook only put work on :attr:`q` (bucket slots,
    commits, ``stop``); what the sender learns goes back through :class:`SenderEvents`,
    called on this thread."""

    def __init__(
        self,
        ctx: zmq.Context,
        dealer: zmq.Socket,
        endpoints: list[str],
        ring,
        *,
        job_id: int,
        epoch: int,
        rank: int,
        world: int,
        layout_hash: int,
        events: SenderEvents,
        tuning: Tuning,
        tags: list[Tags] | None = None,
        curve: list[bool] | None = None,
        token: bytes | None = None,
        channels: Channels = data_channels,
    ) -> None:
        """``tags``: per worker, what this rank's frames to it are tagged with (its MAC key of
        the worker's configuration on a keyed cluster; default: checksums); ``curve``: per
        worker, whether its data socket takes CURVE (default: where this process has keys);
        ``token``: this rank's, from its ``attached`` (its heartbeats carry it, so that a
        restarted coordinator takes this connection for the rank); ``channels``: opens the
        data channels (on this thread, when it runs)."""
        super().__init__(name=f"shadow-sender-r{rank}", daemon=True)
        self.q: queue.Queue = queue.Queue()
        self.ctx, self.dealer, self.endpoints, self.ring = ctx, dealer, endpoints, ring
        self.job_id, self.epoch, self.rank, self.world, self.layout_hash = job_id, epoch, rank, world, layout_hash
        self.events = events
        self.tuning = tuning
        self.last_heard = time.monotonic()  # anything from the coordinator (it answers every heartbeat)
        self.lost = False
        self.paused: str | None = None  # why this rank stopped streaming on its own: told with every heartbeat
        self.out: set[int] = set()  # replicas out of service: nothing is sent to them
        self.data: DataSender  # the channels to the workers: opened by run(), on this thread
        self.seq = [0] * len(endpoints)
        self.tags: list[Tags] = list(tags) if tags is not None else [PLAIN] * len(endpoints)
        self.curve = list(curve) if curve is not None else None
        self.pending: list[tuple[int, int, list]] = []  # ring (off, n, trackers) awaiting the transport
        self.bytes_out = 0
        self.messages_out = 0
        self.probed: dict[int, dict] = {}  # iteration -> {(param, element): value staged}
        self.refused: int | None = None  # a refused commit: nothing of this iteration or later leaves
        self.token = token
        self.channels = channels

    # -- lifecycle ------------------------------------------------------------------------
    def run(self) -> None:
        opened: DataSender | None = None
        try:
            self.data = opened = self.open_data(list(self.endpoints))
            poll = self.tuning.sender_poll_s
            hb = self.tuning.heartbeat_s
            next_hb = 0.0
            while True:
                try:
                    item = self.q.get(timeout=poll)
                except queue.Empty:
                    item = None
                if item is not None:
                    if item == "stop":
                        break
                    self._handle(item)
                self._reap()
                self._listen()
                now = time.monotonic()
                if not self.lost and now - self.last_heard > self.tuning.coordinator_lost_s:
                    self.lost = True
                    self.events.on_lost(
                        f"no answer from the shadow coordinator for {now - self.last_heard:.1f} s "
                        f"(SHADOW_COORDINATOR_LOST_S)"
                    )
                if now >= next_hb:  # lets a restarted coordinator find this rank again
                    next_hb = now + hb
                    self._notify(
                        "trainer_hb",
                        epoch=self.epoch,
                        rank=self.rank,
                        world=self.world,
                        job_id=self.job_id,
                        seq=list(self.seq),
                        **({"token": self.token} if self.token else {}),
                    )
                    if self.paused is not None and not self.lost:  # until the coordinator asks for the resync
                        self._notify("paused", epoch=self.epoch, rank=self.rank, reason=self.paused)
        except BaseException as exc:  # the session logs it, degrades and trains on
            self.events.on_error(exc)
        finally:
            self._drain_on_exit()
            if opened is not None:
                opened.close()

    def stop(self) -> None:
        self.q.put("stop")

    def open_data(self, endpoints: list[str]) -> DataSender:
        """The channels to the workers, opened on this thread by :attr:`channels`."""
        how = None if self.curve is None else [self._secure(w, c) for w, c in enumerate(self.curve)]
        return self.channels(self.ctx, endpoints, self.tuning.sndhwm_messages, how)

    def _secure(self, worker: int, curve: bool) -> bool | Door:
        """How the channel to ``worker`` is opened: CURVE (True), through the door of its data
        socket in clear with this rank's credential (a keyed cluster's ``mac`` mode) or plain."""
        if curve:
            return True
        t = self.tags[worker]
        return Door(rank_user(self.rank), t.door) if isinstance(t, DataKey) else False

    def _drain_on_exit(self) -> None:
        # wake anyone waiting on a flush; free the ring so a blocked hook can fail fast
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, FlushItem):
                item.done.set()

    # -- work -----------------------------------------------------------------------------------
    def _handle(self, item) -> None:
        if self.refused is not None and getattr(item, "iteration", -1) >= self.refused:
            if isinstance(item, GradItem):  # never framed: its slot is free at once (after its copy)
                item.ready.synchronize()
                self.ring.release(item.ring_off, item.nelem)
            return
        if isinstance(item, GradItem):
            item.ready.synchronize()  # the device-to-host copy into the slot
            data = self.ring.array[item.ring_off : item.ring_off + item.nelem]
            if item.probes:
                seen = self.probed.setdefault(item.iteration, {})
                for pos, pidx, elem in item.probes:
                    seen[(pidx, elem)] = np.float32(data[pos])
            self._send_payload(item.iteration, F.Kind.GRAD, F.Field.GRAD, data, item.runs, (item.ring_off, item.nelem))
        elif isinstance(item, StateItem):
            self._send_payload(item.iteration, F.Kind.STATE, item.field, item.data, item.runs, None)
        elif isinstance(item, CommitItem):
            if item.make is not None:
                try:
                    extras, item.bodies = item.make(self.probed.pop(item.iteration, {}))
                except Refused as exc:
                    self.refused = item.iteration
                    self.events.on_refused(item.iteration, exc.__cause__ or exc)
                    return
                for extra in extras:
                    self._send_extra(extra)
            self._send_commit(item)
        elif isinstance(item, ExtraItem):
            self._send_extra(item)
        elif isinstance(item, JoinItem):
            self.tags[item.worker] = item.tags
            if item.mode is not None:
                curve = item.mode == "curve"
                if self.curve is not None:
                    self.curve[item.worker] = curve
            else:  # as the old one's
                curve = self.curve[item.worker] if self.curve is not None else True
            self.data.open(item.worker, item.endpoint, self._secure(item.worker, curve))
            self.endpoints[item.worker] = item.endpoint
            self.seq[item.worker] = 0
            self.out.discard(item.worker)
        elif isinstance(item, NoticeItem):
            self._notify(item.kind, **item.fields)
        elif isinstance(item, FlushItem):
            deadline = time.monotonic() + self.tuning.close_timeout_s
            while self.pending and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.001)
            item.done.set()

    def _tagged(self, worker: int, bufs) -> tuple[bytes, list[int]]:
        """A new message's nonce and the tag of each of its parts (``bufs``) to ``worker``."""
        tags = self.tags[worker]
        nonce = tags.nonce()
        return nonce, [tags.tag(nonce, i, b) for i, b in enumerate(bufs, 1)]

    def _header(self, kind: F.Kind, field: F.Field, iteration: int, worker: int, runs, nonce: bytes) -> bytes:
        h = F.Header(
            kind,
            field,
            self.job_id,
            self.epoch,
            self.rank,
            self.world,
            self.layout_hash,
            iteration,
            self.seq[worker],
            tuple(runs),
            nonce,
        )
        self.seq[worker] += 1
        return h.pack(self.tags[worker])

    @staticmethod
    def split_runs(runs, max_elems: int) -> list[tuple[int, int, int]]:
        """``(src, dst, n)`` runs cut into consecutive pieces of at most ``max_elems``
        elements (a payload frame is never larger than ``F.MAX_PART_BYTES``)."""
        out = []
        for src, dst, n in runs:
            for off in range(0, max(n, 1), max_elems):  # an empty run stays one (empty) run
                out.append((src + off, dst + off, min(max_elems, n - off)))
        return out

    def _send_payload(self, iteration: int, kind, field, data: np.ndarray, runs_per_worker, ring_slot) -> None:
        trackers = []
        most = max(1, self.tuning.max_runs)  # runs a worker takes in one message (a row-wise split has many)
        for w, runs in enumerate(runs_per_worker):
            if not runs or w in self.out:
                continue
            runs = self.split_runs(runs, F.MAX_PART_BYTES // data.itemsize)
            for at in range(0, len(runs), most):
                part = runs[at : at + most]
                views = [data[src : src + n] for src, _, n in part]
                nonce, tags = self._tagged(w, views)
                table = [(dst, n, t) for (_, dst, n), t in zip(part, tags, strict=True)]
                frames: list[bytes | memoryview] = [self._header(kind, field, iteration, w, table, nonce)]
                frames += [v.data for v in views]
                tracker = self._send(w, frames, True, iteration)
                if tracker is not None:
                    trackers.append(tracker)
                self.bytes_out += sum(n for _, _, n in part) * 4
                self.messages_out += 1
        if ring_slot is not None:
            self.pending.append((ring_slot[0], ring_slot[1], trackers))

    def _send_commit(self, item: CommitItem) -> None:
        if item.bodies is None:
            raise RuntimeError(f"the commit of iteration {item.iteration} was never built")
        for w, body in enumerate(item.bodies):
            if w in self.out:
                continue
            nonce, (tag,) = self._tagged(w, [body])
            hdr = self._header(F.Kind.COMMIT, F.Field.GRAD, item.iteration, w, [(0, len(body), tag)], nonce)
            self._send(w, [hdr, body], False, item.iteration)
            self.messages_out += 1

    def _send_extra(self, item: ExtraItem) -> None:
        w = item.worker
        if w in self.out:
            return
        nonce, tags = self._tagged(w, [v for _, v in item.chunks])
        table = [(k, len(v), t) for (k, v), t in zip(item.chunks, tags, strict=True)]
        frames = [self._header(F.Kind.EXTRA, F.Field.GRAD, item.iteration, w, table, nonce)]
        self._send(w, frames + [memoryview(v) for _, v in item.chunks], True, item.iteration)  # zero-copy
        self.bytes_out += sum(len(v) for _, v in item.chunks)
        self.messages_out += 1

    def _send(self, w: int, frames: list, track: bool, iteration: int):
        """Send one message to worker ``w``; returns its zmq tracker when ``track`` (else None)."""
        return self.data.send(w, frames, track)

    def _notify(self, kind: str, **fields) -> None:
        try:
            self.dealer.send(M.encode(kind, **fields), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is away; heartbeats are retried, notices are best effort
            pass

    def _reap(self) -> None:
        self.data.poll()
        while self.pending and all(t.done for t in self.pending[0][2]):
            off, n, _ = self.pending.pop(0)
            self.ring.release(off, n)

    def _listen(self) -> None:
        while True:
            try:
                raw = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = M.decode(raw)
            except M.MessageError as exc:
                logger.warning("ignored malformed message from the coordinator: %s", exc)
                continue
            self.last_heard = time.monotonic()
            if self.lost:
                self.lost = False
                self.events.on_back()
            if msg["t"] == "progress" and msg["epoch"] == self.epoch:
                self.events.on_progress(msg["applied"])
            elif msg["t"] == "resync" and msg["epoch"] == self.epoch:
                self.events.on_resync()
            elif msg["t"] == "replica_out" and msg["epoch"] == self.epoch and 0 <= msg["worker"] < len(self.endpoints):
                logger.warning("shadow worker %d is out of service; its shard continues on a replica", msg["worker"])
                self.out.add(msg["worker"])
                self.data.drop(msg["worker"])  # drop what is queued for it: frees the ring
            elif msg["t"] == "replica_in" and msg["epoch"] == self.epoch and 0 <= msg["worker"] < len(self.endpoints):
                self.events.on_join(msg)
            elif msg["t"] == "audit" and msg["epoch"] == self.epoch:
                self.events.on_audit(msg)
            elif msg["t"] == "degraded" and msg["epoch"] == self.epoch:
                self.events.on_degraded(msg["reason"])
            elif msg["t"] == "error":  # never raised into training: the session degrades and counts it
                self.events.on_error(ShadowError(f"shadow coordinator: {msg['message']}"))


#: makes an attachment's sender, called as :class:`Sender` is (a subclass, or a function)
SenderFactory = Callable[..., Sender]

#: the sender factory of the sessions built in this context when none is passed to them
#: (``trainer_hooks.testing`` sets a fault-injecting one, and resets it)
SENDER_FACTORY: contextvars.ContextVar[SenderFactory] = contextvars.ContextVar("shadow_sender_factory", default=Sender)
