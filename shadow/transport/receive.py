"""The receiving end of the data path: one message at a time off a worker's data socket.

A data message is a header frame (``shadow.wire.frames``) followed by one payload part per
run. :class:`FrameReceiver` owns the socket reads and every check that needs nothing but
the message and the context it is received in (:class:`Context`): the header's checksum
and bounds, job/epoch/layout/world, each run inside the receiver's range and no larger than
a sender ever makes, each part's size and xxh3. It does not know iterations, sequence
numbers or commits: the worker applies that policy between :meth:`FrameReceiver.header` and
the payload calls. The transport benchmark drives this same class, so what it measures is
the worker's receive path.

Every failed check raises :class:`shadow.wire.frames.FrameError`; the caller then calls
:meth:`FrameReceiver.discard_rest` so the next message starts on a frame boundary.
Owned by the thread that owns the socket."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zmq

from shadow.tuning import DEFAULT, Tuning
from shadow.wire import frames as F


@dataclass(frozen=True)
class Context:
    """What a data message must match to be taken: the job and epoch being served, the
    layout hash and world size of that job, and the flat element range ``[lo, hi)`` this
    receiver holds (GRAD and STATE runs must lie inside it); ``fields``: the optimizer
    fields a STATE message may carry."""

    job: int
    epoch: int
    layout: int
    world: int
    lo: int
    hi: int
    fields: frozenset[F.Field] = frozenset()


class FrameReceiver:
    """Reads and checks data messages from ``sock`` (a PULL socket).

    Counters: ``frames_in`` (messages whose header was read) and ``bytes_in`` (payload
    bytes received)."""

    def __init__(self, sock: zmq.Socket, tuning: Tuning = DEFAULT) -> None:
        self.sock = sock
        self.max_runs, self.max_commit_bytes = tuning.max_runs, tuning.max_commit_bytes
        self.frames_in = 0
        self.bytes_in = 0

    # -- the header --------------------------------------------------------------------------
    def header(self, ctx: Context | None) -> F.Header:
        """Read the next message's header frame (non-blocking; ``zmq.Again`` if none) and
        check it against ``ctx`` (None: nothing is being served yet)."""
        raw = self.sock.recv(zmq.NOBLOCK)
        self.frames_in += 1
        h = F.unpack_header(raw, self.max_runs)
        if ctx is None:
            raise F.FrameError("not_configured", "frame arrived before this worker was configured")
        if h.epoch != ctx.epoch or h.job != ctx.job:
            raise F.FrameError(
                "wrong_epoch", f"frame for job {h.job:#x} epoch {h.epoch}, serving {ctx.job:#x} epoch {ctx.epoch}"
            )
        if h.layout != ctx.layout:
            raise F.FrameError("wrong_layout", f"layout {h.layout:#x} is not {ctx.layout:#x}")
        if h.world != ctx.world:
            raise F.FrameError("bad_rank", f"world {h.world} is not {ctx.world}")
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
    def runs_into(self, h: F.Header, target: np.ndarray, lo: int) -> int:
        """Receive each run's part straight into ``target[dst - lo : dst - lo + nelem]``
        and check its xxh3 there; returns the elements received. A failed part leaves
        whatever it wrote in ``target``: the caller treats that range as lost."""
        total = 0
        for dst, nelem, csum in h.runs:
            view = target[dst - lo : dst - lo + nelem]
            self._more("message has fewer payload frames than runs")
            got = self.sock.recv_into(view.data)
            if got != nelem * 4:
                raise F.FrameError("truncated_payload", f"payload is {got} bytes, run says {nelem * 4}")
            self.bytes_in += got
            self._check(view, csum, f"payload at flat {dst} (+{nelem}) from rank {h.rank} iteration {h.iteration}")
            total += nelem
        self.end()
        return total

    def runs_kept(self, h: F.Header, lo: int) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """Receive each run's part zero-copy (the message frame itself, viewed as float32)
        and check its xxh3 there; returns ``(elements, [(dst - lo, view)])`` for a kernel
        that reads the parts where they lie."""
        total, parts = 0, []
        for dst, nelem, csum in h.runs:
            frame = self._part(nelem * 4)
            view = np.frombuffer(frame.buffer, dtype=np.float32)
            self._check(view, csum, f"payload at flat {dst} (+{nelem}) from rank {h.rank} iteration {h.iteration}")
            parts.append((dst - lo, view))
            total += nelem
        self.end()
        return total, parts

    def chunks(self, h: F.Header) -> list[tuple[int, memoryview]]:
        """An EXTRA message's chunks, zero-copy and checked: ``[(key, buffer)]``."""
        out = []
        for key, nbytes, csum in h.runs:
            frame = self._part(nbytes)
            self._check(frame.buffer, csum, f"extras chunk {key:#x} from rank {h.rank} iteration {h.iteration}")
            out.append((key, frame.buffer))
        self.end()
        return out

    def body(self, h: F.Header) -> bytes:
        """A COMMIT message's one body, checked against its run entry."""
        _, nbytes, csum = h.runs[0]
        self._more("commit without body")
        body = self.sock.recv()
        if len(body) != nbytes or F.checksum(body) != csum:
            raise F.FrameError("bad_checksum", f"commit body of rank {h.rank} iteration {h.iteration}")
        if self.sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "commit has more than one body frame")
        return body

    def end(self) -> None:
        """The message must end here."""
        if self.sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("extra_payload", "message has more payload frames than runs")

    def discard_rest(self) -> None:
        """Drop what is left of the current message (after a failed check)."""
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv()

    # -- parts -------------------------------------------------------------------------------
    def _more(self, why: str) -> None:
        if not self.sock.getsockopt(zmq.RCVMORE):
            raise F.FrameError("truncated_payload", why)

    def _part(self, nbytes: int) -> zmq.Frame:
        self._more("message has fewer payload frames than runs")
        frame = self.sock.recv(copy=False)
        if len(frame) != nbytes:
            raise F.FrameError("truncated_payload", f"payload is {len(frame)} bytes, run says {nbytes}")
        self.bytes_in += nbytes
        return frame

    @staticmethod
    def _check(buf, csum: int, what: str) -> None:
        if F.checksum(buf) != csum:
            raise F.FrameError("bad_checksum", what)
