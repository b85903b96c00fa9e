"""The storage a persistence tier writes to and a restore reads from: one interface, a
local file system and every fsspec back end behind it.

Paths handed to and returned by a :class:`Storage` are in its own terms (what
:meth:`Storage.join` builds and :meth:`Storage.list` returns): an absolute POSIX path for
the local file system, the back end's path (bucket and key, no protocol) for the others.
"""

from __future__ import annotations

import builtins
import glob
import io
import posixpath
from abc import ABC, abstractmethod
from typing import Any, BinaryIO, Protocol


class Image(Protocol):
    """A shard image ready to be stored (:class:`shadow.persist.shardfile.ShardImage`): its
    first ``size`` bytes of ``buf`` are the file, and ``write(path)`` stores them durably
    on the local file system by its own fastest way (``O_DIRECT``), the file with
    permissions ``file_mode`` and the directories it creates ``dir_mode``."""

    buf: Any
    size: int

    def write(self, path: str, file_mode: int = ..., dir_mode: int = ...) -> int: ...


class Storage(ABC):
    """Where one tier's checkpoints live (``url``: a local directory, a ``file://`` URL or
    any fsspec URL). Made by :func:`shadow.storage.storage_for`, the one place that tells
    local from remote.

    **The interface is five operations** a back end implements: :meth:`read_into` (a range
    into a buffer), :meth:`write_atomic`, :meth:`list`, :meth:`rm` and :meth:`info` (stat).
    Everything else here is built on them; a back end overrides one of those only to be
    faster (one call where the default makes several) or to keep its own rules (the local
    file system's ``O_DIRECT`` images, the tier's permissions, links in a checkpoint
    directory).

    Call order for one checkpoint, as the tiers use it:

    0. ``storage_for(url, file_mode, dir_mode)`` (no I/O; a remote back end loads its client
       lazily; on the local file system, what it creates gets those permissions).
    1. Each worker stores its shard: :meth:`write_image` (the local tier) or
       :meth:`put_file` / :meth:`open` of the local file (the remote copy); :meth:`makedirs`
       first where the back end has directories.
    2. The coordinator commits it with :meth:`write_atomic` of the manifest, written last.
    3. Readers find it with :meth:`list` (a glob pattern built on :meth:`join`), check it
       with :meth:`exists`/:meth:`shard_file`, and read it with :meth:`cat` or
       :meth:`read_into` (:mod:`shadow.persist.shardio` is the only reader of shard files).
    4. Retention and failed writes delete with :meth:`rm`.

    Timeouts: none of its own. A local call blocks on the disk; a remote one on its back
    end's client, whose own timeouts apply (configure them in the URL's storage options).
    Errors are the ``OSError`` family (``FileNotFoundError`` for a missing path) or, for a
    remote store, whatever its client raises: callers that must not fail catch broadly.
    """

    url: str
    base: str  # the root, in this storage's terms
    #: whether this is the local file system (``os_path`` is then the identity)
    local: bool = False

    def join(self, *parts: str) -> str:
        """A path under the root, in this storage's terms."""
        return posixpath.join(self.base, *parts)

    def os_path(self, path: str) -> str | None:
        """``path`` as the operating system names it, where this is the local file system
        (fast paths: ``O_DIRECT``, parallel reads, ``mmap``); None otherwise."""
        return path if self.local else None

    # -- the interface --------------------------------------------------------------------

    @abstractmethod
    def read_into(self, path: str, out: memoryview, offset: int = 0) -> int:
        """Read ``len(out)`` bytes of ``path`` from ``offset`` into ``out``; returns how
        many arrived (fewer at the end of the file)."""

    @abstractmethod
    def write_atomic(self, path: str, data: bytes, parents: bool = False) -> None:
        """Store ``data`` at ``path`` so a reader sees all of it or nothing (tmp, fsync,
        rename, directory fsync where the storage has them); ``parents`` creates the
        directories above it first."""

    @abstractmethod
    def list(self, pattern: str) -> list[str]:
        """Paths matching a glob ``pattern`` (fixed parts escaped with ``glob.escape``)."""

    @abstractmethod
    def rm(self, path: str, recursive: bool = True) -> None:
        """Delete ``path`` (taken literally: glob characters in it are not a pattern)."""

    @abstractmethod
    def info(self, path: str) -> dict:
        """fsspec's description of ``path`` (``name``, ``type``, ``size``);
        ``FileNotFoundError`` if missing."""

    # -- built on the interface -----------------------------------------------------------

    def cat(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (the whole file by default)."""
        lo = start or 0
        hi = int(self.info(path)["size"]) if end is None else end
        buf = bytearray(max(0, hi - lo))
        n = self.read_into(path, memoryview(buf), lo)
        return bytes(buf[:n])

    def exists(self, path: str) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return self.info(path).get("type") == "directory"
        except FileNotFoundError:
            return False

    def ls(self, path: str) -> builtins.list[dict]:
        """The entries of directory ``path``, described as :meth:`info` does."""
        return [self.info(p) for p in self.list(posixpath.join(glob.escape(path), "*"))]

    def makedirs(self, path: str) -> None:  # noqa: B027 -- optional: keys-only stores have no directories
        """Make directory ``path`` and those above it (nothing where the back end has only keys)."""

    def write_image(self, path: str, image: Image) -> int:
        """Store a shard image at ``path`` durably; returns the bytes written."""
        self.write_atomic(path, bytes(image.buf[: image.size]))
        return image.size

    def put_file(self, src: str, path: str) -> None:
        """Copy local file ``src`` to ``path``."""
        with builtins.open(src, "rb") as f:
            self.write_atomic(path, f.read())

    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        """``path`` as a file: read whole (``"rb"``), or written whole and stored atomically
        on close (``"wb"``)."""
        if mode == "rb":
            return io.BytesIO(self.cat(path))
        if mode == "wb":
            return _Stored(self, path)
        raise ValueError(f"{type(self).__name__}.open takes 'rb' or 'wb', not {mode!r}")

    def move(self, src: str, dst: str) -> None:
        """Move one file (taken literally)."""
        self.write_atomic(dst, self.cat(src))
        self.rm(src, recursive=False)

    def shard_file(self, directory: str, name: str, size: int) -> str:
        """The path of file ``name`` in checkpoint ``directory`` once it is known to be a
        regular file inside it of ``size`` bytes: checked before a byte is read, so a FIFO
        never blocks a reader. ``FileNotFoundError`` if missing, ``ValueError`` saying what
        is wrong otherwise."""
        path = posixpath.join(directory, name)
        info = self.info(path)
        if info.get("type") != "file":
            raise ValueError(f"{path} is not a regular file (a {info.get('type')})")
        if info.get("size") is not None and info["size"] != size:
            raise ValueError(f"{path} is {info['size']} bytes, manifest says {size}")
        return path

    def free_space(self, path: str) -> str:
        """`` (X MiB free of Y MiB)`` of the file system under ``path`` where it can be
        known (the local one), else ``""``: what a full-disk error adds."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class _Stored(io.BytesIO):
    """A file written whole in memory and stored with :meth:`Storage.write_atomic` on close
    (not stored if the ``with`` body raises)."""

    def __init__(self, storage: Storage, path: str) -> None:
        super().__init__()
        self.storage, self.path, self.failed = storage, path, False

    def __exit__(self, kind, value, tb):
        self.failed = kind is not None
        return super().__exit__(kind, value, tb)

    def close(self) -> None:
        if not self.closed and not self.failed:
            self.storage.write_atomic(self.path, self.getvalue())
        super().close()
