"""A live cluster's local tier as a restore source: :class:`ClusterTierSource`.

The local tier may be node-local: each worker writes its shards to its own disk, and the
coordinator keeps the manifests on its own. A restore client may see none of those disks.
So the checkpoints are listed by asking the coordinator (``catalog``: each manifest's
bytes, which the client parses and, with a manifest key, checks itself, exactly as it
would read them from a directory), and each shard is read from the first of its copies
that is intact, tried in turn:

1. straight from a file this host can read: under the coordinator's directory (one host,
   or a shared mount) or under the directory the manifest says a holder wrote it to (the
   client is on that worker's host), where the directory's disk mark is that holder's;
2. then from a live worker on a disk holding a copy (the manifest's ``holders``, matched by
   disk id to the workers the coordinator lists), over that worker's files socket
   (:mod:`shadow.worker.files`).

Each copy is checked against the manifest's size and checksum as it is read; one that is
short, unreadable, does not parse or fails its checksum is passed over (with a warning) for
the next, whose read puts every byte of every tensor in place again, so nothing of the bad
copy is left. The read fails only when every copy failed, naming each
(:class:`~shadow.restore.copies.CopiesFailed`); reading the copies is
:class:`~shadow.restore.copies.ShardCopies`'s, finding them this module's.

A coordinator that does not answer the catalog (an older one, or one that is unreachable
now) leaves the tier read as a directory, as :class:`~shadow.restore.storage_source.TierSource` does."""

from __future__ import annotations

import functools
import logging
import os
import posixpath
from dataclasses import dataclass, field

from shadow.config.tuning import DEFAULT, Tuning
from shadow.core.errors import CheckpointError, ShadowError
from shadow.core.layout import Layout
from shadow.persist import checkpoints, generations, shardguard
from shadow.persist.manifests import _reading
from shadow.restore.copies import CopiesFailed, ShardCopies, ShardCopy, disk_id_of
from shadow.restore.sources import COMPLETE, DIVERGED, INCOMPLETE, SUPERSEDED, UNREADABLE, Candidate
from shadow.restore.storage_source import TierSource
from shadow.transport.client import ask
from shadow.wire import messages as M

