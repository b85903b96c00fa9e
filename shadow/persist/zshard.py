"""Compressed shard files (``shard-<i>-of-<n>.shard.zst``): a plain shard file
(:mod:`shadow.persist.shardfile`) stored as byte-plane zstd blobs
(:mod:`shadow.persist.planes`), which read back to exactly the same bytes.

Layout::

    b"SHADOWZ1"
    blob   the plain file's header region (u64 length, JSON header, padding), 1 plane
    blobs  every tensor of the plain file in data-offset order (padding included), cut
           into blocks of at most SHADOW_COMPRESS_BLOCK_BYTES, one blob per block,
           as many planes as the tensor's element has bytes
    index  JSON: {"format", "codec", "level", "image_bytes", "image_checksum",
                  "head": [pos, len], "tensors": {name: [[pos, len], ...]}}
    u64 index length | u64 xxh3-64 of the index | b"SHADOWZ1"

The index comes last so a writer streams blobs as it compresses them (to a local file
or an fsspec stream) without knowing their sizes up front. Tensor names, dtypes and
offsets are not repeated in the index: they come from the embedded plain header.

Checksums, three levels: the manifest records the xxh3 of the whole stored file, so
``verify`` checks a compressed shard without decompressing it; every blob carries the
xxh3 of its raw bytes, checked on every decode (a restore with ``check=False`` still
never returns altered data); ``image_checksum`` is the xxh3 of the whole plain file,
checked when :func:`decode_to` rebuilds it. It is not a single zstd stream: ``zstd -d``
refuses it; :func:`decode_to` turns it back into the plain, safetensors-readable file.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
import xxhash

from shadow.config.tuning import Tuning
from shadow.persist import planes, shardfile
from shadow.persist.planes import CorruptBlobError
from shadow.storage import modes
from shadow.storage.local import replacing

logger = logging.getLogger(__name__)

SUFFIX = ".shard.zst"
MAGIC = b"SHADOWZ1"
FORMAT = "shadow-shard-zst/1"
CODEC = "zstd+byteplanes"
_TRAILER = struct.Struct("<QQ8s")
MAX_INDEX_BYTES = 64 << 20

Target = Callable[[str, np.dtype, int], "np.ndarray | None"]


def is_compressed(file_name: str) -> bool:
    """Whether a shard file name denotes a compressed shard."""
    return file_name.endswith(SUFFIX)


class _HashingWriter:
    """Writes to ``f`` while counting the bytes and hashing them (xxh3-64)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.nbytes, self.h = f, 0, xxhash.xxh3_64()

    def write(self, data) -> None:
        self.f.write(data)
        self.h.update(data)
        self.nbytes += memoryview(data).nbytes


def _tiles(specs: list, data_bytes: int, where: str) -> None:
    """Check that the tensors cover the data region exactly (no gaps, no overlap):
    only then do the blobs hold every byte of the plain file."""
    pos = 0
    for name, _dt, lo, hi in specs:
        if lo != pos:
            raise CorruptBlobError(
                f"{where}: bytes {pos}..{lo} of the data belong to no tensor (or overlap "
                f"at {name!r}); only files whose tensors tile the data can be compressed"
            )
        pos = hi
    if pos != data_bytes:
        raise CorruptBlobError(f"{where}: the tensors end at byte {pos} of {data_bytes} data bytes")


def _ordered(fn: Callable, items: Iterable, threads: int) -> Iterator[tuple]:
    """``(item, fn(item))`` in order, with up to ``threads`` running and 2x that queued
    (bounded memory for the compressed results waiting to be written)."""
    if threads <= 1:
        for it in items:
            yield it, fn(it)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="shadow-zstd") as pool:
        pending: deque = deque()
        for it in items:
            pending.append((it, pool.submit(fn, it)))
            if len(pending) >= 2 * threads:
                head, fut = pending.popleft()
                yield head, fut.result()
        while pending:
            head, fut = pending.popleft()
            yield head, fut.result()


