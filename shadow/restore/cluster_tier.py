"""A live cluster's local tier as a restore source: :class:`ClusterTierSource`.

The local tier may be node-local: each worker writes its shards to its own disk, and the
coordinator keeps the manifests on its own. A restore client may see none of those disks.
So the checkpoints are listed by asking the coordinator (``catalog``: each manifest's
bytes, which the client parses and, with a manifest key, checks itself, exactly as it
would read them from a directory), and each shard is read

1. straight from a file this host can read: under the coordinator's directory (one host,
   or a shared mount) or under the directory the manifest says a holder wrote it to (the
   client is on that worker's host);
2. else from a live worker on a disk holding a copy (the manifest's ``holders``, matched by
   disk id to the workers the coordinator lists), over that worker's files socket
   (:mod:`shadow.worker.files`); the whole file is checked against the manifest's size and
   checksum before anything in it is used.

A coordinator that does not answer the catalog (an older one, or one that is unreachable
now) leaves the tier read as a directory, as :class:`~shadow.restore.tier.TierSource` does."""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import struct

import numpy as np
import xxhash
import zmq

from shadow.client import dealer, request
from shadow.errors import CheckpointError, ShadowError
from shadow.persist import checkpoints, shardfile
from shadow.persist import disks as disks_mod
from shadow.restore.sources import COMPLETE, INCOMPLETE, SUPERSEDED, UNREADABLE, Candidate
from shadow.restore.tier import TierSource
from shadow.tuning import DEFAULT, Tuning
from shadow.wire import messages as M

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # a worker asked for a file answers this fast, or is taken for gone