logger = logging.getLogger(__name__)


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
        lineage = self._lineage(reply.get("generations"))
        out = [c for c in (self._candidate(e, lineage) for e in reply["checkpoints"]) if c is not None]
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

    def _lineage(self, records: object) -> dict[str, tuple[dict, dict]] | None:
        """Per job, ``({generation: base}, the diverged ones)`` from the generation records a
        catalog carries, read (and with a manifest key, checked) here as a reader of the tier
        reads them: a record that is unsigned or forged is ignored, whatever the coordinator
        made of it. None when the catalog carries none (an older coordinator): its
        ``superseded`` flags are taken as they are."""
        if not isinstance(records, list):
            return None
        by_job: dict[str, list] = {}
        for rec in records:
            if isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str) and isinstance(rec[1], bytes):
                by_job.setdefault(rec[0].split("/")[0], []).append(
                    (posixpath.join(self.root, rec[0]), functools.partial(bytes, rec[1]))
                )
        out = {}
        for job, recs in by_job.items():
            diverged: dict[int, int] = {}
            out[job] = (generations.records_of(recs, job, diverged, self.sign_key), diverged)
        return out

    def _candidate(self, entry: object, lineage: dict[str, tuple[dict, dict]] | None = None) -> Candidate | None:
        """One ``[directory, manifest bytes, superseded]`` entry of the coordinator's catalog
        as a candidate, its manifest read (and its signature checked) here; an entry of
        another shape is no candidate. ``lineage`` (:meth:`_lineage`): whether it is
        superseded or diverged is decided here from the records, not by the flag."""
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            return None
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
            return Candidate(
                rel.split("/")[0], key[1] if key else None, self.name, mpath, UNREADABLE, None, error=reason
            )
        info = checkpoints.CheckpointInfo(
            self.root, self.name, d, manifest, self.storage, bool(superseded), self.sign_key is not None
        )
        info.diverged = superseded == DIVERGED
        if lineage is not None:
            marks, diverged = lineage.get(info.job, ({}, {}))
            info.superseded = generations.superseded(info.generation, info.iteration, marks)
            info.diverged = generations.superseded(info.generation, info.iteration, diverged)
            superseded = DIVERGED if info.diverged else info.superseded
        info.locate = lambda shard, info=info: self._locate(info, shard)
        return Candidate(
            info.job,
            info.iteration,
            self.name,
            d,
            DIVERGED if superseded == DIVERGED else SUPERSEDED if info.superseded else COMPLETE,
            info.generation,
            manifest.get("created"),
            info.bytes,
            info.raw_bytes,
            handle=info,
        )

    def check_copies(self, info: checkpoints.CheckpointInfo) -> CopiesCheck:
        """Read every copy of every shard of ``info`` (each holder's, on its disk: directly
        where this host sees it, else through a live worker on it) and check it against the
        manifest: which copies are missing, unreachable or damaged, and which shards have no
        intact copy left (then the checkpoint cannot be restored)."""
        out = CopiesCheck()
        where = f"iteration {info.iteration} ({self.name})"
        try:
            with _reading(f"{where}: unreadable layout"):
                total = Layout.from_dict(info.manifest["layout"]).total
                tiling = shardguard.tiling_problem(info.manifest["shards"], total)
            if tiling:
                out.layout.append(f"{where}: {tiling}")
        except CheckpointError as exc:
            out.layout.append(str(exc))
        for shard in info.manifest["shards"]:
            holders = [h for h in shard.get("holders", []) if isinstance(h, dict)] or [{}]
            intact = 0
            for h in holders:
                copy = f"{where}: shard {shard['index']}" + (
                    f" on disk {h.get('disk')} (worker {h.get('worker')}, host {h.get('host')}, {h.get('dir')})"
                    if h
                    else ""
                )
                try:
                    self._locate(info, {**shard, "holders": [h]} if h else shard).read_all()
                    intact += 1
                    continue
                except CopiesFailed as exc:
                    why = "; ".join(f"{c.via}: {reason}" for c, reason in exc.tried)
                except ShadowError as exc:
                    why = str(exc).removeprefix(f"{where}: shard {shard['index']}: ")
                out.problems.append(f"{copy}: {why}")
                out.lost.append(
                    {
                        "shard": shard["index"],
                        "disk": h.get("disk"),
                        "worker": h.get("worker"),
                        "host": h.get("host"),
                        "dir": h.get("dir"),
                        "problem": why,
                    }
                )
            if not intact:
                out.unrestorable.append(shard["index"])
        return out

    def verify_copies(self, info: checkpoints.CheckpointInfo) -> list[str]:
        """The problems :meth:`check_copies` finds: one per copy that is missing, unreachable
        or damaged (and one for a layout its shards do not tile)."""
        got = self.check_copies(info)
        return got.layout + got.problems

    def _catalog(self, job: str | None) -> dict:
        payload = M.encode("catalog", tier=self.name, job=job)
        return ask(self.address, payload, self.timeout, ("catalog_reply",), self.tuning)

    def _locate(self, info: checkpoints.CheckpointInfo, shard: dict) -> ShardCopies:
        """Every copy of shard ``shard`` of ``info`` this host can get, in the order a read
        tries them: files this host sees itself, then the live workers on a holder's disk
        (and those that have not said which disk they are on). None at all:
        :class:`CheckpointError`."""
        rel = posixpath.join(info.job, posixpath.basename(info.path), shard["file"])
        holders = [h for h in shard.get("holders", []) if isinstance(h, dict)]
        disks = {h.get("disk") for h in holders if h.get("disk")}
        by_disk = {h["disk"]: h for h in reversed(holders) if h.get("disk")}
        where = f"iteration {info.iteration} ({self.name}): shard {shard['index']}"
        copies: list[ShardCopy] = []
        seen: set[str] = set()
        # a directory this host sees is read directly when it is a holder's disk (its mark says
        # so: the same path on another host may be another disk); a manifest naming no disk
        # (written before node-local tiers) is read where the coordinator's directory has it
        for d in ([self.root] + [h.get("dir") for h in holders]) if self.direct else []:
            if not (isinstance(d, str) and d and info.storage.os_path(d) is not None):
                continue
            path = os.path.join(d, rel)
            mark = disk_id_of(d) if disks else ""
            if (mark not in disks) if disks else not os.path.isfile(path):
                continue
            if os.path.realpath(path) in seen:  # the coordinator's directory is a holder's too
                continue
            seen.add(os.path.realpath(path))
            h = by_disk.get(mark, {})
            copies.append(ShardCopy(mark, h.get("worker"), h.get("host"), path=path))

        def disk_of(w: dict) -> str:
            return str(w["disk"].get("id") or "") if isinstance(w.get("disk"), dict) else ""

        # the workers on a disk holding a copy, then those that have not said which disk they are on
        serving = [w for w in self.workers if disk_of(w) in disks] + [w for w in self.workers if not disk_of(w)]
        if not disks:  # a manifest that does not say: any worker may hold it
            serving = list(self.workers)
        for w in serving:
            disk = disk_of(w)
            host = w["disk"].get("host") if isinstance(w.get("disk"), dict) else None
            ticket, key = w.get("ticket"), w.get("key")
            ok = isinstance(ticket, bytes) and isinstance(key, bytes)
            copies.append(
                ShardCopy(
                    disk,
                    w.get("id"),
                    host or by_disk.get(disk, {}).get("host"),
                    endpoint=w["files"],
                    ticket=ticket if ok else None,
                    key=key if ok else None,
                )
            )
        if not copies:
            raise CheckpointError(f"{where}: no live worker holds it and this host does not see its disk")
        return ShardCopies(copies, info.job, posixpath.basename(info.path), shard, self.tuning, where)


@dataclass
class CopiesCheck:
    """What :meth:`ClusterTierSource.check_copies` found: ``problems``, one line per copy
    lost (missing, unreachable or damaged), ``lost`` the same as records (shard, disk,
    worker, host, dir, problem), ``unrestorable`` the shards with no intact copy, ``layout``
    a layout the shards do not tile."""

    problems: list[str] = field(default_factory=list)
    lost: list[dict] = field(default_factory=list)
    unrestorable: list[int] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)

    @property
    def restorable(self) -> bool:
        """Every shard has an intact copy (some may still be lost: a degraded checkpoint)."""
        return not self.unrestorable and not self.layout