def encode(
    image,
    out: BinaryIO,
    level: int,
    threads: int | None = None,
    block_bytes: int | None = None,
    where: str = "shard image",
) -> tuple[int, int]:
    """Compress a plain shard file image (bytes-like or uint8 array, e.g. a memmap of
    the file) into ``out``; returns ``(bytes written, xxh3-64 of them)``."""
    img = (image if isinstance(image, np.ndarray) else np.frombuffer(image, dtype=np.uint8)).reshape(-1).view(np.uint8)
    if threads is None or block_bytes is None:  # not given: the environment's, else the defaults
        tuning = Tuning.load()
        threads = tuning.compress_threads if threads is None else threads
        block_bytes = tuning.compress_block_bytes if block_bytes is None else block_bytes
    block = block_bytes
    try:
        _meta, base, specs = shardfile.tensor_specs(img.data)
    except ValueError as exc:
        raise ValueError(f"{where}: cannot compress: {exc}") from None
    _tiles(specs, img.size - base, where)
    jobs: list[tuple[str | None, int, int, int]] = [(None, 0, base, 1)]  # (tensor, None: the header; lo, hi, itemsize)
    for name, dt, lo, hi in specs:
        step = max(block // dt.itemsize, 1) * dt.itemsize
        jobs += [(name, p, min(base + hi, p + step), dt.itemsize) for p in range(base + lo, base + hi, step)]
        if lo == hi:
            jobs.append((name, base + lo, base + lo, dt.itemsize))  # an empty tensor still gets its blob
    index: dict = {
        "format": FORMAT,
        "codec": CODEC,
        "level": level,
        "image_bytes": int(img.size),
        "image_checksum": f"{xxhash.xxh3_64_intdigest(img.data):016x}",
        "head": None,
        "tensors": {name: [] for name, *_ in specs},
    }
    w = _HashingWriter(out)
    w.write(MAGIC)

    def work(job):
        _name, lo, hi, itemsize = job
        return planes.encode(img[lo:hi], itemsize, level)

    for (name, _lo, _hi, _k), blob in _ordered(work, jobs, threads):
        ref = [w.nbytes, len(blob)]
        w.write(blob)
        if name is None:
            index["head"] = ref
        else:
            index["tensors"][name].append(ref)
    raw = json.dumps(index, separators=(",", ":")).encode()
    w.write(raw)
    w.write(_TRAILER.pack(len(raw), xxhash.xxh3_64_intdigest(raw), MAGIC))
    return w.nbytes, w.h.intdigest()


def write(
    image,
    path: str,
    level: int,
    threads: int | None = None,
    block_bytes: int | None = None,
    file_mode: int = modes.FILE_MODE,
    dir_mode: int = modes.DIR_MODE,
) -> tuple[int, int]:
    """Compress a plain shard image to ``path`` durably (tmp, fsync, rename, fsync dir),
    the file with permissions ``file_mode`` and the directories it creates ``dir_mode``;
    returns ``(bytes on storage, their xxh3-64)``, what a manifest records."""
    with replacing(path, file_mode, dir_mode) as tmp, open(tmp, "wb", buffering=1 << 20) as f:
        result = encode(image, f, level, threads, block_bytes, where=path)
        f.flush()
        os.fsync(f.fileno())
    return result


def _blob(mv: memoryview, ref, end: int, where: str) -> memoryview:
    if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(x, int) for x in ref)):
        raise CorruptBlobError(f"{where}: malformed blob reference {ref!r} in the index")
    pos, length = ref
    if not len(MAGIC) <= pos <= pos + length <= end:
        raise CorruptBlobError(
            f"{where}: blob at bytes {pos}..{pos + length} lies outside the data "
            f"(8..{end}): the file is truncated or its index is corrupt"
        )
    return mv[pos : pos + length]


