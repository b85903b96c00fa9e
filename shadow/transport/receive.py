"""The receiving end of the data path: one message at a time off a worker's data socket.

A data message is a header frame (``shadow.wire.frames``) followed by one payload part per
run. :class:`FrameReceiver` owns the socket reads and every check that needs nothing but
the message and the context it is received in (:class:`Context`): the header's tag
and bounds, job/epoch/layout/world, each run inside the receiver's range and no larger than
a sender ever makes, each part's size and tag. Tags are checksums on a wire without keys
and MACs under the sending rank's key on a keyed one (``shadow.wire.tags``); on a keyed
wire a header that fails its MAC is dropped before any other field is believed, and a
message's parts are all checked (:meth:`FrameReceiver.parts`) before anything in it is
taken. It does not know iterations, sequence numbers or commits: the worker applies that
policy between :meth:`FrameReceiver.header` and the payload calls. The transport benchmark
drives this same class, so what it measures is the worker's receive path.

Every failed check raises :class:`shadow.wire.frames.FrameError`; the caller then calls
:meth:`FrameReceiver.discard_rest` so the next message starts on a frame boundary.
Frames come from a :class:`FrameSource`: a ZeroMQ PULL socket (:class:`ZmqFrames`) or a
UCX data channel (``shadow.transport.ucx.UcxDataSocket``). Owned by the thread that owns
the source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zmq

from shadow.config.tuning import DEFAULT, Tuning
from shadow.wire import frames as F
from shadow.wire.tags import PLAIN, Tags


@dataclass(frozen=True)
class Context:
    """What a data message must match to be taken: the job and epoch being served, the
    layout hash and world size of that job, and the flat element range ``[lo, hi)`` this
    receiver holds (GRAD and STATE runs must lie inside it); ``fields``: the optimizer
    fields a STATE message may carry; ``keys``: each rank's :class:`~shadow.wire.tags.Tags`
    on a keyed wire (empty: every rank's are :data:`~shadow.wire.tags.PLAIN`)."""

    job: int
    epoch: int
    layout: int
    world: int
    lo: int
    hi: int
    fields: frozenset[F.Field] = frozenset()
    keys: tuple[Tags, ...] = ()

    def tags_of(self, rank: int) -> Tags | None:
        """What rank ``rank``'s frames are tagged with (None: no key for it)."""
        if not self.keys:
            return PLAIN
        return self.keys[rank] if 0 <= rank < len(self.keys) else None


class FrameSource(Protocol):
    """Where a receiver reads messages, frame by frame."""

    def recv_first(self) -> bytes:
        """The next message's first frame (non-blocking; ``zmq.Again`` if none)."""
        ...

    def more(self) -> bool:
        """Whether the current message has another frame."""
        ...

    def recv_next(self) -> memoryview:
        """The current message's next frame, zero-copy."""
        ...


def _vouch(src: FrameSource) -> None:
    """Tell ``src`` that the current message's header passed its checks (its tag or MAC,
    job, epoch, layout), where ``src`` keeps track of its peers (``vouch()``)."""
    vouch = getattr(src, "vouch", None)
    if vouch is not None:
        vouch()


class ZmqFrames:
    """A ZeroMQ PULL socket as a :class:`FrameSource`."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def recv_first(self) -> bytes:
        return self.sock.recv(zmq.NOBLOCK)

    def more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def recv_next(self) -> memoryview:
        return self.sock.recv(copy=False).buffer


class FrameReceiver:
    """Reads and checks data messages from ``src`` (a :class:`FrameSource`; a ZeroMQ socket
    is wrapped in :class:`ZmqFrames`).

    Counters: ``frames_in`` (messages whose header was read) and ``bytes_in`` (payload
    bytes received)."""

    def __init__(self, src: FrameSource | zmq.Socket, tuning: Tuning = DEFAULT) -> None:
        self.src: FrameSource = ZmqFrames(src) if isinstance(src, zmq.Socket) else src
        self.max_runs, self.max_commit_bytes = tuning.max_runs, tuning.max_commit_bytes
        self.frames_in = 0
        self.bytes_in = 0
        self._tags: Tags = PLAIN  # the current message's sender's

    # -- the header --------------------------------------------------------------------------
    def header(self, ctx: Context | None) -> F.Header:
        """Read the next message's header frame (non-blocking; ``zmq.Again`` if none) and
        check it against ``ctx`` (None: nothing is being served yet)."""
        raw = self.src.recv_first()
        self.frames_in += 1
        if ctx is None:
            raise F.FrameError("not_configured", "frame arrived before this worker was configured")
        h = F.unpack_header(raw, self.max_runs, ctx.tags_of)
        tags = ctx.tags_of(h.rank)
        assert tags is not None  # unpack_header refused a rank without tags
        self._tags = tags
        if h.epoch != ctx.epoch or h.job != ctx.job:
            raise F.FrameError(
                "wrong_epoch", f"frame for job {h.job:#x} epoch {h.epoch}, serving {ctx.job:#x} epoch {ctx.epoch}"
            )
        if h.layout != ctx.layout:
            raise F.FrameError("wrong_layout", f"layout {h.layout:#x} is not {ctx.layout:#x}")
        if h.world != ctx.world:
            raise F.FrameError("bad_rank", f"world {h.world} is not {ctx.world}")
        _vouch(self.src)
        return h

    def check_runs(self, h: F.Header, ctx: Context) -> None:
        """The run table against ``ctx``: runs inside the range, no part larger than a
        sender ever makes, one commit body of bounded size. Call before the sequence
        check: a malformed header consumes no sequence number."""
        cap = self.max_commit_bytes
        if h.kind == F.Kind.COMMIT:
            if len(h.runs) != 1:
                raise F.FrameError("bad_commit", f"commit has {len(h.runs)} runs, expected 1")
            if h.runs[0][1] > cap:
                raise F.FrameError(
                    "bad_commit", f"commit of {h.runs[0][1]} bytes exceeds the limit of {cap} (SHADOW_MAX_COMMIT_BYTES)"
                )
        elif h.kind == F.Kind.EXTRA:
            if h.field != F.Field.GRAD:
                raise F.FrameError("bad_kind", f"EXTRA frame for field {h.field.name}")
            for _, nbytes, _ in h.runs:
                if not 0 < nbytes <= cap:
                    raise F.FrameError("bad_extra", f"a chunk of {nbytes} bytes (limit {cap}, SHADOW_MAX_COMMIT_BYTES)")
        else:
            most = F.MAX_PART_BYTES // 4
            for dst, nelem, _ in h.runs:
                if nelem == 0 or dst < ctx.lo or dst + nelem > ctx.hi:
                    raise F.FrameError("out_of_range", f"run [{dst}, {dst + nelem}) is outside [{ctx.lo}, {ctx.hi})")
                if nelem > most:
                    raise F.FrameError("too_large", f"a run of {nelem} elements; parts carry at most {most}")
            if h.kind == F.Kind.STATE:
                if h.field == F.Field.GRAD or h.field not in ctx.fields:
                    raise F.FrameError("bad_kind", f"STATE frame for field {h.field.name}")
            elif h.field != F.Field.GRAD:
                raise F.FrameError("bad_kind", f"GRAD frame for field {h.field.name}")

    # -- the payload -----------------------------------------------------------------------
    def parts(self, h: F.Header) -> list[memoryview]:
        """Every payload part of the message whose header :meth:`header` just read, zero-copy
        (the frames' own buffers), each checked against its size and tag; the message must
        end there. Nothing is taken before every part checks out."""
        out = []
        for i, (dst, n, tag) in enumerate(h.runs, 1):
            nbytes = n * 4 if h.kind in (F.Kind.GRAD, F.Kind.STATE) else n
            buf = self._part(nbytes)
            if not self._tags.check(h.nonce, i, buf, tag):
                what = f"part {i} (at {dst}, {nbytes} bytes) of rank {h.rank} seq {h.seq} iteration {h.iteration}"
                if self._tags.keyed:
                    raise F.FrameError("bad_mac", f"{what} fails its MAC")
                raise F.FrameError("bad_checksum", f"{what} fails its checksum")
            out.append(buf)
        self.end()
        return out

    def runs_into(self, h: F.Header, target: np.ndarray, lo: int) -> int:
        """Check every part (:meth:`parts`), then copy each run's into
        ``target[dst - lo : dst - lo + nelem]``; returns the elements copied."""
        total = 0
        for (dst, nelem, _), buf in zip(h.runs, self.parts(h), strict=True):
            target[dst - lo : dst - lo + nelem] = np.frombuffer(buf, dtype=np.float32)
            total += nelem
        return total

    def runs_kept(self, h: F.Header, lo: int) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """Check every part (:meth:`parts`) and keep it where it lies (the message frame
        itself, viewed as float32); returns ``(elements, [(dst - lo, view)])`` for a kernel
        that reads the parts there."""
        parts = self.parts(h)
        views = [(run[0] - lo, np.frombuffer(buf, dtype=np.float32)) for run, buf in zip(h.runs, parts, strict=True)]
        return sum(n for _, n, _ in h.runs), views

    def chunks(self, h: F.Header) -> list[tuple[int, memoryview]]:
        """An EXTRA message's chunks, zero-copy and checked: ``[(key, buffer)]``."""
        return [(key, buf) for (key, _, _), buf in zip(h.runs, self.parts(h), strict=True)]

    def body(self, h: F.Header) -> bytes:
        """A COMMIT message's one body, checked against its run entry."""
        if not h.runs:
            raise F.FrameError("bad_commit", "commit without body")
        return bytes(self.parts(h)[0])

    def end(self) -> None:
        """The message must end here."""
        if self.src.more():
            raise F.FrameError("extra_payload", "message has more payload frames than runs")

    def discard_rest(self) -> None:
        """Drop what is left of the current message (after a failed check)."""
        while self.src.more():
            self.src.recv_next()

    # -- parts -------------------------------------------------------------------------------
    def _more(self, why: str) -> None:
        if not self.src.more():
            raise F.FrameError("truncated_payload", why)

    def _part(self, nbytes: int) -> memoryview:
        self._more("message has fewer payload frames than runs")
        frame = self.src.recv_next()
        if len(frame) != nbytes:
            raise F.FrameError("truncated_payload", f"payload is {len(frame)} bytes, run says {nbytes}")
        self.bytes_in += nbytes
        return frame
