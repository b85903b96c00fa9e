"""The worker's data plane: the session's checks (stale, iteration window, sequence, one
commit per rank) around the transport's :class:`FrameReceiver` (header, epoch, layout,
bounds, checksums), payloads received straight into their slots, commits recorded,
PREPARED reported. Imports no torch."""

from __future__ import annotations

import bisect
import hmac
import logging
from typing import TYPE_CHECKING

import zmq

from shadow.transport import SocketFactory, data_limit
from shadow.transport.receive import FrameReceiver, FrameSource, ZmqFrames
from shadow.wire import frames as F
from shadow.wire import tags
from shadow.wire.commit import Prepared
from shadow.worker.address import Binding
from shadow.worker.commit import agree, decode_commit
from shadow.worker.outbox import Outbox
from shadow.worker.state import WorkerState, go_stale

if TYPE_CHECKING:
    from shadow.transport.ucx import UcxDataSocket
    from shadow.worker.assignment import Assignment

logger = logging.getLogger(__name__)


class DataPath:
    """The data channel (a ZeroMQ PULL socket, or a UCX listener with ``transport="ucx"``)
    and the assignment's policy (stale, iteration window, sequence numbers, commits) around
    :class:`shadow.transport.receive.FrameReceiver`, which reads and checks each message:
    payloads go straight into their inbox slots, and each iteration that becomes complete is
    reported ``prepared`` through ``outbox``.

    Reads and writes ``state.assignment``; counts refusals in ``state.rejected``. Call
    order: :meth:`open` (binds; the endpoint to advertise), :meth:`pump` every turn of the
    loop, :meth:`on_message` when :attr:`pollable` is readable or :meth:`pump` says messages
    wait, :meth:`reopen` on a reset, :meth:`close`. The receiver (``rx``) and its counters
    outlive a reopen. Owned by the worker's main thread."""

    def __init__(
        self,
        state: WorkerState,
        outbox: Outbox,
        sockets: SocketFactory,
        binding: Binding,
        curve: bool = True,
        transport: str = "zmq",
    ) -> None:
        """``curve``: the data socket is a CURVE server (when ``sockets`` has a guard); else it
        takes connections in clear and every frame is checked against its rank's MAC.
        ``transport``: ``zmq`` or ``ucx`` (in clear: never with ``curve``)."""
        self.state, self.outbox, self.sockets, self.binding = state, outbox, sockets, binding
        self.curve, self.transport = curve, transport
        if transport == "ucx" and curve and sockets.guard is not None:
            raise ValueError("a UCX data channel carries no CURVE: use the mac data mode")
        self.sock: zmq.Socket | None = None
        self.ucx: UcxDataSocket | None = None  # the UCX data channel (transport="ucx")
        self.source: FrameSource | None = None  # what the receiver reads
        self.endpoint = ""
        self.rx: FrameReceiver | None = None  # reads the data channel; its counters outlive a reset's fresh one

    def open(self) -> str:
        """Bind a fresh data channel; returns the endpoint trainers stream to."""
        tuning = self.state.tuning
        source: FrameSource
        if self.transport == "ucx":
            from shadow.transport import ucx

            channel = ucx.UcxDataSocket(
                data_limit(tuning),
                tuning.max_runs + 1,
                tuning.data_rcvhwm_messages,
                self.state.rejected,
                door=self.door if self.sockets.guard is not None else None,
            )
            self.ucx, source = channel, channel
            self.endpoint = ucx.endpoint(self.binding.host, channel.port)
        else:
            # bounded: a sender stops after MAX_LAG iterations past the cut, so a few iterations' messages
            # with keys (a guard), in clear only through the door; without, in clear (a loopback cluster)
            door = self.door if self.sockets.guard is not None else None
            self.sock = self.sockets.pull(
                data_limit(tuning), tuning.data_rcvhwm_messages, curve=self.curve, door=door, door_cap=self.door_cap
            )
            self.endpoint = self.binding.bind(self.sock)
            source = ZmqFrames(self.sock)
        self.source = source
        if self.rx is None:
            self.rx = FrameReceiver(source, tuning)
        else:
            self.rx.src = source
        return self.endpoint

    def door(self, user: bytes, password: bytes) -> str:
        """Admit a connection to the data socket in clear (on the guard's thread): a rank of
        the current configuration proving its data key (:func:`shadow.wire.tags.door`); else
        the reason it is refused."""
        a = self.state.assignment
        if a is None or not a.context.keys:
            return "unconfigured"
        try:
            text = user.decode("ascii")
            rank = int(text.removeprefix("rank "))
        except (UnicodeDecodeError, ValueError):
            return "user"
        tags_ = a.context.tags_of(rank)
        if user != tags.rank_user(rank) or tags_ is None:
            return "user"
        return "" if hmac.compare_digest(getattr(tags_, "door", b""), password) else "key"

    def door_cap(self) -> int:
        """The most connections the data socket in clear holds: two per rank of the job (a
        reconnect overlaps the connection it replaces) and 64 more."""
        a = self.state.assignment
        return 2 * (a.world if a is not None else 0) + 64

    @property
    def pollable(self):
        """What the worker's poller waits on: the data socket, or UCX's event descriptor."""
        return self.ucx.fd if self.ucx is not None else self.sock

    def pump(self) -> bool:
        """Move the data channel along without blocking (UCX: progress; ZeroMQ does its own);
        True when whole messages already wait to be read."""
        return self.ucx.pump() if self.ucx is not None else False

    def reopen(self) -> str:
        """Drop every queued frame: close the channel and bind a fresh one (a reset). UCX
        keeps its worker and listens on a new port (a UCX worker is never destroyed)."""
        if self.ucx is not None:
            from shadow.transport import ucx

            self.endpoint = ucx.endpoint(self.binding.host, self.ucx.reset())
            return self.endpoint
        self.close()
        return self.open()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.ucx is not None:
            self.ucx.close()
            self.ucx = None

    @property
    def frames_in(self) -> int:
        """Data messages whose header was read."""
        return self.rx.frames_in if self.rx is not None else 0

    @property
    def bytes_in(self) -> int:
        """Payload bytes received on the data socket."""
        return self.rx.bytes_in if self.rx is not None else 0

    def on_message(self, source: FrameSource) -> None:
        """One message off the data channel (``zmq.Again`` if none): taken into the
        assignment, or refused and counted (some refusals make the assignment stale)."""
        rx = self.rx
        assert rx is not None  # opened with the data socket that called
        try:
            self.take(rx)
        except zmq.Again:
            raise
        except F.FrameError as exc:
            self.state.rejected[exc.reason] += 1
            rx.discard_rest()
            if exc.reason == "stale":
                logger.debug("dropped frame: %s", exc)
            else:
                logger.warning("rejected frame: %s", exc)
            # a duplicate (sequence already seen) is dropped and counted, and so is a message
            # whose header or frames do not check out, a payload frame too many or too few
            # included (a copy raced in by someone who sees the stream in clear: nothing of it
            # was taken and it consumed no sequence number; if it was a real one, the next
            # message shows the gap); a gap, a checksum that fails where nothing is keyed, or
            # what the replica cannot take leaves it unusable until a resync
            if exc.reason in (
                "gap",
                "double_commit",
                "bad_checksum",
                "overflow",
                "disagree",
                "kept_mismatch",
            ):
                go_stale(self.state, self.outbox, str(exc))
        except zmq.ZMQError:
            raise
        except Exception as exc:  # a bug meeting an input: count it, keep going, trust this replica no more
            self.state.rejected["data_error_" + type(exc).__name__] += 1
            logger.exception("a data frame could not be handled")
            rx.discard_rest()
            go_stale(self.state, self.outbox, f"a data frame could not be handled ({type(exc).__name__}: {exc})")

    def take(self, rx: FrameReceiver) -> None:
        """Read one message with ``rx`` and take it into the assignment; a refusal raises
        :class:`~shadow.wire.frames.FrameError` (the rest of the message is left unread)."""
        s = self.state.assignment
        h = rx.header(None if s is None else s.context)
        assert s is not None  # rx.header(None) refuses every frame
        if s.stale:
            raise F.FrameError("stale", "worker is stale; frames ignored until resync")
        if h.iteration <= s.applied or h.iteration < s.base:
            raise F.FrameError("old_iteration", f"iteration {h.iteration} is not after applied {s.applied}")
        # the iterations a trainer may send: its slots bound how far ahead of the applied one
        horizon = (s.applied if s.applied >= 0 else s.base - 1) + s.inbox.nslots
        if h.iteration > horizon:
            raise F.FrameError(
                "out_of_window",
                f"iteration {h.iteration} is beyond {horizon} (applied {s.applied}, {s.inbox.nslots} slots)",
            )
        rx.check_runs(h, s.context)  # before the sequence check: a malformed header consumes no sequence number
        # a duplicate (a replay) is dropped before its parts are read; the sequence number is
        # taken only once every part has checked out (each _take_* does), so a message forged
        # or damaged on the way consumes none
        s.inbox.check_seq(h.rank, h.seq, self.state.tuning.seq_window_messages)
        if h.kind == F.Kind.COMMIT:
            self._take_commit(s, rx, h)
        elif h.kind == F.Kind.EXTRA:
            self._take_extra(s, rx, h)
        else:
            self._take_payload(s, rx, h)
        s.seen = max(s.seen, h.iteration)
        self._report_prepared(s)

    def _take_payload(self, s: Assignment, rx: FrameReceiver, h: F.Header) -> None:
        kind = F.Kind.STATE if h.kind == F.Kind.STATE else F.Kind.GRAD
        total, parts = rx.runs_kept(h, s.state.start)  # every part checked, where it lies
        s.inbox.advance(h.rank)
        slot = s.inbox.slot(h.iteration, kind)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("after_commit", f"rank {h.rank} sent data for iteration {h.iteration} after its commit")
        if kind == F.Kind.STATE:  # into the state array
            if s.kept:
                if slot.kept:
                    raise F.FrameError(
                        "kept_mismatch", f"rank {h.rank} sends state other ranks proved kept (iteration {h.iteration})"
                    )
                s.unkeep()  # a rank sends its state after all: into arrays of this epoch's own
            target = s.state.array(h.field)
            for off, view in parts:
                target[off : off + len(view)] = view
            slot.field_elems[int(h.field)] = slot.field_elems.get(int(h.field), 0) + total
        else:  # a gradient: keep the frames, the kernel reads them where they lie
            slot.parts.extend(parts)
        slot.received[h.rank] += total

    def _take_extra(self, s: Assignment, rx: FrameReceiver, h: F.Header) -> None:
        """Chunks of model state outside the optimizer (``trainer_hooks.capture.extras``), kept
        zero-copy by key; the worker's set takes them when their iteration is applied."""
        chunks = rx.chunks(h)
        s.inbox.advance(h.rank)
        slot = s.inbox.slot(h.iteration, F.Kind.STATE if h.iteration == s.base else F.Kind.GRAD)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("after_commit", f"rank {h.rank} sent data for iteration {h.iteration} after its commit")
        slot.extras.update(chunks)
        slot.extra_count[h.rank] += len(chunks)

    def _take_commit(self, s: Assignment, rx: FrameReceiver, h: F.Header) -> None:
        body = rx.body(h)
        s.inbox.advance(h.rank)
        replay, blob = decode_commit(body, h, len(s.layout.params), s.layout.num_groups)
        kind = F.Kind.STATE if replay["bootstrap"] else F.Kind.GRAD
        if replay["bootstrap"] != (h.iteration == s.base):
            raise F.FrameError(
                "bad_commit", f"bootstrap flag {replay['bootstrap']} at iteration {h.iteration} (base {s.base})"
            )
        slot = s.inbox.slot(h.iteration, kind)
        if slot.commits[h.rank] is not None:
            raise F.FrameError("double_commit", f"second commit from rank {h.rank} for iteration {h.iteration}")
        for other in slot.commits:
            if other is not None and not agree(other, replay, len(s.layout.params)):
                raise F.FrameError(
                    "disagree", f"rank {h.rank} commits different hyperparameters for iteration {h.iteration}"
                )
        if "kept" in replay:
            _take_kept(s, slot, h.rank, replay["kept"])
        slot.commits[h.rank] = replay
        if blob is not None:
            slot.blobs[h.rank] = blob

    def _report_prepared(self, s: Assignment) -> None:
        k = s.prepared + 1
        while True:
            slot = s.inbox.slots.get(k)
            if slot is None or not s.inbox.complete(slot):
                break
            k += 1
        if k - 1 > s.prepared:
            s.prepared = k - 1
            c = s.inbox.slots[s.prepared].commits[0]
            ready = Prepared(s.epoch, s.prepared, c.get("tokens"))
            self.outbox.to_coord(ready.kind, **ready.fields())


