"""Worker side of persistence: snapshot the range at an iteration boundary into the
preallocated shard image, write it in a background thread, copy it to the remote tier.

Call order (worker main thread): ``snapshot(k)`` right after applying k (a copy into a
free image; replay continues while a thread writes it) -> ``results()`` each loop turn,
whose reports go to the coordinator. ``SHADOW_PERSIST_BUFFERS`` images are preallocated;
a snapshot requested while all are being written is reported as skipped (the coordinator
then asks again at the next cut).

Compression is per tier (``compress``/``compress_level`` of its config) and runs only on
the background threads, never on the apply path: a compressing local tier writes
``*.shard.zst`` (:mod:`zshard`) instead of the plain file; the copy to the remote tier
(:mod:`~shadow.persist.upload`) converts it when the tiers differ. Every report's
``bytes``/``checksum`` describe the file as stored on that tier; ``raw_bytes`` is the
plain image's size.

Lifetime: the threads hold no reference that keeps a persister alive once its owner
lets go (the upload thread sees it through a weak reference); :meth:`close` -- the
worker calls it when the session is replaced or the worker stops -- ends them, waits
for a write in flight (bounded by ``SHADOW_PERSIST_CLOSE_S``; one still running then
is abandoned: its file never gets a manifest) and drops the images.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from shadow.config.tuning import Tuning
from shadow.persist import checkpoints, disks, failed, shardfile, zshard
from shadow.persist.upload import RemoteCopy, Uploader
from shadow.storage import Codec, LocalStorage
from shadow.wire.commit import Persisted

if TYPE_CHECKING:
    from shadow.config import PersistConfig

logger = logging.getLogger(__name__)

SKIPPED = "skipped: earlier checkpoint writes are still running"


class ShardPersister:
    """A worker's checkpoint writer for one session's range.

    Threads: the worker's main thread calls :meth:`snapshot` / :meth:`begin` /
    :meth:`finish` / :meth:`abandon`, :meth:`upload`, :meth:`results` and :meth:`close`.
    Each write runs on its own ``shadow-persist`` thread that owns its image until it gives
    it back to the free list; one ``shadow-upload`` thread (its :class:`~shadow.persist.upload.Uploader`)
    copies to the remote tier; the warm-up thread holds one image at a time. They share only
    the free list, the report and upload queues (thread-safe) and ``_threads`` (under ``_lock``).

    ``persist`` is the cluster's typed config (a worker rebuilds it from the coordinator's
    message: :meth:`~shadow.config.PersistConfig.from_dict`); ``generation`` is the job's
    lineage (:func:`~shadow.persist.checkpoints.write_generation`)."""

    def __init__(
        self,
        persist: PersistConfig,
        job: str,
        shard: int,
        nshards: int,
        state,
        generation: int = 0,
        tuning: Tuning | None = None,
    ) -> None:
        self.tuning = tuning if tuning is not None else Tuning.load()
        self.local = persist.local.dir
        self.remote = persist.remote.url
        self.remote_options = dict(persist.remote.options)  # the back end's fsspec storage options
        self.local_codec = Codec(persist.local.compress, persist.local.compress_level)
        self.remote_codec = Codec(persist.remote.compress, persist.remote.compress_level)
        # the local tier is a directory on this host (PersistConfig checks it); the remote one any
        # storage, whose back end loads on the background threads (the warm-up or the first upload).
        # What either creates on a local file system gets persist.mode's permissions (0600/0700)
        self.file_mode, self.dir_mode = persist.file_mode, persist.dir_mode
        self._local_storage = LocalStorage(self.local or ".", self.file_mode, self.dir_mode)
        # which disk the copies go to, for the manifest (node-local tiers: each worker its own)
        self.disk = disks.describe(self.local, self.file_mode, self.dir_mode) if self.local else None
        self.job, self.shard, self.nshards, self.state = job, shard, nshards, state
        self.generation = generation
        n, p = state.size, len(state.layout.params)
        big = len(state.fields()) * n * 4
        count = self.tuning.persist_buffers if self.local else 0
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(shardfile.ShardImage(big + p * 17 + (1 << 20)))
        self._results: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # writes (and the warm-up) in flight
        self._closed = False
        self._warming = False  # the warm-up holds an image for a moment
        self._uploader = Uploader(self._remote_copy(), self, self._results) if self.remote else None
        if count:
            self._start(self._warm_up, (), "shadow-persist-warm-up")

    def _remote_copy(self) -> RemoteCopy:
        """What the uploader needs to know of this writer's copies to the remote tier."""
        return RemoteCopy(
            url=self.remote,
            options=self.remote_options,
            file_mode=self.file_mode,
            dir_mode=self.dir_mode,
            local_codec=self.local_codec,
            remote_codec=self.remote_codec,
            tuning=self.tuning,
            job=self.job,
            generation=self.generation,
            shard=self.shard,
            file=self.file_name("remote"),
        )

    def file_name(self, tier: str = "local") -> str:
        codec = self.local_codec if tier == "local" else self.remote_codec
        return checkpoints.shard_name(self.shard, self.nshards, codec.compress)

    def local_path(self, iteration: int) -> str:
        name = checkpoints.dir_name(iteration, self.generation)
        return self._local_storage.join(self.job, name, self.file_name())

    def snapshot(
        self,
        iteration: int,
        epoch: int,
        world: int,
        blobs: dict[int, bytes],
        commit: dict | None,
        extras: dict | None = None,
    ) -> None:
        """Copy the range as of ``iteration`` into an image and start writing it (or report
        it skipped, as :meth:`begin` does)."""
        img = self.begin(iteration, epoch, world, blobs, extras)
        if img is None:
            return
        for f, view in self.field_views(img).items():
            np.copyto(view, self.state.array(f), casting="no")
        self.finish(img, iteration, epoch, blobs, commit, extras)

    def begin(
        self, iteration: int, epoch: int, world: int, blobs: dict[int, bytes], extras: dict | None = None
    ) -> shardfile.ShardImage | None:
        """Take a free image and lay it out for the range; None (reported as skipped) when
        every image is still being written. The caller fills the fields -- by copying, or
        in the apply pass of ``iteration`` itself (:meth:`field_views`) -- then calls
        :meth:`finish`, or :meth:`abandon`."""
        img = self._take()
        if img is None:
            self._results.put(self.report(iteration, epoch, "local", False, SKIPPED, skipped=True))
            return None
        st = self.state
        nparams = int(st.in_range.sum())
        entries = [shardfile.Entry(f.name.lower(), "F32", st.size) for f in st.fields()]
        entries += [
            shardfile.Entry("param_index", "I64", nparams),
            shardfile.Entry("steps", "F64", nparams),
            shardfile.Entry("has_state", "U8", nparams),
        ]
        entries += [shardfile.Entry(f"commit.rank{r}", "U8", len(b)) for r, b in sorted(blobs.items())]
        # this worker's chunks of the model state outside the optimizer (trainer_hooks.capture.extras): every
        # checkpoint holds the whole set, however long ago a chunk last changed
        entries += [shardfile.Entry(f"extra.{k}", "U8", len(b)) for k, b in sorted((extras or {}).items())]
        meta = {
            "format": shardfile.FORMAT,
            "job": self.job,
            "epoch": str(epoch),
            "iteration": str(iteration),
            "start": str(st.start),
            "stop": str(st.stop),
            "shard": str(self.shard),
            "shards": str(self.nshards),
            "layout_hash": f"{st.layout.hash:016x}",
            "world": str(world),
        }
        img.layout(entries, meta)
        return img

    def field_views(self, img: shardfile.ShardImage) -> dict:
        """Field -> its array in ``img`` (laid out by :meth:`begin`)."""
        return {f: img.view(f.name.lower()) for f in self.state.fields()}

    def finish(
        self,
        img: shardfile.ShardImage,
        iteration: int,
        epoch: int,
        blobs: dict[int, bytes],
        commit: dict | None,
        extras: dict | None = None,
    ) -> None:
        """Fill the per-parameter metadata (as of now: after ``iteration`` applied) and the
        commit blobs, and start the background write."""
        st = self.state
        idx = np.flatnonzero(st.in_range).astype(np.int64)
        img.fill("param_index", idx)
        img.fill("steps", st.steps[idx])
        img.fill("has_state", st.has_state[idx].astype(np.uint8))
        for r, b in blobs.items():
            img.fill(f"commit.rank{r}", np.frombuffer(b, dtype=np.uint8))
        for k, b in (extras or {}).items():
            img.fill(f"extra.{k}", np.frombuffer(b, dtype=np.uint8))
        extra = {"commit": commit, "blob_ranks": sorted(blobs)}
        self._start(self._write, (img, iteration, epoch, extra), "shadow-persist")

    def abandon(self, img: shardfile.ShardImage) -> None:
        """Give an image taken by :meth:`begin` back unwritten."""
        self._give_back(img)

    def _take(self) -> shardfile.ShardImage | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if not self._warming:
            return None
        try:  # the warm-up is faulting in an image's pages: wait for it (a heartbeat at most) rather than skip
            return self._free.get(timeout=self.tuning.heartbeat_s)
        except queue.Empty:
            return None

    def _give_back(self, img: shardfile.ShardImage) -> None:
        with self._lock:
            if not self._closed:  # after close() the image is dropped
                self._free.put(img)

    def _start(self, target, args: tuple, name: str) -> None:
        th = threading.Thread(target=self._run, args=(target, args), name=name, daemon=True)
        with self._lock:
            self._threads.add(th)
        th.start()

    def _run(self, target, args: tuple) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _warm_up(self) -> None:
        """Pay the first-write costs before the first checkpoint: fault in the images'
        pages (otherwise the first snapshot into each pays them on the apply path), create
        the job's directory and probe it with a one-page ``O_DIRECT`` write, fsync and
        unlink; with a remote tier, load its fsspec back end. Takes one image at a time
        off the free list (a snapshot that finds none free meanwhile waits a heartbeat
        period for it, then is skipped)."""
        t0 = time.monotonic()
        self._warming = True
        try:
            for _ in range(self._free.qsize()):
                if self._closed:
                    return
                try:
                    img = self._free.get_nowait()
                except queue.Empty:
                    break
                try:
                    img.buf[:: shardfile.PAGE] = 0  # one byte per page faults the page in
                finally:
                    self._give_back(img)
        finally:
            self._warming = False
        try:  # one page the way every shard is written: .tmp, O_DIRECT, fsync, rename, directory fsync
            probe = os.path.join(os.path.dirname(os.path.dirname(self.local_path(0))), f".warm-up-{self.shard}")
            page = shardfile.ShardImage(shardfile.PAGE)
            page.buf[:] = 0
            page.size = shardfile.PAGE
            self._local_storage.write_image(probe, page)  # the job's directory, with the tier's permissions
            os.unlink(probe)
            if self._uploader is not None:
                self._uploader.storage()
        except Exception as exc:  # the first real write reports the same problem, with its iteration
            logger.warning("warming up the checkpoint writer under %s failed: %s", self.local, exc)
            return
        logger.debug("checkpoint writer of shard %d warmed up in %.3f s", self.shard, time.monotonic() - t0)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the threads and release the images: queued uploads are dropped, a write
        or copy in flight gets ``timeout`` seconds (``SHADOW_PERSIST_CLOSE_S``) to finish,
        and is abandoned after that (its report is never read, so its file never enters
        a manifest). Idempotent; returns whether every thread ended in time."""
        if timeout is None:
            timeout = self.tuning.persist_close_s
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            threads = list(self._threads)
        if self._uploader is not None:  # uploads not started yet are dropped
            threads.append(self._uploader.stop())
        deadline = time.monotonic() + timeout
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        left = [th.name for th in threads if th.is_alive()]
        while True:  # the images
            try:
                self._free.get_nowait()
            except queue.Empty:
                break
        self.results()
        if left:
            logger.warning(
                "shard %d: abandoning %s still running after %.1f s; their results are discarded",
                self.shard,
                ", ".join(left),
                timeout,
            )
        return not left

    def _write(self, img: shardfile.ShardImage, iteration: int, epoch: int, extra: dict) -> None:
        t0 = time.monotonic()
        path = self.local_path(iteration)
        try:
            if self.local_codec.compress == "none":
                csum = img.checksum()
                nbytes = self._local_storage.write_image(path, img)
            else:
                nbytes, csum = zshard.write(
                    img.buf[: img.size],
                    path,
                    self.local_codec.level,
                    self.tuning.compress_threads,
                    self.tuning.compress_block_bytes,
                    self.file_mode,
                    self.dir_mode,
                )
            rep = self.report(
                iteration,
                epoch,
                "local",
                True,
                "",
                bytes=nbytes,
                checksum=f"{csum:016x}",
                seconds=time.monotonic() - t0,
                raw_bytes=img.size,
                **extra,
            )
            logger.info(
                "persisted iteration %d shard %d: %d bytes (%d raw) in %.3f s",
                iteration,
                self.shard,
                nbytes,
                img.size,
                time.monotonic() - t0,
            )
        except Exception as exc:  # reported to the coordinator; a background thread never raises
            # a full disk says so and what to do; the image goes back to the free list, no
            # partial file stays behind (shardfile/zshard remove their .tmp), and the
            # coordinator asks again at the next cut
            error = failed.write_error(exc, "local", path)
            logger.error("persisting iteration %d to %s failed: %s", iteration, path, error)
            rep = self.report(iteration, epoch, "local", False, error)
        finally:
            self._give_back(img)
        self._results.put(rep)

    def upload(self, iteration: int, epoch: int, nbytes: int, checksum: str) -> None:
        """Copy the local checkpoint of ``iteration`` to the remote tier (reported later)."""
        if self._uploader is not None:
            self._uploader.request(iteration, epoch, nbytes, checksum)

    def report(self, iteration: int, epoch: int, tier: str, ok: bool, error: str, **kw) -> Persisted:
        """The ``persisted`` report of this shard's copy of ``iteration`` on ``tier`` (``kw``:
        the other fields of :class:`~shadow.wire.commit.Persisted`)."""
        return Persisted(
            epoch=epoch,
            iteration=iteration,
            tier=tier,
            shard=self.shard,
            ok=ok,
            error=error,
            file=kw.pop("file", self.file_name()),
            start=self.state.start,
            stop=self.state.stop,
            compress=(self.local_codec if tier == "local" else self.remote_codec).compress,
            disk=self.disk,
            **kw,
        )

    def results(self) -> list[Persisted]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out
