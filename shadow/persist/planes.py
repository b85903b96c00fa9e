"""Lossless compression of one block of array bytes: byte planes, then zstd per plane.

Trained float32 state looks random to a general-purpose compressor when its bytes are
interleaved, but the top byte of every element (sign and seven exponent bits) takes only
a handful of values. Splitting the elements into *byte planes* (plane ``j`` = byte ``j``
of every element, in memory order) gives zstd one stream of low-entropy exponent bytes
and a few streams of near-random mantissa bytes, which it stores almost as they are.

Blob layout (all integers little-endian)::

    magic b"SPL1" | u8 itemsize (= plane count) | u8 codec (1 = zstd) | u16 reserved (0)
    | u64 raw byte count | u64 xxh3-64 of the raw bytes
    | itemsize x u64 compressed length of each plane's zstd frame
    | the frames, plane 0 first

:func:`decode` validates every field, every frame length and the checksum of the
reassembled bytes, and raises :class:`CorruptBlobError` (naming ``where``) rather than
return anything that differs from what :func:`encode` was given.
"""

from __future__ import annotations

import logging
import struct
import threading
from types import ModuleType

import numpy as np
import xxhash
from numba import njit

from shadow.kernels import _cache  # noqa: F401  (chooses the kernel cache directory before any @njit)

zstandard: ModuleType | None
try:
    import zstandard
except ImportError:  # only compressing tiers need it; the error below names the fix
    zstandard = None

logger = logging.getLogger(__name__)

MAGIC = b"SPL1"
CODEC_ZSTD = 1
_HEAD = struct.Struct("<4sBBHQQ")
HEADER_SIZE = _HEAD.size
MAX_ITEMSIZE = 16
_local = threading.local()


class CorruptBlobError(ValueError):
    """A compressed blob is truncated, malformed or decodes to the wrong bytes."""


def _zstd():
    if zstandard is None:
        raise RuntimeError("compress='zstd' needs the zstandard package: pip install zstandard")
    return zstandard


# The kernels are unrolled per element width: a generic loop over the plane index
# runs 3-8x slower (numba does not unroll a runtime trip count).
@njit(cache=True, nogil=True)
def _split2(src, out):
    for i in range(out.shape[1]):
        out[0, i] = src[2 * i]
        out[1, i] = src[2 * i + 1]


@njit(cache=True, nogil=True)
def _split4(src, out):
    for i in range(out.shape[1]):
        b = 4 * i
        out[0, i] = src[b]
        out[1, i] = src[b + 1]
        out[2, i] = src[b + 2]
        out[3, i] = src[b + 3]


@njit(cache=True, nogil=True)
def _split8(src, out):
    for i in range(out.shape[1]):
        b = 8 * i
        out[0, i] = src[b]
        out[1, i] = src[b + 1]
        out[2, i] = src[b + 2]
        out[3, i] = src[b + 3]
        out[4, i] = src[b + 4]
        out[5, i] = src[b + 5]
        out[6, i] = src[b + 6]
        out[7, i] = src[b + 7]


@njit(cache=True, nogil=True)
def _join2(planes, dst):
    for i in range(planes.shape[1]):
        dst[2 * i] = planes[0, i]
        dst[2 * i + 1] = planes[1, i]


@njit(cache=True, nogil=True)
def _join4(planes, dst):
    for i in range(planes.shape[1]):
        b = 4 * i
        dst[b] = planes[0, i]
        dst[b + 1] = planes[1, i]
        dst[b + 2] = planes[2, i]
        dst[b + 3] = planes[3, i]


@njit(cache=True, nogil=True)
def _join8(planes, dst):
    for i in range(planes.shape[1]):
        b = 8 * i
        dst[b] = planes[0, i]
        dst[b + 1] = planes[1, i]
        dst[b + 2] = planes[2, i]
        dst[b + 3] = planes[3, i]
        dst[b + 4] = planes[4, i]
        dst[b + 5] = planes[5, i]
        dst[b + 6] = planes[6, i]
        dst[b + 7] = planes[7, i]


_SPLIT = {2: _split2, 4: _split4, 8: _split8}
_JOIN = {2: _join2, 4: _join4, 8: _join8}


def _bytes_of(raw) -> np.ndarray:
    arr = np.asarray(raw)
    if not arr.flags.c_contiguous:
        raise ValueError("byte planes need a contiguous array")
    return arr.reshape(-1).view(np.uint8)


