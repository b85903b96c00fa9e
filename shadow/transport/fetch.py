"""One reader of a worker's ``fetch_reply``, for a restore (straight into place) and for a
replica's peer copy (into its own range) alike.

A reply is a stream of zmq messages on one connection: a head (msgpack), then, for each
array the head names, its bytes of the range in chunks of ``chunk`` bytes, each with its
xxh3 in ``sums``; then the extras chunks (the model state outside the optimizer). In mac
mode the head comes inside a ``fetch_reply_mac`` under a MAC of the fetch's ticket, and
``sums`` hold GMAC tags (:mod:`shadow.wire.tags`). Each part
is its own message, so a reader takes chunks as they arrive, while the rest are still on
the wire, and holds at most its socket's ``RCVHWM`` chunks in zmq's buffers rather than the
whole shard (a multipart message is delivered only once complete). A reader reading the
parts of one multipart message (an older worker's framing) reads the same bytes.

:class:`ReplyReader` takes one part per :meth:`ReplyReader.feed`: a client can drive several
replies from one poll loop, and a worker's event loop can feed a peer copy part by part. It
checks the head against what was asked for, every chunk's size and checksum as it lands,
and never trusts a length or an index from the head without checking it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import zmq

from shadow.config.tuning import DEFAULT
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.wire.frames import Field, checksum


class FetchError(ValueError):
    """A reply that cannot be used. ``code``: ``moved_on`` or ``busy`` (the worker's own
    error code: worth asking again), ``damaged`` (a chunk fails its checksum: damaged in
    transit, or applied over while sent: worth asking again), ``error`` (another error
    reply), ``mismatch`` (another epoch, iteration, range or arrays than asked for),
    ``malformed`` (short, missing or extra parts, indices out of range)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retry(self) -> bool:
        return self.code in ("moved_on", "busy", "damaged")


class SocketParts:
    """The parts of a reply still in a socket: each chunk received straight into place.
    ``flags=zmq.NOBLOCK``: a part not there yet raises ``zmq.Again`` and nothing is read."""

    def __init__(self, sock: zmq.Socket, flags: int = 0) -> None:
        self.sock, self.flags = sock, flags

    def head(self) -> bytes:
        return self.sock.recv(self.flags)

    def more(self) -> bool:
        """Whether the message just read has further parts (trailing parts of a multipart
        reply; separate trailing messages are never read: the socket closes after a reply)."""
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def into(self, target: memoryview) -> int:
        return self.sock.recv_into(target, flags=self.flags)

    def take(self) -> bytes:
        return self.sock.recv(self.flags)


class ListParts:
    """The parts of a reply already received (``recv_multipart``)."""

    def __init__(self, parts: Sequence[bytes]) -> None:
        self.parts, self.i = parts, 0

    def head(self) -> bytes:
        return self.take()

    def more(self) -> bool:
        return self.i < len(self.parts)

    def into(self, target: memoryview) -> int:
        raw = self.take()
        if len(raw) == len(target):  # a wrong size is refused by the caller; nothing is written
            target[:] = raw
        return len(raw)

    def take(self) -> bytes:
        if self.i >= len(self.parts):
            raise FetchError("malformed", "the reply ended early: too few parts")
        raw = self.parts[self.i]
        self.i += 1
        return raw


