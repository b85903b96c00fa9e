"""A shard's copies on the disks of a node-local tier, read from the first that is intact
(:class:`ShardCopies`): files this host sees and live workers' files sockets
(:mod:`shadow.worker.files`) in one sequence, each checked against the manifest's size
and checksum as it is read. Which copies a shard has is
:class:`~shadow.restore.node_local.ClusterTierSource`'s to find; when every copy fails the
read is a :class:`CopiesFailed` naming each one."""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from shadow.config.tuning import Tuning
from shadow.core.errors import CheckpointError, ShadowError
from shadow.persist import disks as disks_mod
from shadow.persist.shardio import StorageFile
from shadow.restore.files_client import read_file, stream_into
from shadow.storage import storage_for

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class ShardCopy:
    """One copy of a shard: read here from ``path``, or through the worker whose files
    socket is ``endpoint``; ``disk``, ``worker``, ``host`` say whose it is."""

    disk: str
    worker: object
    host: object
    path: str = ""
    endpoint: str = ""
    ticket: bytes | None = None  # mac mode: the coordinator's ticket for that worker's files socket
    key: bytes | None = None  # and its key

    @property
    def auth(self) -> tuple[bytes, bytes] | None:
        return (self.ticket, self.key) if self.ticket is not None and self.key is not None else None

    @property
    def via(self) -> str:
        return f"read here from {self.path}" if self.path else f"through worker {self.worker} at {self.endpoint}"

    def __str__(self) -> str:
        whose = ", ".join(
            [f"worker {self.worker}"] * (self.worker is not None)
            + [f"host {self.host}"] * (self.host is not None)
            + [self.via]
        )
        return f"disk {self.disk or '(unmarked)'} ({whose})"


class CopiesFailed(CheckpointError):
    """No copy of a shard could be read intact: ``tried`` says each copy and why."""

    def __init__(self, where: str, tried: list[tuple[ShardCopy, str]]) -> None:
        self.tried = tried
        super().__init__(f"{where}: no intact copy: " + "; ".join(f"{c}: {why}" for c, why in tried))


class _Bad(Exception):
    """A copy read whole that is not the manifest's file."""


# what a damaged copy raises on the way through a parser (or a worker, or the disk)
_COPY_FAILURES = (ShadowError, _Bad, ValueError, OSError, EOFError, KeyError, TypeError, IndexError, struct.error)


class ShardCopies:
    """A shard's copies (a :class:`~shadow.persist.shardio.ShardSource`), read from the
    first that is intact: files this host sees and workers' files sockets in one sequence.
    A copy that is short, unreadable, does not parse or fails the manifest's checksum is
    passed over for the next; each disk whose file was read here and found bad is not asked
    for again through its worker (the same file). Every copy failing is a
    :class:`CopiesFailed` naming each one tried and why."""

    def __init__(self, copies: list[ShardCopy], job: str, directory: str, shard: dict, tuning: Tuning, where: str):
        self.copies, self.job, self.directory, self.shard, self.tuning = copies, job, directory, shard, tuning
        self.where = where

    def read_into(self, target: Callable) -> tuple[dict, dict, int, int]:
        """As :func:`shadow.persist.shardfile.read_into`: each tensor put in place by ``target``.
        A copy passed over may have put some of its bytes there; the copy that is read
        intact then puts every byte of every tensor there again (its checksum covers them)."""

        def read(c: ShardCopy) -> tuple[tuple[dict, dict, int, int], int, int]:
            if c.path:
                self._size_here(c.path)
                got = self._here(c.path).read_into(target)
            else:
                got = stream_into(c.endpoint, self.job, self.directory, self.shard, target, self.tuning, c.auth)
            return got, got[3], got[2]

        return self._first(read)

    def read_all(self) -> bytes:
        def read(c: ShardCopy) -> tuple[bytes, int, int]:
            if c.path:
                self._size_here(c.path)
                data = self._here(c.path).read_all()
            else:
                data = read_file(c.endpoint, self.job, self.directory, self.shard, self.tuning, c.auth)
            return data, len(data), xxhash.xxh3_64_intdigest(data)

        return self._first(read)

    def _here(self, path: str) -> StorageFile:
        """The copy at ``path`` on this host, as a source the storage layer vouches for."""
        d = os.path.dirname(path)
        return StorageFile(storage_for(d), d, os.path.basename(path), int(self.shard["bytes"]))

    def _size_here(self, path: str) -> None:
        size = os.stat(path).st_size
        if size != int(self.shard["bytes"]):
            raise _Bad(f"is {size} bytes, the manifest says {self.shard['bytes']} (short or damaged)")

    def _first(self, read: Callable[[ShardCopy], tuple[_T, int, int]]) -> _T:
        tried: list[tuple[ShardCopy, str]] = []
        bad_disks: set[str] = set()  # disks whose file was read here and is not the manifest's
        for c in self.copies:
            if c.endpoint and c.disk and c.disk in bad_disks:
                continue
            try:
                got, size, csum = read(c)
                if size != int(self.shard["bytes"]):
                    raise _Bad(f"is {size} bytes, the manifest says {self.shard['bytes']} (short or damaged)")
                if f"{csum:016x}" != self.shard.get("checksum"):
                    raise _Bad("fails its checksum (damaged on that disk)")
            except FileNotFoundError:
                why, same_file = "its file is missing", True
            except _Bad as exc:
                why, same_file = str(exc), True
            except OSError as exc:  # this host may not read it where its worker can
                why, same_file = f"cannot be read here: {exc}", False
            except _COPY_FAILURES as exc:
                why, same_file = (str(exc) if isinstance(exc, ShadowError) else f"{type(exc).__name__}: {exc}"), True
            else:
                if tried:
                    logger.info("%s: read from %s, the copies before it failed", self.where, c)
                return got
            logger.warning("%s: passing over its copy on %s: %s", self.where, c, why)
            tried.append((c, why))
            if c.path and same_file and c.disk:
                bad_disks.add(c.disk)
        raise CopiesFailed(self.where, tried)


def disk_id_of(root: str) -> str:
    """The disk id marked in ``root`` (:mod:`shadow.persist.disks`), or "" (none, unreadable)."""
    try:
        with open(os.path.join(root, disks_mod.MARK), "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""