def _scratch(nbytes: int, slot: str) -> np.ndarray:
    """A per-thread reusable byte buffer (no page faults on every block)."""
    buf = getattr(_local, slot, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def split(raw, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """The byte planes of ``raw`` (any contiguous array; its bytes are read as elements
    of ``itemsize`` bytes): a ``(itemsize, n)`` uint8 array, row ``j`` = byte ``j`` of
    every element. ``out`` (that shape, uint8) avoids an allocation."""
    src = _bytes_of(raw)
    if itemsize < 1 or src.size % itemsize:
        raise ValueError(f"{src.size} bytes are not a whole number of {itemsize}-byte elements")
    n = src.size // itemsize
    if out is None:
        out = np.empty((itemsize, n), dtype=np.uint8)
    elif out.shape != (itemsize, n) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"split output must be contiguous uint8 of shape {(itemsize, n)}, got {out.dtype} {out.shape}")
    kernel = _SPLIT.get(itemsize)
    if itemsize == 1:
        out[0] = src
    elif kernel is not None and n:
        kernel(src, out)
    elif n:
        out[...] = src.reshape(n, itemsize).T
    return out


def join(planes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split`: the interleaved bytes (uint8, ``itemsize * n``) of a
    ``(itemsize, n)`` plane array, written into ``out`` when given."""
    if planes.ndim != 2 or planes.dtype != np.uint8 or not planes.flags.c_contiguous:
        raise ValueError("join needs a contiguous (itemsize, n) uint8 plane array")
    k, n = planes.shape
    if out is None:
        out = np.empty(k * n, dtype=np.uint8)
    dst = _bytes_of(out)
    if dst.size != k * n:
        raise ValueError(f"join output holds {dst.size} bytes, the planes hold {k * n}")
    kernel = _JOIN.get(k)
    if k == 1:
        dst[:] = planes[0]
    elif kernel is not None and n:
        kernel(planes, dst)
    elif n:
        dst.reshape(n, k)[...] = planes.T
    return out


def _compressor(level: int):
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    if level not in cache:  # contexts are not thread-safe: one per thread and level
        cache[level] = _zstd().ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor():
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = _zstd().ZstdDecompressor()
    return d


def encode(raw, itemsize: int, level: int) -> bytes:
    """Compress the bytes of ``raw`` as ``itemsize``-byte elements into one blob."""
    src = _bytes_of(raw)
    if not 1 <= itemsize <= MAX_ITEMSIZE:
        raise ValueError(f"itemsize={itemsize} must be 1 to {MAX_ITEMSIZE}")
    planes = split(src, itemsize, _scratch(src.size, "split").reshape(itemsize, -1))
    cctx = _compressor(level)
    frames = [cctx.compress(planes[j]) for j in range(itemsize)]
    head = _HEAD.pack(MAGIC, itemsize, CODEC_ZSTD, 0, src.size, xxhash.xxh3_64_intdigest(src.data))
    return b"".join([head, struct.pack(f"<{itemsize}Q", *map(len, frames)), *frames])


def peek(blob, where: str = "blob") -> tuple[int, int]:
    """``(itemsize, raw byte count)`` of a blob, with its framing validated (not its data)."""
    itemsize, nbytes, _, _ = _parse(memoryview(blob), where)
    return itemsize, nbytes


def _parse(mv: memoryview, where: str) -> tuple[int, int, int, list[int]]:
    if len(mv) < HEADER_SIZE:
        raise CorruptBlobError(f"{where}: truncated: {len(mv)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, itemsize, codec, reserved, nbytes, csum = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptBlobError(f"{where}: not a byte-plane blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if codec != CODEC_ZSTD or reserved:
        raise CorruptBlobError(f"{where}: unknown codec {codec} / flags {reserved} (written by a newer version?)")
    if not 1 <= itemsize <= MAX_ITEMSIZE or nbytes % itemsize:
        raise CorruptBlobError(f"{where}: {nbytes} bytes are not whole {itemsize}-byte elements")
    table = HEADER_SIZE + 8 * itemsize
    if len(mv) < table:
        raise CorruptBlobError(f"{where}: truncated inside its plane table ({len(mv)} of {table} bytes)")
    lengths = list(struct.unpack_from(f"<{itemsize}Q", mv, HEADER_SIZE))
    if table + sum(lengths) != len(mv):
        what = "truncated" if table + sum(lengths) > len(mv) else "has trailing bytes"
        raise CorruptBlobError(
            f"{where}: {what}: the plane table says {table + sum(lengths)} bytes, the blob has {len(mv)}"
        )
    return itemsize, nbytes, csum, lengths


def decode(blob, out: np.ndarray | None = None, where: str = "blob") -> np.ndarray:
    """The raw bytes of a blob (uint8), written into ``out`` (any contiguous array of
    exactly that many bytes) when given. Raises :class:`CorruptBlobError` naming
    ``where`` when the blob is truncated, malformed or fails its checksum; ``out`` may
    then hold garbage and must not be used."""
    mv = memoryview(blob).cast("B")
    itemsize, nbytes, csum, lengths = _parse(mv, where)
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    dst = _bytes_of(out)
    if dst.size != nbytes:
        raise ValueError(f"{where}: the blob holds {nbytes} bytes, the destination {dst.size}")
    n = nbytes // itemsize
    planes = dst.reshape(1, n) if itemsize == 1 else _scratch(nbytes, "join").reshape(itemsize, n)
    z, dctx = _zstd(), _decompressor()
    pos = HEADER_SIZE + 8 * itemsize
    for j, length in enumerate(lengths):
        frame = mv[pos : pos + length]
        pos += length
        try:
            size = z.frame_content_size(frame)
            if size != n:
                raise CorruptBlobError(f"{where}: plane {j} decompresses to {size} bytes, expected {n}")
            with dctx.stream_reader(frame, read_across_frames=False) as reader:
                got = reader.readinto(memoryview(planes[j])) if n else 0
                extra = reader.read(1)
        except z.ZstdError as exc:
            raise CorruptBlobError(f"{where}: plane {j} is not a valid zstd frame: {exc}") from None
        if got != n or extra:
            raise CorruptBlobError(
                f"{where}: plane {j} decompressed to {got}{'+' if extra else ''} bytes, expected {n}"
            )
    if itemsize > 1:
        join(planes, dst)
    if xxhash.xxh3_64_intdigest(dst.data) != csum:
        raise CorruptBlobError(f"{where}: the decompressed bytes fail their checksum: the data is corrupt")
    return out