def _take_kept(s: Assignment, slot, rank: int, kept: dict) -> None:
    """A rank's proof that the state it would have sent for the base is what this worker
    kept (``configure``'s ``keep``): per field, runs ``(dst, n, xxh3-64)`` of the range,
    each checked against the kept array and credited as if its STATE frame had come. A
    digest that differs, or a run outside the range or over one already proved, refuses
    the commit (``kept_mismatch``: the worker goes stale and a resync sends the state
    whole); a proof to a worker that keeps nothing too."""
    if not s.kept:
        raise F.FrameError(
            "kept_mismatch", f"rank {rank} proves a kept state, and this worker took the state from STATE frames"
        )
    for field, runs in kept.items():
        arr = s.state.array(F.Field(field))
        done = slot.kept.setdefault(field, [])
        for dst, n, digest in runs:
            lo = dst - s.state.start
            if n <= 0 or lo < 0 or lo + n > len(arr):
                raise F.FrameError(
                    "kept_mismatch", f"rank {rank} proves run [{dst}, {dst + n}) outside the range of this worker"
                )
            at = bisect.bisect_left(done, (lo, lo + n))
            if (at > 0 and done[at - 1][1] > lo) or (at < len(done) and done[at][0] < lo + n):
                raise F.FrameError("kept_mismatch", f"rank {rank} proves run [{dst}, {dst + n}) twice")
            if F.checksum(arr[lo : lo + n]) != digest:
                raise F.FrameError(
                    "kept_mismatch",
                    f"rank {rank}'s {F.Field(field).name.lower()} in [{dst}, {dst + n}) differs from the state this "
                    f"worker kept for iteration {s.base}: the trainer changed it after its restore; the state is sent "
                    "whole instead (resync)",
                )
            done.insert(at, (lo, lo + n))
            slot.field_elems[field] = slot.field_elems.get(field, 0) + n
            slot.received[rank] += n