class ClusterTierSource(TierSource):
    """The local tier of the cluster behind coordinator ``address``; ``workers``: the live
    workers the coordinator named (``{"id", "files", "disk"}`` each), ``timeout``: how
    long the coordinator may take to answer, ``tuning.fetch_timeout_s``: how long a worker
    may stay silent while it sends a file; ``direct``: whether files this host sees are read
    directly (else every shard comes through a worker)."""

    def __init__(
        self,
        name: str,
        root: str,
        address: str,
        workers: list,
        timeout: float,
        tuning: Tuning = DEFAULT,
        sign_key: bytes | None = None,
        direct: bool = True,
    ) -> None:
        super().__init__(name, root, True, sign_key)
        self.address, self.timeout, self.tuning = address, timeout, tuning
        self.direct = direct  # read the files this host sees itself (False: always through the workers)
        self.workers = [w for w in workers if isinstance(w, dict) and isinstance(w.get("files"), str) and w["files"]]

    def candidates(self, job: str | None) -> list[Candidate]:
        try:
            reply = self._catalog(job)
        except ShadowError as exc:
            logger.warning(
                "the coordinator at %s did not list its %s tier (%s); reading %s",
                self.address,
                self.name,
                exc,
                self.root,
            )
            return super().candidates(job)
        if reply.get("left_out"):
            logger.warning(
                "the coordinator at %s listed only the newest checkpoints of its %s tier: %d older ones were left out",
                self.address,
                self.name,
                reply["left_out"],
            )
        out: list[Candidate] = []
        for entry in reply["checkpoints"]:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                continue
            rel, raw, superseded = entry
            d = posixpath.join(self.root, rel)
            mpath = posixpath.join(d, checkpoints.MANIFEST)
            skipped: list[tuple[str, str]] = []
            manifest = (
                checkpoints.read_manifest(functools.partial(bytes, raw), mpath, self.sign_key, skipped)
                if isinstance(raw, bytes) and posixpath.normpath(rel) == rel and not rel.startswith("..")
                else None
            )
            if manifest is None:
                reason = skipped[0][1] if skipped else "the coordinator sent no manifest for it"
                key = checkpoints.dir_key(d)
                out.append(
                    Candidate(
                        rel.split("/")[0], key[1] if key else None, self.name, mpath, UNREADABLE, None, error=reason
                    )
                )
                continue
            info = checkpoints.CheckpointInfo(
                self.root, self.name, d, manifest, self.storage, bool(superseded), self.sign_key is not None
            )
            info.locate = lambda shard, info=info: self._locate(info, shard)
            out.append(
                Candidate(
                    info.job,
                    info.iteration,
                    self.name,
                    d,
                    SUPERSEDED if info.superseded else COMPLETE,
                    info.generation,
                    manifest.get("created"),
                    info.bytes,
                    info.raw_bytes,
                    handle=info,
                )
            )
        for rel in reply["torn"]:
            if isinstance(rel, str):
                key = checkpoints.dir_key(rel)
                out.append(
                    Candidate(
                        rel.split("/")[0],
                        key[1] if key else -1,
                        self.name,
                        posixpath.join(self.root, rel),
                        INCOMPLETE,
                        key[0] if key else 0,
                    )
                )
        # restorable ones oldest first, as list_checkpoints orders them
        out.sort(
            key=lambda c: (c.state != SUPERSEDED, c.generation or 0, c.iteration if c.iteration is not None else -1)
        )
        return out

    def verify_copies(self, info: checkpoints.CheckpointInfo) -> list[str]:
        """Read every copy of every shard of ``info`` (each holder's, on its disk: directly
        where this host sees it, else through a live worker on it) and check it against the
        manifest; returns the problems, one per copy that is missing, unreachable or damaged."""
        problems = []
        for shard in info.manifest["shards"]:
            holders = [h for h in shard.get("holders", []) if isinstance(h, dict)] or [{}]
            for h in holders:
                copy = f"iteration {info.iteration} ({self.name}): shard {shard['index']}" + (
                    f" on disk {h.get('disk')} (worker {h.get('worker')}, host {h.get('host')}, {h.get('dir')})"
                    if h
                    else ""
                )
                try:
                    got = self._locate(info, {**shard, "holders": [h]} if h else shard)
                    data = _read_path(got) if isinstance(got, str) else got.read_all()
                except (ShadowError, OSError) as exc:
                    problems.append(f"{copy}: {exc}")
                    continue
                if len(data) != shard["bytes"] or f"{xxhash.xxh3_64_intdigest(data):016x}" != shard["checksum"]:
                    problems.append(f"{copy}: fails its size or checksum: the copy is corrupt")
        return problems

    def _catalog(self, job: str | None) -> dict:
        sock = dealer(zmq.Context.instance(), self.address, tuning=self.tuning)
        try:
            return request(
                sock, self.address, M.encode("catalog", tier=self.name, job=job), self.timeout, ("catalog_reply",)
            )
        finally:
            sock.close(linger=0)

    def _locate(self, info: checkpoints.CheckpointInfo, shard: dict) -> str | WorkerFile:
        """Where shard ``shard`` of ``info`` is read from: a path this host sees, or the
        workers holding a copy (checked by the caller)."""
        rel = posixpath.join(info.job, posixpath.basename(info.path), shard["file"])
        holders = [h for h in shard.get("holders", []) if isinstance(h, dict)]
        disks = {h.get("disk") for h in holders if h.get("disk")}
        # a directory this host sees is read directly when it is a holder's disk (its mark says
        # so: the same path on another host may be another disk); a manifest naming no disk
        # (written before node-local tiers) is read where the coordinator's directory has it
        for d in [self.root] + [h.get("dir") for h in holders] if self.direct else []:
            if isinstance(d, str) and d and info.storage.os_path(d) is not None:
                path = os.path.join(d, rel)
                if (not disks or disk_id_of(d) in disks) and os.path.isfile(path) and os.access(path, os.R_OK):
                    return path

        def disk_of(w: dict) -> str:
            return str(w["disk"].get("id") or "") if isinstance(w.get("disk"), dict) else ""

        # the workers on a disk holding a copy, then those that have not said which disk they are on
        serving = [w for w in self.workers if disk_of(w) in disks] + [w for w in self.workers if not disk_of(w)]
        if not disks:  # a manifest that does not say: any worker may hold it
            serving = list(self.workers)
        where = f"iteration {info.iteration} ({self.name}): shard {shard['index']}"
        if not serving:
            raise CheckpointError(f"{where}: no live worker holds it and this host does not see its disk")
        return WorkerFile(serving, info.job, posixpath.basename(info.path), shard, self.tuning, where)