def _index(mv: memoryview, where: str) -> tuple[dict, int]:
    """The validated index of a compressed shard file and where it starts."""
    if len(mv) < len(MAGIC) + _TRAILER.size:
        raise CorruptBlobError(f"{where}: truncated: {len(mv)} bytes is too short for a compressed shard")
    if bytes(mv[: len(MAGIC)]) != MAGIC:
        raise CorruptBlobError(f"{where}: not a compressed shard file (bad magic at the start)")
    ilen, icsum, magic = _TRAILER.unpack_from(mv, len(mv) - _TRAILER.size)
    if magic != MAGIC:
        raise CorruptBlobError(f"{where}: truncated or corrupt: no end marker (an interrupted write?)")
    end = len(mv) - _TRAILER.size - ilen
    if ilen > MAX_INDEX_BYTES or end < len(MAGIC):
        raise CorruptBlobError(f"{where}: index length {ilen} does not fit the file")
    raw = mv[end : end + ilen]
    if xxhash.xxh3_64_intdigest(raw) != icsum:
        raise CorruptBlobError(f"{where}: the index fails its checksum: the file is corrupt")
    try:
        index = json.loads(bytes(raw))
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("codec") != CODEC:
            raise ValueError(f"format {index.get('format')!r} codec {index.get('codec')!r}")
        int(index["image_bytes"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptBlobError(f"{where}: unreadable index: {exc}") from None
    return index, end


def image_bytes(data) -> int:
    """Size of the plain shard file a compressed one encodes (read from its index)."""
    mv = memoryview(data).cast("B")
    return int(_index(mv, "compressed shard")[0]["image_bytes"])


def _plan(mv: memoryview, where: str) -> tuple[dict, dict, list, memoryview, dict]:
    """Validate the framing, the index and the embedded plain header; returns
    ``(index, metadata, specs, header blob, {name: [(blob, raw bytes), ...]})``."""
    index, end = _index(mv, where)
    try:
        head_blob = _blob(mv, index["head"], end, where)
        head = planes.decode(head_blob, where=f"{where}: header blob")
        meta, base, specs = shardfile.tensor_specs(head.data, size=int(index["image_bytes"]))
        tensors = index["tensors"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        if isinstance(exc, CorruptBlobError):
            raise
        raise CorruptBlobError(f"{where}: unreadable index or header: {exc}") from None
    if len(head) != base:
        raise CorruptBlobError(f"{where}: the header blob holds {len(head)} bytes, its header says {base}")
    _tiles(specs, int(index["image_bytes"]) - base, where)
    if not isinstance(tensors, dict) or set(tensors) != {s[0] for s in specs}:
        raise CorruptBlobError(f"{where}: the index and the header list different tensors")
    refs = {}
    for name, dt, lo, hi in specs:
        blobs, total = [], 0
        if not isinstance(tensors[name], list):
            raise CorruptBlobError(f"{where}: tensor {name!r}: malformed block list in the index")
        for i, ref in enumerate(tensors[name]):
            w = f"{where}: tensor {name!r} block {i}"
            blob = _blob(mv, ref, end, w)
            itemsize, nbytes = planes.peek(blob, w)
            if itemsize != dt.itemsize:
                raise CorruptBlobError(f"{w}: {itemsize}-byte elements, the tensor has {dt.itemsize}")
            blobs.append((blob, nbytes))
            total += nbytes
        if total != hi - lo:
            raise CorruptBlobError(f"{where}: tensor {name!r}: its blocks hold {total} bytes, it needs {hi - lo}")
        refs[name] = blobs
    return index, meta, specs, head_blob, refs


def decode(
    data, target: Target | None = None, where: str = "compressed shard", threads: int = shardfile.READ_THREADS
) -> tuple[dict, dict[str, np.ndarray]]:
    """``(metadata, tensors)`` of a compressed shard file's bytes, every block checked.

    ``target(name, dtype, count)`` returns where tensor ``name`` goes (or None for a
    fresh array), as for :func:`shardfile.read_into`. Raises :class:`CorruptBlobError`
    (a ``ValueError``) naming the file, tensor and block when anything is wrong.
    """
    mv = memoryview(data).cast("B")
    _index, meta, specs, _head, refs = _plan(mv, where)
    tensors, jobs = {}, []
    for name, dt, lo, hi in specs:
        count = (hi - lo) // dt.itemsize
        arr = target(name, dt, count) if target is not None else None
        if arr is None:
            arr = np.empty(count, dtype=dt)
        if arr.dtype != dt or arr.size != count or not arr.flags.c_contiguous:
            raise ValueError(f"{where}: tensor {name!r} is {dt} x {count}, not what the layout expects")
        tensors[name] = arr
        dst, pos = arr.reshape(-1).view(np.uint8), 0
        for i, (blob, nbytes) in enumerate(refs[name]):
            jobs.append((blob, dst[pos : pos + nbytes], f"{where}: tensor {name!r} block {i}"))
            pos += nbytes

    def work(job) -> None:
        blob, dst, w = job
        planes.decode(blob, dst, w)

    for _ in _ordered(work, jobs, threads):
        pass
    return meta, tensors


def decode_to(data, out: BinaryIO, where: str = "compressed shard", threads: int = 2) -> tuple[int, int]:
    """Write the plain shard file a compressed one encodes to ``out`` (in order, a block
    at a time); returns ``(bytes written, xxh3-64 of them)`` after checking both against
    the size and checksum of the original plain file."""
    mv = memoryview(data).cast("B")
    index, _meta, specs, head, refs = _plan(mv, where)
    w = _HashingWriter(out)
    jobs = [(head, f"{where}: header blob")]
    jobs += [
        (blob, f"{where}: tensor {name!r} block {i}") for name, *_ in specs for i, (blob, _n) in enumerate(refs[name])
    ]
    for _job, raw in _ordered(lambda job: planes.decode(job[0], where=job[1]), jobs, threads):
        w.write(raw)
    if w.nbytes != index["image_bytes"] or f"{w.h.intdigest():016x}" != index["image_checksum"]:
        raise CorruptBlobError(
            f"{where}: the rebuilt plain file ({w.nbytes} bytes) does not match the original "
            f"({index['image_bytes']} bytes, checksum {index['image_checksum']})"
        )
    return w.nbytes, w.h.intdigest()
