"""Worker side of the remote tier: copying a checkpoint a
:class:`~shadow.persist.writer.ShardPersister` wrote to the local tier up to the remote one.

The remote tier gets the local file as it is when both tiers agree on compressing or not
(when both compress, the local tier's level stands: recompressing gains next to nothing,
byte planes leave little for a higher level to find); otherwise the copy compresses a plain
local file or decompresses a compressed one on the way. A report's ``bytes``/``checksum``
describe the file as the remote tier stores it; ``raw_bytes`` is the plain image's size.

Lifetime: the upload thread sees its persister through a weak reference, holding it only
while copying, so it never keeps a persister alive once its owner lets go; the thread ends
then, or at :meth:`Uploader.stop`.
"""

from __future__ import annotations

import logging
import posixpath
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from shadow.persist import checkpoints, failed, zshard
from shadow.storage import Storage, storage_for

if TYPE_CHECKING:
    from shadow.persist.writer import ShardPersister

logger = logging.getLogger(__name__)

_STOP = None  # ends the upload thread


class Uploader:
    """The remote-tier copies of one :class:`~shadow.persist.writer.ShardPersister`.

    Threads: the persister calls :meth:`request`, :meth:`storage` (from its warm-up thread)
    and :meth:`stop`; one ``shadow-upload`` thread copies the requests, one at a time, and
    puts each report on ``results`` (the persister's report queue). They share only the
    request queue (thread-safe) and the remote storage, made once on first use."""

    def __init__(self, owner: ShardPersister, results: queue.Queue) -> None:
        self.remote, self.options = owner.remote, owner.remote_options
        self.file_mode, self.dir_mode = owner.file_mode, owner.dir_mode  # where the remote tier is a local path
        self.local_codec, self.remote_codec, self.tuning = owner.local_codec, owner.remote_codec, owner.tuning
        self._results = results
        self._storage: Storage | None = None
        self._requests: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, args=(weakref.ref(owner),), name="shadow-upload", daemon=True)
        self.thread.start()
        weakref.finalize(owner, self._requests.put, _STOP)  # dropped without close(): the thread ends too

    def request(self, iteration: int, epoch: int, nbytes: int, checksum: str) -> None:
        """Copy the local checkpoint of ``iteration`` (``nbytes``, ``checksum`` as written)."""
        self._requests.put((iteration, epoch, nbytes, checksum))

    def stop(self) -> threading.Thread:
        """Drop the copies not started yet and end the thread; returns it (to be joined)."""
        while True:
            try:
                self._requests.get_nowait()
            except queue.Empty:
                break
        self._requests.put(_STOP)
        return self.thread

    def storage(self) -> Storage:
        """The remote tier's storage (made on first use: loading a back end may take a while)."""
        if self._storage is None:
            self._storage = storage_for(self.remote, self.file_mode, self.dir_mode, self.options)
        return self._storage

    def _loop(self, ref: weakref.ref) -> None:
        """The upload thread: copies requests until :data:`_STOP` or until the persister
        behind ``ref`` is gone (it holds the persister only while copying)."""
        while True:
            item = self._requests.get()
            persister = ref() if item is not _STOP else None
            if persister is None:
                return
            self._upload(persister, *item)
            del persister

    def _upload(self, owner: ShardPersister, iteration: int, epoch: int, nbytes: int, csum: str) -> None:
        t0 = time.monotonic()
        src = owner.local_path(iteration)
        name = owner.file_name("remote")
        dst = posixpath.join(checkpoints.checkpoint_dir(self.remote, owner.job, iteration, owner.generation), name)
        try:
            remote = self.storage()
            path = remote.join(owner.job, checkpoints.dir_name(iteration, owner.generation), name)
            remote.makedirs(posixpath.dirname(path))
            nbytes, csum, raw = self._copy(src, remote, path, nbytes, csum)
            rep = owner.report(
                iteration,
                epoch,
                "remote",
                True,
                "",
                bytes=nbytes,
                checksum=csum,
                seconds=time.monotonic() - t0,
                file=name,
                raw_bytes=raw,
            )
        except Exception as exc:  # fsspec back ends raise many types
            error = failed.write_error(exc, "remote", dst)
            logger.error("copying iteration %d shard %d to %s failed: %s", iteration, owner.shard, dst, error)
            rep = owner.report(iteration, epoch, "remote", False, error)
        self._results.put(rep)

    def _copy(self, src: str, remote: Storage, path: str, nbytes: int, csum: str) -> tuple[int, str, int]:
        """Copy the local shard file to ``path`` on ``remote`` in the remote tier's format;
        returns ``(bytes, checksum, plain image bytes)`` of what the remote tier now stores."""
        lc, rc, level = self.local_codec.compress, self.remote_codec.compress, self.remote_codec.level
        if lc == rc:
            remote.put_file(src, path)
            return nbytes, csum, nbytes if lc == "none" else zshard.image_bytes(np.memmap(src, np.uint8, mode="r"))
        data = np.memmap(src, dtype=np.uint8, mode="r")
        with remote.open(path, "wb") as out:
            if rc == "zstd":  # compress while copying
                n, h = zshard.encode(
                    data, out, level, self.tuning.compress_threads, self.tuning.compress_block_bytes, where=src
                )
                raw = data.size
            else:  # a plain remote copy of a compressed local file: rebuilt and checked block by block
                n, h = zshard.decode_to(data, out, where=src)
                raw = n
        return n, f"{h:016x}", raw