class WorkerFile:
    """A shard file on the workers' disks (a :class:`~shadow.persist.checkpoints.ShardReader`),
    read from the first of ``workers`` that serves it; every failure is a
    :class:`CheckpointError` naming each worker tried."""

    def __init__(self, workers: list[dict], job: str, directory: str, shard: dict, tuning: Tuning, where: str):
        self.workers, self.job, self.directory, self.shard, self.tuning = workers, job, directory, shard, tuning
        self.where = f"{where}, on a worker's disk"

    def read_into(self, target) -> tuple[dict, dict, int, int]:
        """As :func:`shadow.persist.shardfile.read_into`: each chunk put in place as it arrives.
        A copy that fails the manifest's checksum is passed over for the next worker's."""

        def read(endpoint: str) -> tuple[dict, dict, int, int]:
            got = stream_into(endpoint, self.job, self.directory, self.shard, target, self.tuning)
            self._check(got[2])
            return got

        return self._first(read)

    def read_all(self) -> bytes:
        def read(endpoint: str) -> bytes:
            data = read_file(endpoint, self.job, self.directory, self.shard, self.tuning)
            self._check(xxhash.xxh3_64_intdigest(data))
            return data

        return self._first(read)

    def _check(self, csum: int) -> None:
        if f"{csum:016x}" != self.shard.get("checksum"):
            raise ShadowError("its copy fails the manifest's checksum (damaged on that disk)")

    def _first(self, read):
        errors = []
        for w in self.workers:
            try:
                return read(w["files"])
            except ShadowError as exc:  # CheckpointError too: another copy may be whole
                errors.append(f"worker {w.get('id')}: {exc}")
        raise CheckpointError(f"{self.where}: " + "; ".join(errors))


