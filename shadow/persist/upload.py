"""Worker side of the remote tier: copying a checkpoint a shard's writer
(:class:`~shadow.persist.writer.ShardPersister`) wrote to the local tier up to the remote one.

The remote tier gets the local file as it is when both tiers agree on compressing or not
(when both compress, the local tier's level stands: recompressing gains next to nothing,
byte planes leave little for a higher level to find); otherwise the copy compresses a plain
local file or decompresses a compressed one on the way. A report's ``bytes``/``checksum``
describe the file as the remote tier stores it; ``raw_bytes`` is the plain image's size.

What the uploader knows of its writer is explicit: the fixed facts of the copies
(:class:`RemoteCopy`) and the two calls it makes on the writer (:class:`CopySource`).

Lifetime: the upload thread sees its writer through a weak reference, holding it only
while copying, so it never keeps a writer alive once its owner lets go; the thread ends
then, or at :meth:`Uploader.stop`.
"""

from __future__ import annotations

import logging
import posixpath
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shadow.config.tuning import Tuning
from shadow.persist import checkpoints, failed, zshard
from shadow.storage import Codec, Storage, storage_for
from shadow.wire.commit import Persisted

logger = logging.getLogger(__name__)

_STOP = None  # ends the upload thread


@dataclass(frozen=True)
class RemoteCopy:
    """What copying one shard's checkpoints to the remote tier needs to know, fixed for the
    writer's life: the remote tier (``url``, its back end's fsspec ``options``, the
    permissions of what it creates where it is a local path), both tiers' codecs, the
    compression knobs (``tuning``), and whose shard it is (``job``, its lineage
    ``generation``, ``shard`` and that shard's ``file`` name on the remote tier)."""

    url: str
    options: dict[str, Any]
    file_mode: int
    dir_mode: int
    local_codec: Codec
    remote_codec: Codec
    tuning: Tuning
    job: str
    generation: int
    shard: int
    file: str


class CopySource(Protocol):
    """What the upload thread asks of the writer whose checkpoints it copies."""

    def local_path(self, iteration: int) -> str:
        """The local tier's file of this shard's checkpoint of ``iteration``."""
        ...

    def report(self, iteration: int, epoch: int, tier: str, ok: bool, error: str, **kw: Any) -> Persisted:
        """The ``persisted`` report of this shard's copy of ``iteration`` on ``tier``."""
        ...


class Uploader:
    """The remote-tier copies of one shard's writer: ``copy`` says what they are, ``source``
    is the writer (held weakly), ``results`` the writer's report queue.

    Threads: the writer calls :meth:`request`, :meth:`storage` (from its warm-up thread)
    and :meth:`stop`; one ``shadow-upload`` thread copies the requests, one at a time, and
    puts each report on ``results``. They share only the request queue (thread-safe) and
    the remote storage, made once on first use."""

    def __init__(self, copy: RemoteCopy, source: CopySource, results: queue.Queue) -> None:
        self.copy = copy
        self._results = results
        self._storage: Storage | None = None
        self._requests: queue.Queue = queue.Queue()
        self.thread = threading.Thread(
            target=self._loop, args=(weakref.ref(source),), name="shadow-upload", daemon=True
        )
        self.thread.start()
        weakref.finalize(source, self._requests.put, _STOP)  # dropped without close(): the thread ends too

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
            c = self.copy
            self._storage = storage_for(c.url, c.file_mode, c.dir_mode, c.options)
        return self._storage

    def _loop(self, ref: weakref.ref) -> None:
        """The upload thread: copies requests until :data:`_STOP` or until the writer
        behind ``ref`` is gone (it holds the writer only while copying)."""
        while True:
            item = self._requests.get()
            source = ref() if item is not _STOP else None
            if source is None:
                return
            self._upload(source, *item)
            del source

    def _upload(self, source: CopySource, iteration: int, epoch: int, nbytes: int, csum: str) -> None:
        t0 = time.monotonic()
        c = self.copy
        src = source.local_path(iteration)
        dst = posixpath.join(checkpoints.checkpoint_dir(c.url, c.job, iteration, c.generation), c.file)
        try:
            remote = self.storage()
            path = remote.join(c.job, checkpoints.dir_name(iteration, c.generation), c.file)
            remote.makedirs(posixpath.dirname(path))
            nbytes, csum, raw = self._copy(src, remote, path, nbytes, csum)
            rep = source.report(
                iteration,
                epoch,
                "remote",
                True,
                "",
                bytes=nbytes,
                checksum=csum,
                seconds=time.monotonic() - t0,
                file=c.file,
                raw_bytes=raw,
            )
        except Exception as exc:  # fsspec back ends raise many types
            error = failed.write_error(exc, "remote", dst)
            logger.error("copying iteration %d shard %d to %s failed: %s", iteration, c.shard, dst, error)
            rep = source.report(iteration, epoch, "remote", False, error)
        self._results.put(rep)

    def _copy(self, src: str, remote: Storage, path: str, nbytes: int, csum: str) -> tuple[int, str, int]:
        """Copy the local shard file to ``path`` on ``remote`` in the remote tier's format;
        returns ``(bytes, checksum, plain image bytes)`` of what the remote tier now stores."""
        c = self.copy
        lc, rc, level = c.local_codec.compress, c.remote_codec.compress, c.remote_codec.level
        if lc == rc:
            remote.put_file(src, path)
            return nbytes, csum, nbytes if lc == "none" else zshard.image_bytes(np.memmap(src, np.uint8, mode="r"))
        data = np.memmap(src, dtype=np.uint8, mode="r")
        with remote.open(path, "wb") as out:
            if rc == "zstd":  # compress while copying
                n, h = zshard.encode(
                    data, out, level, c.tuning.compress_threads, c.tuning.compress_block_bytes, where=src
                )
                raw = data.size
            else:  # a plain remote copy of a compressed local file: rebuilt and checked block by block
                n, h = zshard.decode_to(data, out, where=src)
                raw = n
        return n, f"{h:016x}", raw
