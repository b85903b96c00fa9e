"""Worker side of persistence: snapshot the range at an iteration boundary into the
preallocated shard image, write it in a background thread, copy it to the remote tier.

Call order (worker main thread): ``snapshot(k)`` right after applying k (a copy into a
free image; replay continues while a thread writes it) -> ``results()`` each loop turn,
whose reports go to the coordinator. ``SHADOW_PERSIST_BUFFERS`` images are preallocated;
a snapshot requested while all are being written is reported as skipped (the coordinator
then asks again at the next cut).

Compression is per tier (``compress``/``compress_level`` of its config) and runs only on
the background threads, never on the apply path: a compressing local tier writes
``*.shard.zst`` (:mod:`zshard`) instead of the plain file. The remote tier gets the
local file as it is when both tiers agree on compressing or not (when both compress,
the local tier's level stands: recompressing gains next to nothing, byte planes leave
little for a higher level to find); otherwise the upload compresses a plain local file
or decompresses a compressed one while copying it. Every report's ``bytes``/``checksum``
describe the file as stored on that tier; ``raw_bytes`` is the plain image's size.
"""
from __future__ import annotations

import logging
import os
import posixpath
import queue
import threading
import time

import fsspec
import numpy as np

from shadow import knobs
from shadow.persist import catalog, shardfile, zshard

logger = logging.getLogger(__name__)


def tier_codec(cfg: dict) -> tuple[str, int]:
    """``(compress, level)`` of a tier's config dict (``"none"`` when it has no key)."""
    compress = cfg.get("compress", "none") or "none"
    if compress not in ("none", "zstd"):
        raise ValueError(f"compress={compress!r} is not supported; choose 'none' or 'zstd'")
    return compress, int(cfg.get("compress_level", 3))


