"""Data-plane frames: a small fixed header, a table of runs, then raw payload frames.

A message on the data socket is a ZeroMQ multipart message::

    [header + run table] [payload 0] [payload 1] ...

The header names the job, session epoch, layout hash, sending rank, iteration and a
per-(rank, worker) sequence number, and ends with a 32-bit checksum of the header and
run table (so a flipped bit in a destination offset cannot land valid data elsewhere).
Each run entry is ``(dst, nelem, checksum)``:
``nelem`` fp32 elements landing at flat element ``dst`` (GRAD and STATE frames) or, for
a COMMIT, ``nelem`` bytes of msgpack body; for an EXTRA, ``nelem`` bytes of the chunk
keyed ``dst`` (``trainer_hooks._extras``). Payloads are raw little-endian bytes, sent
zero-copy and received straight into the worker's preallocated buffers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

MAGIC = b"SHDW"
VERSION = 2

_HEADER = struct.Struct("<4sHBBQIHHQQQII")
_RUN = struct.Struct("<QQQ")
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
    """The state arrays an optimizer description (``trainer_hooks._optim.describe``)
    keeps per element, in wire order."""
    if optim["kind"] == "sgd":
        return (Field.PARAM, Field.EXP_AVG) if optim.get("momentum_any") else (Field.PARAM,)
    base = (Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ)
    return base + ((Field.MAX_EXP_AVG_SQ,) if optim.get("amsgrad_any") else ())


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
    runs: tuple[tuple[int, int, int], ...]  # (dst, nelem, checksum)

    def pack(self) -> bytes:
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
        )
        table = b"".join(_RUN.pack(*r) for r in self.runs)
        return _HEADER.pack(*fields, _header_sum(_HEADER.pack(*fields, 0), table)) + table


def _header_sum(head: bytes | memoryview, table: bytes | memoryview) -> int:
    return xxhash.xxh32_intdigest(table, seed=xxhash.xxh32_intdigest(head))


def checksum(buf) -> int:
    """64-bit checksum of a payload (xxh3)."""
    return xxhash.xxh3_64_intdigest(buf)


def unpack_header(buf: bytes | memoryview, max_runs: int) -> Header:
    """Parse and structurally validate a header frame (no context checks)."""
    n = len(buf)
    if n < HEADER_SIZE:
        raise FrameError("truncated", f"header frame is {n} bytes, need at least {HEADER_SIZE}")
    magic, version, kind, field, job, epoch, rank, world, layout, it, seq, nruns, hsum = _HEADER.unpack_from(buf)
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
    mv = memoryview(buf)
    zeroed = _HEADER.pack(magic, version, kind, field, job, epoch, rank, world, layout, it, seq, nruns, 0)
    if _header_sum(zeroed, mv[HEADER_SIZE:]) != hsum:
        raise FrameError("bad_header_checksum", "header or run table does not match its checksum")
    if world == 0 or rank >= world:
        raise FrameError("bad_rank", f"rank {rank} of world {world}")
    runs = tuple(_RUN.unpack_from(buf, HEADER_SIZE + i * RUN_SIZE) for i in range(nruns))
    return Header(kind_e, field_e, job, epoch, rank, world, layout, it, seq, runs)