def _read_path(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def disk_id_of(root: str) -> str:
    """The disk id marked in ``root`` (:mod:`shadow.persist.disks`), or "" (none, unreadable)."""
    try:
        with open(os.path.join(root, disks_mod.MARK), "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _request(endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning) -> zmq.Socket:
    """Ask the worker at ``endpoint`` for the file; returns the socket once its head says it
    comes (an error reply, a head for another size, or none within :data:`HEAD_TIMEOUT_S`:
    ``ShadowError``)."""
    nbytes = int(shard["bytes"])
    sock = dealer(zmq.Context.instance(), endpoint, tuning=tuning, rcvhwm=8)
    try:
        sock.send(M.encode("read_file", job=job, dir=directory, file=shard["file"], bytes=nbytes))
        head_s = min(HEAD_TIMEOUT_S, tuning.fetch_timeout_s)
        if not sock.poll(int(head_s * 1000)):
            raise ShadowError(f"no answer from {endpoint} within {head_s:.0f} s")
        head = M.decode(sock.recv())
        if head["t"] == "error":
            raise ShadowError(head["message"])
        if head["t"] != "file_reply" or head["bytes"] != nbytes or head["chunk"] <= 0:
            raise ShadowError(f"{endpoint} answered {head['t']!r} for {nbytes} bytes: not the file asked for")
    except M.MessageError as exc:
        sock.close(linger=0)
        raise ShadowError(f"{endpoint} sent a malformed reply: {exc}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _chunks(sock: zmq.Socket, endpoint: str, nbytes: int, tuning: Tuning):
    """The file's chunks as they arrive (buffers valid until the next one), ``nbytes`` in
    all; a worker silent for ``tuning.fetch_timeout_s`` or sending too much: ``ShadowError``."""
    wait, done = int(tuning.fetch_timeout_s * 1000), 0
    while done < nbytes:
        if not sock.poll(wait):
            raise ShadowError(
                f"{endpoint} sent {done} of {nbytes} bytes, then nothing for {tuning.fetch_timeout_s:.0f} s"
            )
        buf = sock.recv(copy=False).buffer
        if len(buf) == 0 or done + len(buf) > nbytes:
            raise ShadowError(f"{endpoint} sent more than the {nbytes} bytes of the file")
        yield done, buf
        done += len(buf)


def read_file(endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning = DEFAULT) -> bytes:
    """Shard file ``shard["file"]`` of checkpoint directory ``directory`` of ``job`` from the
    worker whose files socket is ``endpoint``: its ``shard["bytes"]`` bytes (unchecked: the
    caller compares them with the manifest). A worker silent for ``tuning.fetch_timeout_s``
    fails it; so does an error reply (no such file there, not a shard file) and one that
    does not answer within :data:`HEAD_TIMEOUT_S` (a live worker answers at once, whatever
    else it is sending: its host may be gone while the coordinator still lists it)."""
    nbytes = int(shard["bytes"])
    sock = _request(endpoint, job, directory, shard, tuning)
    try:
        out = bytearray(nbytes)
        for pos, buf in _chunks(sock, endpoint, nbytes, tuning):
            out[pos : pos + len(buf)] = buf
        return bytes(out)
    finally:
        sock.close(linger=0)


def stream_into(endpoint: str, job: str, directory: str, shard: dict, target, tuning: Tuning = DEFAULT):
    """As :func:`read_file`, a plain shard file put straight into place as it arrives:
    ``target(name, dtype, count)`` says where each tensor goes (None: a fresh array), as for
    :func:`shadow.persist.shardfile.read_into`, whose ``(metadata, tensors, xxh3 of the whole
    file, size)`` it returns. Nothing is checked against the manifest here; a header that does
    not parse is a ``ShadowError``."""
    nbytes = int(shard["bytes"])
    sock = _request(endpoint, job, directory, shard, tuning)
    h = xxhash.xxh3_64()
    head = bytearray()  # the file's first bytes, until its header is whole
    places: list[tuple[int, int, np.ndarray]] = []  # (file lo, file hi, where), in file order
    tensors: dict[str, np.ndarray] = {}
    meta: dict | None = None  # once the header is parsed
    try:
        for pos, buf in _chunks(sock, endpoint, nbytes, tuning):
            h.update(buf)
            if meta is None:
                head += buf
                if len(head) < 8 or len(head) < 8 + struct.unpack_from("<Q", head)[0]:
                    continue
                try:
                    meta, base, specs = shardfile.tensor_specs(memoryview(head), nbytes)
                except ValueError as exc:
                    raise ShadowError(f"{endpoint}: the shard file's header: {exc}") from None
                for name, dt, lo, hi in specs:
                    count = (hi - lo) // dt.itemsize
                    arr = target(name, dt, count)
                    arr = np.empty(count, dtype=dt) if arr is None else arr
                    if arr.dtype != dt or arr.size != count:
                        raise ShadowError(f"tensor {name!r} is {dt} x {count}, not what the layout expects")
                    tensors[name] = arr
                    places.append((base + lo, base + hi, arr.view(np.uint8)))
                pos, buf = 0, memoryview(head)
            _scatter(places, pos, buf)
    finally:
        sock.close(linger=0)
    if meta is None:
        raise ShadowError(f"{endpoint}: the shard file ends inside its header")
    return meta, tensors, h.intdigest(), nbytes


def _scatter(places: list[tuple[int, int, np.ndarray]], pos: int, buf) -> None:
    """Copy the file's bytes ``buf``, starting at file position ``pos``, into the places
    they belong to."""
    data = np.frombuffer(buf, dtype=np.uint8)
    end = pos + len(data)
    for lo, hi, where in places:
        if hi <= pos or lo >= end:
            continue
        a, b = max(lo, pos), min(hi, end)
        where[a - lo : b - lo] = data[a - pos : b - pos]