class ShardPersister:
    def __init__(self, persist: dict, job: str, shard: int, nshards: int, state) -> None:
        self.local = persist["local"]["dir"]
        self.remote = persist["remote"]["url"]
        self.local_codec = tier_codec(persist["local"])
        self.remote_codec = tier_codec(persist["remote"])
        self.job, self.shard, self.nshards, self.state = job, shard, nshards, state
        n, p = state.size, len(state.layout.params)
        big = len(state.fields()) * n * 4
        count = knobs.get_int("PERSIST_BUFFERS") if self.local else 0
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(shardfile.ShardImage(big + p * 17 + (1 << 20)))
        self._results: queue.Queue = queue.Queue()
        self._uploads: queue.Queue = queue.Queue()
        if self.remote:
            threading.Thread(target=self._upload_loop, name="shadow-upload", daemon=True).start()

    def file_name(self, tier: str = "local") -> str:
        codec = self.local_codec if tier == "local" else self.remote_codec
        return catalog.shard_name(self.shard, self.nshards, codec[0])

    def local_path(self, iteration: int) -> str:
        d = catalog.checkpoint_dir(catalog.local_path(self.local), self.job, iteration)
        return os.path.join(d, self.file_name())

    def snapshot(self, iteration: int, epoch: int, world: int, blobs: dict[int, bytes], commit: dict | None) -> None:
        """Copy the range as of ``iteration`` into an image and start writing it."""
        img = self.begin(iteration, epoch, world, blobs)
        if img is None:
            return
        for f, view in self.field_views(img).items():
            np.copyto(view, self.state.array(f), casting="no")
        self.finish(img, iteration, epoch, blobs, commit)

    def begin(self, iteration: int, epoch: int, world: int, blobs: dict[int, bytes]) -> shardfile.ShardImage | None:
        """Take a free image and lay it out for the range; None (reported as skipped) when
        every image is still being written. The caller fills the fields -- by copying, or
        in the apply pass of ``iteration`` itself (:meth:`field_views`) -- then calls
        :meth:`finish`, or :meth:`abandon`."""
        try:
            img = self._free.get_nowait()
        except queue.Empty:
            self._results.put(self.report(iteration, epoch, "local", False,
                                          "skipped: earlier checkpoint writes are still running"))
            return None
        st = self.state
        nparams = int(st.in_range.sum())
        entries = [shardfile.Entry(f.name.lower(), "F32", st.size) for f in st.fields()]
        entries += [shardfile.Entry("param_index", "I64", nparams), shardfile.Entry("steps", "F64", nparams),
                    shardfile.Entry("has_state", "U8", nparams)]
        entries += [shardfile.Entry(f"commit.rank{r}", "U8", len(b)) for r, b in sorted(blobs.items())]
        meta = {"format": shardfile.FORMAT, "job": self.job, "epoch": str(epoch), "iteration": str(iteration),
                "start": str(st.start), "stop": str(st.stop), "shard": str(self.shard),
                "shards": str(self.nshards), "layout_hash": f"{st.layout.hash:016x}", "world": str(world)}
        img.layout(entries, meta)
        return img

    def field_views(self, img: shardfile.ShardImage) -> dict:
        """Field -> its array in ``img`` (laid out by :meth:`begin`)."""
        return {f: img.view(f.name.lower()) for f in self.state.fields()}

    def finish(self, img: shardfile.ShardImage, iteration: int, epoch: int, blobs: dict[int, bytes],
               commit: dict | None) -> None:
        """Fill the per-parameter metadata (as of now: after ``iteration`` applied) and the
        commit blobs, and start the background write."""
        st = self.state
        idx = np.flatnonzero(st.in_range).astype(np.int64)
        img.fill("param_index", idx)
        img.fill("steps", st.steps[idx])
        img.fill("has_state", st.has_state[idx].astype(np.uint8))
        for r, b in blobs.items():
            img.fill(f"commit.rank{r}", np.frombuffer(b, dtype=np.uint8))
        extra = {"commit": commit, "blob_ranks": sorted(blobs)}
        threading.Thread(target=self._write, args=(img, iteration, epoch, extra), name="shadow-persist",
                         daemon=True).start()

    def abandon(self, img: shardfile.ShardImage) -> None:
        """Give an image taken by :meth:`begin` back unwritten."""
        self._free.put(img)

    def _write(self, img: shardfile.ShardImage, iteration: int, epoch: int, extra: dict) -> None:
        t0 = time.monotonic()
        path = self.local_path(iteration)
        try:
            die = knobs.fault("PERSIST_DIE_AT")  # tests: die writing the first checkpoint at or after it
            if die and iteration >= int(die):
                _die_mid_write(img, path)
            compress, level = self.local_codec
            if compress == "none":
                csum = img.checksum()
                nbytes = img.write(path)
            else:
                nbytes, csum = zshard.write(img.buf[:img.size], path, level)
            rep = self.report(iteration, epoch, "local", True, "", bytes=nbytes, checksum=f"{csum:016x}",
                               seconds=time.monotonic() - t0, raw_bytes=img.size, **extra)
            logger.info("persisted iteration %d shard %d: %d bytes (%d raw) in %.3f s", iteration, self.shard,
                        nbytes, img.size, time.monotonic() - t0)
        except Exception as exc:  # reported to the coordinator; a background thread never raises
            logger.error("persisting iteration %d to %s failed: %s", iteration, path, exc)
            rep = self.report(iteration, epoch, "local", False, f"{type(exc).__name__}: {exc}")
        finally:
            self._free.put(img)
        self._results.put(rep)

    def upload(self, iteration: int, epoch: int, nbytes: int, checksum: str) -> None:
        self._uploads.put((iteration, epoch, nbytes, checksum))

    def _upload_loop(self) -> None:
        while True:
            iteration, epoch, nbytes, csum = self._uploads.get()
            t0 = time.monotonic()
            src = self.local_path(iteration)
            name = self.file_name("remote")
            dst = posixpath.join(catalog.checkpoint_dir(self.remote, self.job, iteration), name)
            try:
                fs, path = fsspec.core.url_to_fs(dst)
                fs.makedirs(posixpath.dirname(path), exist_ok=True)
                nbytes, csum, raw = self._copy(src, fs, path, nbytes, csum)
                rep = self.report(iteration, epoch, "remote", True, "", bytes=nbytes, checksum=csum,
                                   seconds=time.monotonic() - t0, file=name, raw_bytes=raw)
            except Exception as exc:  # fsspec back ends raise many types
                logger.error("copying iteration %d shard %d to %s failed: %s", iteration, self.shard, dst, exc)
                rep = self.report(iteration, epoch, "remote", False, f"{type(exc).__name__}: {exc}")
            self._results.put(rep)

    def _copy(self, src: str, fs, path: str, nbytes: int, csum: str) -> tuple[int, str, int]:
        """Copy the local shard file to ``path`` on ``fs`` in the remote tier's format;
        returns ``(bytes, checksum, plain image bytes)`` of what the remote tier now stores."""
        (lc, _), (rc, level) = self.local_codec, self.remote_codec
        if lc == rc:
            fs.put_file(src, path)
            return nbytes, csum, nbytes if lc == "none" else zshard.image_bytes(np.memmap(src, np.uint8, mode="r"))
        data = np.memmap(src, dtype=np.uint8, mode="r")
        with fs.open(path, "wb") as out:
            if rc == "zstd":  # compress while copying
                n, h = zshard.encode(data, out, level, where=src)
                raw = data.size
            else:  # a plain remote copy of a compressed local file: rebuilt and checked block by block
                n, h = zshard.decode_to(data, out, where=src)
                raw = n
        return n, f"{h:016x}", raw

    def report(self, iteration: int, epoch: int, tier: str, ok: bool, error: str, **kw) -> dict:
        return {"epoch": epoch, "iteration": iteration, "tier": tier, "shard": self.shard, "ok": ok,
                "error": error, "file": kw.get("file", self.file_name()), "start": self.state.start,
                "stop": self.state.stop, "bytes": kw.get("bytes", 0), "checksum": kw.get("checksum", ""),
                "raw_bytes": kw.get("raw_bytes", 0), "compress": self.local_codec[0] if tier == "local"
                else self.remote_codec[0], "seconds": kw.get("seconds", 0.0), "commit": kw.get("commit"),
                "blob_ranks": kw.get("blob_ranks", [])}

    def results(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out


def _die_mid_write(image: shardfile.ShardImage, path: str) -> None:
    """Fault injection (tests): write half the image to the temporary file, then die."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(memoryview(image.buf)[:image.size // 2])
        f.flush()
        os.fsync(f.fileno())
    logger.error("fault injection: worker dying in the middle of a checkpoint write")
    os._exit(137)
