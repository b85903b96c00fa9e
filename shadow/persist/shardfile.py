"""One shard of one checkpoint as a file readable by the ``safetensors`` library.

File = ``u64 header length`` + JSON header (padded with spaces so the data starts on a
4 KiB boundary) + the tensors back to back. The whole image lives in one preallocated,
page-aligned buffer: the worker copies its range into it at an iteration boundary
(:meth:`ShardImage.fill`), and a background thread writes it with large aligned writes
(``O_DIRECT`` where the file system takes it, buffered otherwise), fsyncs and renames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import struct
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from shadow.storage import modes
from shadow.storage.local import replacing
from shadow.wire.frames import checksum

logger = logging.getLogger(__name__)

FORMAT = "shadow-shard/1"
PAGE = 4096
PAD_PREFIX = "_pad"  # filler tensors that page-align the next tensor
CHUNK = 8 << 20  # bytes per write call

_DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "U8": np.uint8}


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes]


def aligned_empty(count: int, dtype) -> np.ndarray:
    """An uninitialised page-aligned array (a valid O_DIRECT read target)."""
    dt = np.dtype(dtype)
    return _aligned(count * dt.itemsize).view(dt)


@dataclass
class Entry:
    name: str
    dtype: str
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(_DTYPES[self.dtype]).itemsize


class ShardImage:
    """A reusable page-aligned buffer holding one shard file image."""

    def __init__(self, capacity: int) -> None:
        self.buf = _aligned(max(capacity, PAGE))
        self.size = 0  # bytes of the current image
        self.data_start = 0
        self.offsets: dict[str, tuple[int, Entry]] = {}

    def layout(self, entries: list[Entry], metadata: dict[str, str]) -> None:
        """Lay out an image with these tensors; grows the buffer when needed."""
        header: dict = {"__metadata__": metadata}
        off = 0
        self.offsets = {}
        for i, e in enumerate(entries):
            pad = (-off) % PAGE if e.nbytes >= PAGE else 0
            if pad:  # start every large tensor on a page so readers can use O_DIRECT
                header[f"{PAD_PREFIX}{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [off, off + pad]}
                off += pad
            header[e.name] = {"dtype": e.dtype, "shape": [e.count], "data_offsets": [off, off + e.nbytes]}
            self.offsets[e.name] = (off, e)
            off += e.nbytes
        tail = (-off) % PAGE
        if tail:  # the file ends on a page too: one O_DIRECT write covers it, no truncate
            header[f"{PAD_PREFIX}end"] = {"dtype": "U8", "shape": [tail], "data_offsets": [off, off + tail]}
            off += tail
        blob = json.dumps(header, separators=(",", ":")).encode()
        hlen = -(-(len(blob) + 8) // PAGE) * PAGE - 8
        self.data_start = 8 + hlen
        self.size = self.data_start + off
        if self.size > len(self.buf):
            self.buf = _aligned(self.size)
        self.buf[:8] = np.frombuffer(struct.pack("<Q", hlen), dtype=np.uint8)
        self.buf[8 : 8 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        self.buf[8 + len(blob) : self.data_start] = ord(" ")
        for name, spec in header.items():  # deterministic filler bytes
            if name.startswith(PAD_PREFIX):
                lo, hi = spec["data_offsets"]
                self.buf[self.data_start + lo : self.data_start + hi] = 0

    def view(self, name: str) -> np.ndarray:
        off, e = self.offsets[name]
        start = self.data_start + off
        return self.buf[start : start + e.nbytes].view(_DTYPES[e.dtype])

    def fill(self, name: str, src: np.ndarray) -> None:
        np.copyto(self.view(name), src, casting="no")

    def checksum(self) -> int:
        return checksum(self.buf[: self.size].data)

    def write(self, path: str, file_mode: int = modes.FILE_MODE, dir_mode: int = modes.DIR_MODE) -> int:
        """Write the image to ``path`` durably (tmp, fsync, rename, fsync dir), the file with
        permissions ``file_mode`` and the directories it creates ``dir_mode``, whatever the
        umask. A write that fails (a full disk: ``ENOSPC``) removes its partial ``.tmp``
        file, which would otherwise hold on to the space until retention finds the directory."""
        with replacing(path, file_mode, dir_mode) as tmp:
            self._write_tmp(tmp)
        return self.size

    def _write_tmp(self, tmp: str) -> None:
        direct = getattr(os, "O_DIRECT", 0)
        fd = None
        if direct:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, modes.FILE_MODE)
            except OSError:
                fd = None
        used_direct = fd is not None
        if fd is None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, modes.FILE_MODE)
        try:
            mv = self.buf.data
            try:
                _write_all(fd, mv, self.size)
            except OSError as exc:
                if not used_direct or exc.errno not in (22,):  # EINVAL: O_DIRECT refused at write time
                    raise
                os.close(fd)
                fd = None
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, modes.FILE_MODE)
                used_direct = False
                _write_all(fd, mv, self.size)
            os.fsync(fd)
        finally:
            if fd is not None:
                os.close(fd)


WRITE_THREADS = 2  # chunks in flight at once


def _write_all(fd: int, mv: memoryview, length: int) -> None:
    """Write ``mv[:length]`` at offset 0 in CHUNK-sized pieces, WRITE_THREADS at a time."""

    def put(pos: int) -> None:
        end = min(length, pos + CHUNK)
        while pos < end:
            n = os.pwrite(fd, mv[pos:end], pos)
            if n <= 0:
                raise OSError(f"short write at byte {pos}")
            pos += n

    with ThreadPoolExecutor(WRITE_THREADS) as pool:
        list(pool.map(put, range(0, length, CHUNK)))


READ_PIECE = 64 << 20  # bytes per parallel read
READ_THREADS = 4


def _header(raw: bytes) -> tuple[dict, dict]:
    """``(metadata, {tensor name: spec})`` of a JSON header, checked in shape: a damaged
    header (a flipped bit) is a ``ValueError`` saying what is wrong, never a ``KeyError``
    or ``TypeError`` further on. Bad JSON or UTF-8 raises ``ValueError`` subclasses."""
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError(f"the shard header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else meta
        raise ValueError(f"not a shadow shard file (format {fmt!r})")
    for name, spec in header.items():
        if not isinstance(spec, dict) or spec.get("dtype") not in _DTYPES:
            dtype = spec.get("dtype") if isinstance(spec, dict) else spec
            raise ValueError(f"tensor {name!r} has a malformed entry or an unsupported dtype ({dtype!r})")
        off = spec.get("data_offsets")
        if not (
            isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in off)
        ):
            raise ValueError(f"tensor {name!r}: data_offsets {off!r} is not a pair of byte offsets")
    return meta, header


def _libc():
    """libc through ctypes, for ``mmap``/``mincore``/``munmap`` (None where there is none)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def resident_pages(fd: int, size: int) -> np.ndarray | None:
    """Which of the file's pages the page cache holds (``mincore`` of a read-only mapping: no
    I/O, nothing read), or None where that cannot be told (then every page is read past the
    cache)."""
    if _LIBC is None or size <= 0:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = np.zeros(-(-size // PAGE), dtype=np.uint8)
        if _LIBC.mincore(addr, size, vec.ctypes.data) != 0:
            return None
        return (vec & 1).astype(bool)
    finally:
        _LIBC.munmap(addr, size)


def _cached_prefix(resident: np.ndarray | None, pos: int, nbytes: int) -> int:
    """How many bytes from ``pos`` lie in pages the page cache held (whole pages, up to ``nbytes``)."""
    if resident is None or pos % PAGE:
        return 0
    first = pos // PAGE
    pages = resident[first : first + -(-nbytes // PAGE)]
    missing = np.flatnonzero(~pages)
    whole = len(pages) if not len(missing) else int(missing[0])
    return min(nbytes, whole * PAGE)


def read_into(path: str, target: Callable[[str, np.dtype, int], np.ndarray | None]) -> tuple[dict, dict, int, int]:
    """Read a local shard file straight into caller-provided arrays, in parallel pieces.

    ``target(name, dtype, count)`` returns where tensor ``name`` goes (or None for a
    fresh array). Returns ``(metadata, tensors, checksum, file_size)``; the checksum is
    the same xxh3 of the whole file that the writer recorded.
    """
    fd = os.open(path, os.O_RDONLY)
    dfd = None
    if getattr(os, "O_DIRECT", 0):
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            dfd = None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ValueError("shard file is shorter than its header length field")
        (hlen,) = struct.unpack("<Q", head)
        if 8 + hlen > size:
            raise ValueError("shard file header runs past the end of the file")
        raw = os.pread(fd, hlen, 8)
        meta, header = _header(raw)
        base = 8 + hlen
        tensors: dict[str, np.ndarray] = {}
        pieces: list[tuple[np.ndarray, int]] = []  # (where, file position)
        for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = spec["data_offsets"]
            dt = np.dtype(_DTYPES[spec["dtype"]])
            if not 0 <= lo <= hi <= size - base or (hi - lo) % dt.itemsize:
                raise ValueError(f"tensor {name!r} lies outside the shard file")
            count = (hi - lo) // dt.itemsize
            arr = target(name, dt, count)
            if arr is None:
                arr = np.empty(count, dtype=dt)
            if arr.dtype != dt or arr.size != count:
                raise ValueError(f"tensor {name!r} is {spec['dtype']} x {count}, not what the layout expects")
            tensors[name] = arr
            flat = arr.view(np.uint8)
            pieces += [(flat[o : o + READ_PIECE], base + lo + o) for o in range(0, hi - lo, READ_PIECE)]
        resident = resident_pages(fd, size) if dfd is not None else None
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda piece: _read_span(fd, dfd, piece[0], piece[1], resident), pieces))
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(raw)
    for arr in tensors.values():  # offset order, back to back: the file's bytes
        h.update(arr.view(np.uint8).data)
    return meta, tensors, h.intdigest(), size


def _read_span(fd: int, dfd: int | None, view: np.ndarray, pos: int, resident: np.ndarray | None) -> None:
    """Fill ``view`` with the file's bytes from ``pos``: the leading pages the page cache held
    (``resident``) copied from there, the page-aligned rest past it with ``O_DIRECT``
    (``dfd``) where the buffer allows, the remainder buffered."""
    if dfd is not None:
        done = _cached_prefix(resident, pos, len(view))
        if done:
            got = os.preadv(fd, [view[:done].data], pos)
            if got != done:
                raise ValueError(f"shard file ended early at byte {pos + got}")
        view, pos = view[done:], pos + done
        body = len(view) - len(view) % PAGE
        if body and pos % PAGE == 0 and view.ctypes.data % PAGE == 0:
            try:
                got = os.preadv(dfd, [view[:body].data], pos)
            except OSError:  # the file system refused O_DIRECT after all
                got = os.preadv(fd, [view[:body].data], pos)
            if got != body:
                raise ValueError(f"shard file ended early at byte {pos + got}")
            view, pos = view[body:], pos + body
    if len(view):
        got = os.preadv(fd, [view.data], pos)
        if got != len(view):
            raise ValueError(f"shard file ended early at byte {pos + got}")


def tensor_specs(
    data: bytes | memoryview, size: int | None = None
) -> tuple[dict, int, list[tuple[str, np.dtype, int, int]]]:
    """``(metadata, data_start, [(name, dtype, lo, hi), ...] in offset order)`` of a shard
    file whose first bytes are ``data`` (at least the header) and whose length is ``size``
    (``len(data)`` by default); offsets are relative to ``data_start``. Validated."""
    mv = memoryview(data)
    size = len(mv) if size is None else size
    if len(mv) < 8:
        raise ValueError("shard file is shorter than its header length field")
    (hlen,) = struct.unpack_from("<Q", mv)
    if 8 + hlen > min(size, len(mv)):
        raise ValueError("shard file header runs past the end of the file")
    meta, header = _header(bytes(mv[8 : 8 + hlen]))
    base = 8 + hlen
    specs = []
    for name, spec in header.items():
        lo, hi = spec["data_offsets"]
        if spec.get("dtype") not in _DTYPES:
            raise ValueError(f"tensor {name!r} has an unsupported dtype {spec.get('dtype')!r}")
        dt = np.dtype(_DTYPES[spec["dtype"]])
        if not 0 <= lo <= hi <= size - base or (hi - lo) % dt.itemsize:
            raise ValueError(f"tensor {name!r} lies outside the shard file")
        specs.append((name, dt, lo, hi))
    specs.sort(key=lambda s: s[2])
    return meta, base, specs


def parse(data: bytes | memoryview) -> tuple[dict, dict[str, np.ndarray]]:
    """``(metadata, tensors)`` of a shard file image (validated, zero-copy views)."""
    mv = memoryview(data)
    meta, base, specs = tensor_specs(mv)
    return meta, {name: np.frombuffer(mv[base + lo : base + hi], dtype=dt) for name, dt, lo, hi in specs}
