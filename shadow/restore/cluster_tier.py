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

import zmq

from shadow.client import dealer, request
from shadow.errors import CheckpointError, ShadowError
from shadow.persist import checkpoints
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
    may stay silent while it sends a file."""

    def __init__(
        self,
        name: str,
        root: str,
        address: str,
        workers: list,
        timeout: float,
        tuning: Tuning = DEFAULT,
        sign_key: bytes | None = None,
    ) -> None:
        super().__init__(name, root, True, sign_key)
        self.address, self.timeout, self.tuning = address, timeout, tuning
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

    def _catalog(self, job: str | None) -> dict:
        sock = dealer(zmq.Context.instance(), self.address, tuning=self.tuning)
        try:
            return request(
                sock, self.address, M.encode("catalog", tier=self.name, job=job), self.timeout, ("catalog_reply",)
            )
        finally:
            sock.close(linger=0)

    def _locate(self, info: checkpoints.CheckpointInfo, shard: dict) -> str | bytes:
        """Where shard ``shard`` of ``info`` is read from: a path this host sees, or the
        bytes a worker holding a copy served (checked by the caller)."""
        rel = posixpath.join(info.job, posixpath.basename(info.path), shard["file"])
        holders = [h for h in shard.get("holders", []) if isinstance(h, dict)]
        for d in [self.root] + [h.get("dir") for h in holders]:
            if isinstance(d, str) and d and info.storage.os_path(d) is not None:
                path = os.path.join(d, rel)
                if os.path.isfile(path) and os.access(path, os.R_OK):
                    return path
        disks = {h.get("disk") for h in holders if h.get("disk")}

        def disk_of(w: dict) -> str:
            return str(w["disk"].get("id") or "") if isinstance(w.get("disk"), dict) else ""

        # the workers on a disk holding a copy, then those that have not said which disk they are on
        serving = [w for w in self.workers if disk_of(w) in disks] + [w for w in self.workers if not disk_of(w)]
        if not disks:  # a manifest that does not say: any worker may hold it
            serving = list(self.workers)
        errors = []
        for w in serving:
            try:
                return read_file(w["files"], info.job, posixpath.basename(info.path), shard, self.tuning)
            except ShadowError as exc:
                errors.append(f"worker {w.get('id')}: {exc}")
        why = "; ".join(errors) or "no live worker holds it and this host does not see its disk"
        raise CheckpointError(f"iteration {info.iteration} ({self.name}): shard {shard['index']}: {why}")


def read_file(endpoint: str, job: str, directory: str, shard: dict, tuning: Tuning = DEFAULT) -> bytes:
    """Shard file ``shard["file"]`` of checkpoint directory ``directory`` of ``job`` from the
    worker whose files socket is ``endpoint``: its ``shard["bytes"]`` bytes (unchecked: the
    caller compares them with the manifest). A worker silent for ``tuning.fetch_timeout_s``
    fails it; so does an error reply (no such file there, not a shard file) and one that
    does not answer within :data:`HEAD_TIMEOUT_S` (a live worker answers at once, whatever
    else it is sending: its host may be gone while the coordinator still lists it)."""
    nbytes = int(shard["bytes"])
    sock = dealer(zmq.Context.instance(), endpoint, tuning=tuning, rcvhwm=8)
    wait = int(tuning.fetch_timeout_s * 1000)
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
        out = bytearray(nbytes)
        done = 0
        while done < nbytes:
            if not sock.poll(wait):
                raise ShadowError(
                    f"{endpoint} sent {done} of {nbytes} bytes, then nothing for {tuning.fetch_timeout_s:.0f} s"
                )
            frame = sock.recv(copy=False)
            n = len(frame.buffer)
            if n == 0 or done + n > nbytes:
                raise ShadowError(f"{endpoint} sent more than the {nbytes} bytes of the file")
            out[done : done + n] = frame.buffer
            done += n
        return bytes(out)
    except M.MessageError as exc:
        raise ShadowError(f"{endpoint} sent a malformed reply: {exc}") from None
    finally:
        sock.close(linger=0)
