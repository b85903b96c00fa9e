"""Reading a shard file back: sources below, encodings above, one checked path between.

A **source** (:class:`ShardSource`) is where a shard file's bytes come from: a tier's
:class:`~shadow.storage.Storage` (:class:`StorageFile`), or the copies of a node-local
tier on the holders' disks, read here or through their workers
(:class:`shadow.restore.copies.ShardCopies`). Each can stream the plain encoding into
place (``read_into``) and hand over the whole file (``read_all``).

An **encoding** is how the file lays the tensors out: plain (``*.safetensors``,
:mod:`shardfile`) or float planes under zstd (``*.shard.zst``, :mod:`zshard`).
:func:`read_shard` is the one place that picks the encoding, and the one place that holds
what came against the manifest (size, checksum, the range and iteration the file says it
holds). Every tensor lands where ``target(name, dtype, count)`` says (the snapshot's flat
arrays) or, where ``target`` declines it, in an array of its own; the returned dict names
them all."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Protocol

import numpy as np

from shadow.core.errors import CheckpointError
from shadow.persist import shardfile, zshard
from shadow.storage import Storage
from shadow.wire.frames import checksum

#: ``target(name, dtype, count)``: the array a tensor goes into, or None to keep it apart
Target = Callable[[str, np.dtype, int], "np.ndarray | None"]


class ShardSource(Protocol):
    """Where one shard file's bytes come from. ``read_into`` streams a plain file as
    :func:`shardfile.read_into` does (returns ``(metadata, tensors, xxh3, size)``);
    ``read_all`` returns the file's bytes. ``where`` names it in errors. Whatever fails
    raises: :class:`CheckpointError` (or ``OSError``, which :func:`read_shard` names). A
    source that tries several copies may have put bytes of a bad one into ``target``'s
    arrays; the copy it returns has put all of its own there."""

    where: str

    def read_into(self, target: Target) -> tuple[dict, dict, int, int]: ...

    def read_all(self) -> bytes: ...


class StorageFile:
    """Shard file ``name`` of checkpoint directory ``directory`` on ``storage``, ``size``
    bytes by its manifest. It is vouched for (a regular file inside the directory, of that
    size: :meth:`Storage.shard_file`) before a byte is read. On the local file system a plain
    file is read in parallel straight into place; elsewhere it is fetched whole, then placed."""

    def __init__(self, storage: Storage, directory: str, name: str, size: int) -> None:
        self.storage, self.directory, self.name, self.size = storage, directory, name, size
        self.where = posixpath.join(directory, name)

    def _path(self) -> str:
        return self.storage.shard_file(self.directory, self.name, self.size)  # ValueError: not that file

    def read_into(self, target: Target) -> tuple[dict, dict, int, int]:
        path = self._path()
        os_path = self.storage.os_path(path)
        if os_path is not None:
            return shardfile.read_into(os_path, target)
        data = self.storage.cat(path, start=0, end=self.size)
        meta, tensors = shardfile.parse(data)
        for name, t in tensors.items():
            into = target(name, t.dtype, len(t))
            if into is not None:
                into[:] = t
                tensors[name] = into
        return meta, tensors, checksum(data), len(data)

    def read_all(self) -> bytes:
        return self.storage.cat(self._path(), start=0, end=self.size)


def read_shard(
    source: ShardSource, shard: dict, iteration: int, target: Target, check: bool, where: str
) -> tuple[dict, dict]:
    """Shard ``shard`` (its manifest entry) from ``source``, in whichever encoding its file
    name says: ``(metadata, tensors)``, every byte held against the
    manifest (size always; the checksum unless ``check`` is off: a compressed file's blocks
    are checked as they decode either way), and the range and ``iteration`` it says it holds."""
    try:
        if zshard.is_compressed(shard["file"]):
            data = read_checked(source, shard, check, where)
            try:
                meta, tensors = zshard.decode(data, target, where=f"{where} ({source.where})")
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
        else:
            try:
                meta, tensors, csum, size = source.read_into(target)
            except ValueError as exc:
                raise CheckpointError(f"{where} ({source.where}): {exc}") from None
            _hold(shard, size, csum, check, f"{where} ({source.where})")
    except FileNotFoundError:
        raise CheckpointError(f"{where} file {source.where} is missing") from None
    except OSError as exc:  # unreadable (permissions, I/O error)
        raise CheckpointError(f"{where} file {source.where} cannot be read: {exc}") from None
    if (int(meta["start"]), int(meta["stop"]), int(meta["iteration"])) != (shard["start"], shard["stop"], iteration):
        raise CheckpointError(f"{where} holds another range or iteration")
    return meta, tensors


def read_checked(source: ShardSource, shard: dict, check: bool, where: str) -> bytes:
    """The whole file of ``shard`` from ``source``, held against its manifest entry (size;
    checksum unless ``check`` is off)."""
    try:
        data = source.read_all()
    except FileNotFoundError:
        raise CheckpointError(f"{where} file {source.where} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{where} file {source.where} cannot be read: {exc}") from None
    except ValueError as exc:  # not the manifest's file (shardguard)
        raise CheckpointError(f"{where} ({source.where}): {exc}") from None
    _hold(shard, len(data), checksum(data) if check else 0, check, f"{where} ({source.where})")
    return data


def _hold(shard: dict, size: int, csum: int, check: bool, where: str) -> None:
    if size != shard["bytes"]:
        raise CheckpointError(f"{where} is {size} bytes, manifest says {shard['bytes']}")
    if check and f"{csum:016x}" != shard["checksum"]:
        raise CheckpointError(f"{where} fails its checksum: the file is corrupt")
