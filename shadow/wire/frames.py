"""Data-plane frames: a small fixed header, a table of runs, then raw payload frames.

A message on the data socket is a ZeroMQ multipart message::

    [header + run table] [payload 0] [payload 1] ...

The header names the job, session epoch, layout hash, sending rank, iteration and a
per-(rank, worker) sequence number, and ends with the message's nonce and a tag of
the header and run table (so a flipped bit in a destination offset cannot land valid data
elsewhere). Each run entry is ``(dst, nelem, tag)``, the tag being its payload part's.
Tags are xxh3-64 on a wire without keys and 128-bit GMACs on a keyed one (``shadow.wire.tags``):
the header's tag then authenticates the sender's rank, epoch and sequence number, and
through the table every part.
Run entries:
``nelem`` fp32 elements landing at flat element ``dst`` (GRAD and STATE frames) or, for
a COMMIT, ``nelem`` bytes of msgpack body; for an EXTRA, ``nelem`` bytes of the chunk
keyed ``dst`` (``trainer_hooks.capture.extras``). Payloads are raw little-endian bytes, sent
zero-copy and received straight into the worker's preallocated buffers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from shadow.wire.tags import PLAIN, TAG_SIZE, ZERO_NONCE, Tags

MAGIC = b"SHDW"
VERSION = 3

_FIELDS = struct.Struct("<4sHBBQIHHQQQI12s")  # ... nruns, nonce; the tag follows
_HEADER = struct.Struct(_FIELDS.format + "16s")
_RUN = struct.Struct("<QQ16s")
HEADER_SIZE = _HEADER.size
RUN_SIZE = _RUN.size
#: No payload frame is larger: a sender splits a longer run into consecutive runs of at
#: most this many bytes, each with its own table entry and checksum, and a worker's data
#: socket refuses larger frames (``ZMQ_MAXMSGSIZE``).
MAX_PART_BYTES = 64 << 20


class Kind(IntEnum):
    GRAD = 1  # reduced gradient of iteration k
    STATE = 2  # full state (bootstrap / resync) as of iteration k
    COMMIT = 3  # commit record of iteration k (msgpack body)
    EXTRA = 4  # chunks of model state outside the optimizer that changed in iteration k


class Field(IntEnum):
    """Which state array a STATE frame carries (GRAD and COMMIT frames use ``GRAD``)."""

    GRAD = 0
    PARAM = 1
    EXP_AVG = 2
    EXP_AVG_SQ = 3
    MAX_EXP_AVG_SQ = 4


def state_fields(optim: dict) -> tuple[Field, ...]:
    """The state arrays an optimizer description (``trainer_hooks.optim.describe.describe``)
    keeps per element, in wire order (:func:`shadow.core.optimizers.state_fields`)."""
    from shadow.core import optimizers  # it names Field: imported when first asked

    return optimizers.state_fields(optim)


class FrameError(ValueError):
    """A frame failed validation; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Header:
    kind: Kind
    field: Field
    job: int
    epoch: int
    rank: int
    world: int
    layout: int
    iteration: int
    seq: int
    runs: tuple[tuple[int, int, int], ...]  # (dst, nelem, tag of the part)
    nonce: bytes = ZERO_NONCE  # the message's (``Tags.nonce``); its parts' tags were made with it

    def pack(self, tags: Tags = PLAIN) -> bytes:
        """The header frame, tagged with ``tags`` (the ones its parts were tagged with)."""
        fields = (
            MAGIC,
            VERSION,
            int(self.kind),
            int(self.field),
            self.job,
            self.epoch,
            self.rank,
            self.world,
            self.layout,
            self.iteration,
            self.seq,
            len(self.runs),
            self.nonce,
        )
        table = b"".join(_RUN.pack(d, n, _tag_bytes(t)) for d, n, t in self.runs)
        head = _FIELDS.pack(*fields)
        return head + _tag_bytes(tags.tag(self.nonce, 0, head + table)) + table


def _tag_bytes(tag: int) -> bytes:
    return tag.to_bytes(TAG_SIZE, "little")


def checksum(buf) -> int:
    """64-bit checksum (xxh3) of a payload or a file: a run entry's tag on a wire without keys."""
    return PLAIN.tag(ZERO_NONCE, 1, buf)


def unpack_header(buf: bytes | memoryview, max_runs: int, tags=PLAIN) -> Header:
    """Parse and validate a header frame (no context checks). ``tags``: the :class:`Tags`
    its tag must check with, or a function of the sending rank giving them (None: that rank
    has no key here). On a keyed wire nothing past the fixed fields is read before the tag
    checks out."""
    n = len(buf)
    if n < HEADER_SIZE:
        raise FrameError("truncated", f"header frame is {n} bytes, need at least {HEADER_SIZE}")
    magic, version, kind, field, job, epoch, rank, world, layout, it, seq, nruns, nonce, htag = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise FrameError("bad_version", f"protocol version {version}, this build speaks {VERSION}")
    try:
        kind_e, field_e = Kind(kind), Field(field)
    except ValueError:
        raise FrameError("bad_kind", f"unknown kind/field {kind}/{field}") from None
    if nruns > max_runs:
        raise FrameError("too_many_runs", f"{nruns} runs exceeds the limit of {max_runs}")
    if n != HEADER_SIZE + nruns * RUN_SIZE:
        raise FrameError("bad_length", f"header frame is {n} bytes for {nruns} runs")
    if world == 0 or rank >= world:
        raise FrameError("bad_rank", f"rank {rank} of world {world}")
    mine = tags(rank) if callable(tags) else tags
    if mine is None:
        raise FrameError("bad_rank", f"no key for rank {rank} here")
    mv = memoryview(buf)
    signed = bytes(mv[: _FIELDS.size]) + bytes(mv[HEADER_SIZE:])
    if not mine.check(nonce, 0, signed, int.from_bytes(htag, "little")):
        if mine.keyed:
            raise FrameError("bad_mac", f"header of rank {rank} seq {seq} fails its MAC (another key, or altered)")
        raise FrameError("bad_header_checksum", "header or run table does not match its checksum")
    runs = tuple(_unpack_run(buf, HEADER_SIZE + i * RUN_SIZE) for i in range(nruns))
    return Header(kind_e, field_e, job, epoch, rank, world, layout, it, seq, runs, nonce)


def header_iteration(buf: bytes | memoryview) -> int:
    """The iteration a header frame names, read without any check (fault injection, which
    sees its own frames); raises :class:`FrameError` if the frame is too short to say."""
    if len(buf) < HEADER_SIZE:
        raise FrameError("truncated", f"header frame is {len(buf)} bytes, need at least {HEADER_SIZE}")
    return _FIELDS.unpack_from(buf)[9]


def _unpack_run(buf, offset: int) -> tuple[int, int, int]:
    dst, nelem, tag = _RUN.unpack_from(buf, offset)
    return dst, nelem, int.from_bytes(tag, "little")