class Scatter(Protocol):
    """Where a field's bytes go when they land in tensors of their own rather than one flat
    array (a live model's parameters): each chunk is received into :meth:`staging`, checked
    there, then handed to :meth:`put`. Called from the fetch threads (one staging buffer
    per thread)."""

    def staging(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` for one chunk, this thread's own."""
        ...

    def put(self, byte_offset: int, data: memoryview) -> None:
        """``data`` holds the field's bytes from ``byte_offset`` (of its whole flat form)."""
        ...


class ReplyReader:
    """One ``fetch_reply``, read part by part (:meth:`feed`) into ``target(field)`` (a byte
    view of the range ``[start, stop)`` of that array, or a :class:`Scatter`); the head is
    checked against what was asked for (``epoch`` None: any), each chunk against its size
    and checksum as it lands (a scattered chunk before it is put in place). ``key``: the
    key of the ticket the fetch carried (mac mode): the reply must then come under its MAC.

    ``ranges``: the element ranges of ``[start, stop)`` the fetch asked for (a restore of
    one rank's rows: ``fetch`` with ``ranges``); only those land in ``target``, at their
    place in the range, and the reply must name the same ranges.

    After the last part: ``head`` (the decoded head), ``extras`` (key -> bytes), ``done``.
    ``received``: the array bytes in place so far; ``total``: all of them (0 before the head).
    """

    def __init__(
        self,
        *,
        epoch: int | None,
        iteration: int,
        start: int,
        stop: int,
        fields: list[int],
        who: str,
        target: Callable[[Field], memoryview | Scatter],
        commit_bytes: int = DEFAULT.max_commit_bytes,
        key: bytes | None = None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.epoch, self.iteration, self.start, self.stop, self.fields = epoch, iteration, start, stop, fields
        # the element ranges of [start, stop) asked for (None: all of it), as the reply must echo them
        self.ranges = None if ranges is None else [[int(a), int(b)] for a, b in ranges]
        self.who, self.target, self.commit_bytes, self.key = who, target, commit_bytes, key
        self._mac: tags.ReplyKey | None = None  # the reply's MAC key, once its head checked out
        self.head: dict | None = None
        self.extras: dict[int, bytes] = {}
        self.received = self.total = 0
        self.done = False
        # (field, where it goes: a view, or the Scatter, its byte offset in the range, its size)
        self._chunks: list[tuple[Field, memoryview | Scatter, int, int]] = []
        self._next = 0  # the next chunk, then the next extras chunk

    def feed(self, parts) -> bool:
        """Read the next part of the reply from ``parts``; True once the reply is complete.
        Raises :class:`FetchError`; whatever ``parts`` raises before reading a part
        (``zmq.Again`` from a non-blocking socket) passes through with nothing read."""
        if self.done:
            raise RuntimeError("the reply is complete: nothing more to feed")
        if self.head is None:
            self._take_head(parts)
        elif self._next < len(self._chunks):
            self._take_chunk(parts)
        else:
            self._take_extra(parts)
        n = len(self._chunks) + len(self.head.get("extras", [])) if self.head is not None else -1
        self.done = self._next == n
        return self.done

    def finish(self, parts) -> None:
        """After the last part: nothing may follow in the same message."""
        if parts.more():
            raise FetchError("malformed", f"{self.who} sent more than its shard")

    def _decode_head(self, parts) -> dict:
        """The reply's head, checked against what was asked for."""
        who, iteration, epoch = self.who, self.iteration, self.epoch
        head = self._open_head(parts.head())
        if head["t"] == "error":
            code = head["code"] if head["code"] in ("moved_on", "busy") else "error"
            raise FetchError(code, f"{who}: {head['message']}")
        if (
            head["t"] != "fetch_reply"
            or head["iteration"] != iteration
            or (epoch is not None and head["epoch"] != epoch)
        ):
            raise FetchError(
                "mismatch",
                f"{who} answered {head['t']} for epoch {head.get('epoch')} iteration "
                f"{head.get('iteration')}, not iteration {iteration}",
            )
        if (head["start"], head["stop"]) != (self.start, self.stop):
            raise FetchError(
                "mismatch", f"{who} holds [{head['start']}, {head['stop']}), not [{self.start}, {self.stop})"
            )
        if head.get("ranges") != self.ranges:
            raise FetchError("mismatch", f"{who} sent ranges {head.get('ranges')!r:.80}, not {self.ranges!r:.80}")
        chunk = head["chunk"]
        if head["arrays"] != self.fields or chunk <= 0 or chunk % 4:
            raise FetchError(
                "mismatch", f"{who} sent arrays {head['arrays']} in chunks of {chunk}, expected {self.fields}"
            )
        return head

    def _open_head(self, raw) -> dict:
        """The head message; in mac mode the ``fetch_reply`` inside a checked
        ``fetch_reply_mac`` (an ``error`` passes as it is: it installs nothing)."""
        head = M.decode(raw, self.commit_bytes)
        if self.key is None:
            if head["t"] == "fetch_reply_mac":
                raise FetchError("mismatch", f"{self.who} answered under a MAC a fetch without a ticket")
            return head
        if head["t"] == "fetch_reply":
            raise FetchError("mismatch", f"{self.who} answered without a MAC a fetch whose ticket asks for one")
        if head["t"] != "fetch_reply_mac":
            return head
        if len(head["salt"]) != tags.SALT_SIZE:
            raise FetchError("malformed", f"{self.who} sent a reply salt of {len(head['salt'])} bytes")
        mac = tags.ReplyKey(self.key, head["salt"])
        if not mac.check(0, head["head"], head["tag"]):
            raise FetchError(
                "damaged", f"{self.who}: the reply's head fails its MAC (altered on the way, or not from the worker)"
            )
        inner = M.decode(head["head"], self.commit_bytes)
        if inner["t"] != "fetch_reply":
            raise FetchError("malformed", f"{self.who} sent {inner['t']} inside its MAC'd reply")
        self._mac = mac
        return inner

    def _ok(self, item: int, buf, tag) -> bool:
        """Whether ``tag`` vouches for ``buf``, item ``item`` of the reply (1: the first chunk)."""
        if self._mac is not None:
            return self._mac.check(item, buf, tag)
        return checksum(buf) == tag

    def _take_head(self, parts) -> None:
        head = self._decode_head(parts)
        chunk = head["chunk"]
        spans = self.ranges if self.ranges is not None else [[self.start, self.stop]]
        for f in head["arrays"]:
            fld = Field(f)
            where = self.target(fld)
            for a, b in spans:
                for off in range((a - self.start) * 4, (b - self.start) * 4, chunk):
                    n = min(chunk, (b - self.start) * 4 - off)
                    self._chunks.append((fld, where[off : off + n] if isinstance(where, memoryview) else where, off, n))
        if len(head["sums"]) != len(self._chunks):
            raise FetchError(
                "malformed", f"{self.who} sent {len(head['sums'])} checksums for {len(self._chunks)} chunks"
            )
        for entry in head.get("extras", []):
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and type(entry[0]) is int
                and type(entry[1]) is int
                and type(entry[2]) is (int if self._mac is None else bytes)
            ):
                raise FetchError("malformed", f"{self.who} sent a malformed extras entry {entry!r:.80}")
        self.total = sum(n for *_, n in self._chunks)
        self.head = head

    def _take_chunk(self, parts) -> None:
        assert self.head is not None
        fld, where, off, n = self._chunks[self._next]
        view = where if isinstance(where, memoryview) else where.staging(n)
        got = parts.into(view)
        if got != n:
            raise FetchError(
                "malformed", f"{self.who} sent a {got}-byte chunk of {fld.name} at byte {off}, expected {n}"
            )
        if not self._ok(1 + self._next, view, self.head["sums"][self._next]):
            raise FetchError(
                "damaged",
                f"{self.who}: {fld.name} bytes {off}..{off + n} of its shard fail their "
                + ("MAC" if self._mac is not None else "checksum"),
            )
        if not isinstance(where, memoryview):
            where.put(self.start * 4 + off, view)
        self._next += 1
        self.received += n

    def _take_extra(self, parts) -> None:
        assert self.head is not None
        key, nbytes, csum = self.head["extras"][self._next - len(self._chunks)]
        raw = parts.take()
        if len(raw) != nbytes or not self._ok(1 + self._next, raw, csum):
            raise FetchError("malformed", f"{self.who} sent a short or damaged extras chunk {key:#x}")
        self.extras[key] = raw
        self._next += 1


def read_reply(parts, reader: ReplyReader) -> ReplyReader:
    """Feed ``reader`` every part of a reply from ``parts`` (a blocking source), then check
    that nothing follows; returns the reader."""
    while not reader.feed(parts):
        pass
    reader.finish(parts)
    return reader


#: Bound on the element ranges one fetch may ask for (a rank's rows: one per parameter).
MAX_FETCH_RANGES = 1 << 16


def check_ranges(ranges, start: int, stop: int) -> list[list[int]]:
    """The element ranges a fetch asks of a shard ``[start, stop)``, checked: at most
    :data:`MAX_FETCH_RANGES` ``[a, b]`` pairs of integers, ``start <= a < b <= stop``, in
    order and not overlapping. ``ValueError`` names the first problem."""
    if not isinstance(ranges, list) or len(ranges) > MAX_FETCH_RANGES:
        raise ValueError(f"ranges must be a list of at most {MAX_FETCH_RANGES} [start, stop] pairs")
    out, at = [], start
    for r in ranges:
        if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(type(x) is int for x in r)):
            raise ValueError(f"range {r!r:.40} is not a [start, stop] pair of integers")
        a, b = r
        if not at <= a < b <= stop:
            raise ValueError(f"range [{a}, {b}) is empty, out of order, overlapping or outside [{start}, {stop})")
        out.append([a, b])
        at = b
    return out


def param_indices(pairs, nparams: int, who: str, what: str) -> list:
    """Check that every ``(index, ...)`` or index names one of ``nparams`` parameters."""
    for p in pairs:
        i = p[0] if isinstance(p, (list, tuple)) else p
        if not (type(i) is int and 0 <= i < nparams):
            raise FetchError("malformed", f"{who} sent {what} for parameter {i!r} of {nparams}")
    return list(pairs)


def as_bytes(view: np.ndarray) -> memoryview:
    """A writable byte view of a float32 array (or slice of one)."""
    return view.data.cast("B")
