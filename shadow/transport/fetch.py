"""One reader of a worker's ``fetch_reply``, for a restore (straight into the flat arrays)
and for a replica's peer copy (into its own range) alike.

A reply is a head (msgpack) and then, for each array the head names, its bytes of the
range in chunks of ``chunk`` bytes, each with its xxh3 in ``sums``; then the extras chunks
(the model state outside the optimizer). The reader checks the head against what was
asked for, every chunk's size and checksum, and that nothing follows; it never trusts a
length or an index from the head without checking it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import zmq

from shadow.tuning import DEFAULT
from shadow.wire import messages as M
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
    """The parts of a reply still in a socket: each chunk received straight into place."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def head(self) -> bytes:
        return self.sock.recv()

    def more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def into(self, target: memoryview) -> int:
        return self.sock.recv_into(target)

    def take(self) -> bytes:
        return self.sock.recv()


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
        raw = self.parts[self.i]
        self.i += 1
        return raw


def read_head(
    parts,
    *,
    epoch: int | None,
    iteration: int,
    start: int,
    stop: int,
    fields: list[int],
    who: str,
    commit_bytes: int = DEFAULT.max_commit_bytes,
) -> dict:
    """The reply's head, checked against what was asked for (``epoch`` None: any;
    ``commit_bytes``: the reader's ``Tuning.max_commit_bytes``)."""
    head = M.decode(parts.head(), commit_bytes)
    if head["t"] == "error":
        code = head["code"] if head["code"] in ("moved_on", "busy") else "error"
        raise FetchError(code, f"{who}: {head['message']}")
    if head["t"] != "fetch_reply" or head["iteration"] != iteration or (epoch is not None and head["epoch"] != epoch):
        raise FetchError(
            "mismatch",
            f"{who} answered {head['t']} for epoch {head.get('epoch')} iteration "
            f"{head.get('iteration')}, not iteration {iteration}",
        )
    if (head["start"], head["stop"]) != (start, stop):
        raise FetchError("mismatch", f"{who} holds [{head['start']}, {head['stop']}), not [{start}, {stop})")
    chunk = head["chunk"]
    if head["arrays"] != fields or chunk <= 0 or chunk % 4:
        raise FetchError("mismatch", f"{who} sent arrays {head['arrays']} in chunks of {chunk}, expected {fields}")
    return head


def read_arrays(parts, head: dict, target: Callable[[Field], memoryview], who: str) -> None:
    """Each array's bytes into ``target(field)`` (a byte view of the range), chunk by chunk,
    each checked against its checksum."""
    sums, chunk = iter(head["sums"]), head["chunk"]
    for f in head["arrays"]:
        fld = Field(f)
        view = target(fld)
        for off in range(0, len(view), chunk):
            want = min(chunk, len(view) - off)
            if not parts.more():
                raise FetchError("malformed", f"{who} sent too few bytes for {fld.name}")
            got = parts.into(view[off : off + want])
            if got != want:
                raise FetchError(
                    "malformed", f"{who} sent a {got}-byte chunk of {fld.name} at byte {off}, expected {want}"
                )
            if checksum(view[off : off + want]) != next(sums, None):
                raise FetchError(
                    "damaged", f"{who}: {fld.name} bytes {off}..{off + want} of its shard fail their checksum"
                )


def read_extras(parts, head: dict, who: str) -> dict[int, bytes]:
    """The extras chunks, each checked; then nothing may follow."""
    extras = {}
    for key, nbytes, csum in head.get("extras", []):
        if not parts.more():
            raise FetchError("malformed", f"{who} sent too few extras chunks")
        raw = parts.take()
        if len(raw) != nbytes or checksum(raw) != csum:
            raise FetchError("malformed", f"{who} sent a short or damaged extras chunk {key:#x}")
        extras[int(key)] = raw
    if parts.more():
        raise FetchError("malformed", f"{who} sent more than its shard")
    return extras


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
