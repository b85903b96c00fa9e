"""Checkpoints on storage: naming, manifests (the commit marker), listing, verification,
and reading one back as a :class:`~shadow.core.snapshot.Snapshot` (which one to restore is
:mod:`shadow.restore`'s choice).

A checkpoint lives in ``<root>/<job>/iteration-<k>/``: one shard file per worker and a
``manifest.json`` written last. A directory without a manifest is a torn write and is
never listed as complete. ``root`` is a local path or any fsspec URL. A shard file is
plain (``*.safetensors``, :mod:`shardfile`) or compressed (``*.shard.zst``,
:mod:`zshard`); the manifest's size and checksum describe the bytes on storage either way.
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
import re
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from shadow.core.errors import CheckpointError  # CheckpointError: raised here, and named here too
from shadow.core.layout import Layout
from shadow.core.snapshot import Assembly, Snapshot
from shadow.persist import fsglob, shardfile, shardguard, shardio, signing, zshard
from shadow.persist.generations import GENERATION, read_generations, superseded, write_generation  # noqa: F401
from shadow.persist.manifests import (  # noqa: F401 (named here too)
    FORMAT,
    _reading,
    manifest_problem,
    new_manifest,
    read_manifest,
)
from shadow.persist.shardio import ShardSource, StorageFile
from shadow.storage import Storage, storage_for
from shadow.wire.frames import Field

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FIELDS = {f.name.lower(): f for f in Field if f is not Field.GRAD}  # shard entry name -> state array


def dir_name(iteration: int, generation: int = 0) -> str:
    """``iteration-<k>``; a later generation's (see :func:`write_generation`) ends in
    ``-gen<g>``, so it never overwrites the checkpoint it supersedes."""
    suffix = f"-gen{generation}" if generation else ""
    return f"iteration-{iteration:010d}{suffix}"


def checkpoint_dir(root: str, job: str, iteration: int, generation: int = 0) -> str:
    """``<root>/<job>/iteration-<k>`` (see :func:`dir_name`), in the root's own terms."""
    return posixpath.join(root, job, dir_name(iteration, generation))


_DIR = re.compile(r"iteration-(\d+)(?:-gen(\d+))?")


def dir_key(path: str) -> tuple[int, int] | None:
    """``(generation, iteration)`` of a checkpoint directory's name, None if it is not one."""
    m = _DIR.fullmatch(posixpath.basename(path.rstrip("/")))  # (no trailing newline either)
    return (int(m.group(2) or 0), int(m.group(1))) if m else None


def shard_name(index: int, count: int, compress: str = "none") -> str:
    """File name of shard ``index`` of ``count``; ``compress`` is the tier's setting."""
    suffix = zshard.SUFFIX if compress != "none" else ".safetensors"
    return f"shard-{index:05d}-of-{count:05d}{suffix}"


@dataclass
class CheckpointInfo:
    root: str
    tier: str
    path: str  # directory, in the storage's own terms
    manifest: dict
    storage: Storage = field(repr=False, compare=False)
    superseded: bool = False  # a later generation went on from an earlier iteration
    diverged: bool = False  # superseded because the shadow diverged from the trainer: never restorable
    verified: bool = False  # its signature was checked with the manifest key (signing) and holds
    #: where each shard is read from, when not from ``storage``: ``locate(shard)`` returns its
    #: :class:`~shadow.persist.shardio.ShardSource` (a node-local tier: every holder's copy, in turn)
    locate: Callable[[dict], ShardSource] | None = field(default=None, repr=False, compare=False)

    def source(self, shard: dict) -> ShardSource:
        """Where shard ``shard`` (its manifest entry) is read from."""
        if self.locate is not None:
            return self.locate(shard)
        return StorageFile(self.storage, self.path, shard["file"], shard["bytes"])

    @property
    def job(self) -> str:
        return self.manifest["job"]

    @property
    def iteration(self) -> int:
        return self.manifest["iteration"]

    @property
    def generation(self) -> int:
        return int(self.manifest.get("generation", 0))

    @property
    def signed(self) -> bool:
        """Whether the manifest carries a signature (checked only where :attr:`verified`)."""
        return signing.FIELD in self.manifest

    @property
    def bytes(self) -> int:
        """Bytes on storage (compressed where the tier compresses)."""
        return sum(s["bytes"] for s in self.manifest["shards"])

    @property
    def raw_bytes(self) -> int:
        """Bytes of the uncompressed shards (manifests before compression: as stored)."""
        return sum(s.get("raw_bytes") or s["bytes"] for s in self.manifest["shards"])


def write_manifest(
    root: str | Storage,
    job: str,
    iteration: int,
    manifest: dict,
    sign_key: bytes | None = None,
    parents: bool = False,
) -> str:
    """Commit a checkpoint: write its manifest last (tmp, fsync, rename), signed with
    ``sign_key`` if given (:mod:`~shadow.persist.signing`); returns its path in the
    storage's terms. ``parents``: make the checkpoint's directory if it is not there (the
    coordinator's copy of a node-local tier's manifests)."""
    st = storage_for(root)
    if sign_key is not None:
        manifest = signing.signed(manifest, sign_key)
    path = st.join(job, dir_name(iteration, int(manifest.get("generation", 0))), MANIFEST)
    st.write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode(), parents=parents)
    return path


def list_checkpoints(
    root: str | Storage,
    tier: str = "local",
    job: str | None = None,
    skipped: list[tuple[str, str]] | None = None,
    sign_key: bytes | None = None,
) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root`` (those with a manifest), lowest iteration first.
    A manifest that does not parse or fails :func:`manifest_problem` is skipped with a
    warning and appended to ``skipped`` (if given) as ``(path, reason)``. With ``sign_key``
    (:mod:`~shadow.persist.signing`), so is one whose signature is missing or wrong: it may
    have been tampered with. Without it, signatures are not checked."""
    st = storage_for(root)
    pattern = fsglob.pattern(st.base, job, "iteration-*", MANIFEST)
    out = []
    for mpath in st.list(pattern):
        manifest = read_manifest(functools.partial(st.cat, mpath), mpath, sign_key, skipped)
        if manifest is not None:
            out.append(
                CheckpointInfo(st.url, tier, posixpath.dirname(mpath), manifest, st, verified=sign_key is not None)
            )
    for name in {c.job for c in out}:
        diverged: dict[int, int] = {}
        generations = read_generations(st, name, diverged, sign_key, skipped)
        for c in out:
            if c.job == name:
                c.superseded = superseded(c.generation, c.iteration, generations)
                c.diverged = superseded(c.generation, c.iteration, diverged)
    # newest last: superseded ones first (the oldest), then by generation and iteration
    out.sort(key=lambda c: (not c.superseded, c.generation, c.iteration, c.manifest.get("created") or 0))
    return out


def list_torn(root: str | Storage, job: str | None = None) -> list[str]:
    """Checkpoint directories without a manifest (interrupted writes)."""
    st = storage_for(root)
    dirs = st.list(fsglob.pattern(st.base, job, "iteration-*"))
    return sorted(d for d in dirs if not st.exists(posixpath.join(d, MANIFEST)))


def verify(info: CheckpointInfo) -> list[str]:
    """Re-read every shard and check size and checksum; returns the problems found."""
    problems = []
    where = f"iteration {info.iteration} ({info.tier})"
    try:
        with _reading(f"{where}: unreadable layout"):
            tiling = shardguard.tiling_problem(info.manifest["shards"], Layout.from_dict(info.manifest["layout"]).total)
        if tiling:
            problems.append(f"{where}: {tiling}")
    except CheckpointError as exc:
        problems.append(str(exc))
    for shard in info.manifest["shards"]:
        try:
            with _reading(f"{where}: shard {shard['index']} ({posixpath.join(info.path, shard['file'])})"):
                shardio.read_checked(info.source(shard), shard, True, f"{where}: shard {shard['index']}")
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def _shard_tensors(info: CheckpointInfo, shard: dict, check: bool, arrays: dict, total: int) -> dict:
    """One shard's tensors; the big arrays land in ``arrays``, the rest are returned."""
    lo, hi = shard["start"], shard["stop"]
    where = f"iteration {info.iteration} ({info.tier}): shard {shard['index']}"

    def target(name, dtype, count):
        fld = _FIELDS.get(name)
        if fld is None:
            return None
        if count != hi - lo:
            raise CheckpointError(f"{where}: {name} has {count} elements, the range needs {hi - lo}")
        return _flat(arrays, fld, total)[lo:hi]

    return shardio.read_shard(info.source(shard), shard, info.iteration, target, check, where)[1]


_ALLOC = threading.Lock()  # shards read in parallel share the flat arrays: each made once


def _flat(arrays: dict, fld: Field, total: int) -> np.ndarray:
    """The snapshot's flat array of ``fld`` (made, page-aligned, by the first shard to need it)."""
    with _ALLOC:
        if fld not in arrays:
            arrays[fld] = shardfile.aligned_empty(total, np.float32)
        return arrays[fld]


_RANK = "commit.rank"  # a shard file's commit record of one rank: commit.rank<r>
LOAD_THREADS = 8  # shards read at once (a local shard's reads are parallel within it too)


def load(info: CheckpointInfo, check: bool = True, progress=None) -> Snapshot:
    """Read a checkpoint back into a snapshot (checksums verified unless ``check=False``);
    ``progress(done_bytes, total_bytes)`` is called after each shard."""
    m = info.manifest
    with _reading(f"iteration {info.iteration} ({info.tier}): unreadable layout in {info.path}"):
        layout = Layout.from_dict(m["layout"])
    if f"{layout.hash:016x}" != m["layout_hash"]:
        raise CheckpointError(f"iteration {info.iteration}: manifest layout does not match its hash")
    total = layout.total
    tiling = shardguard.tiling_problem(m["shards"], total)
    if tiling:  # checked before a byte is read: never hand out memory no shard wrote
        raise CheckpointError(f"iteration {info.iteration} ({info.path}): {tiling}")
    arrays: dict[Field, np.ndarray] = {}
    parts = Assembly(layout, m["world"], CheckpointError)
    done = 0

    def unreadable(shard: dict) -> str:
        where = posixpath.join(info.path, shard["file"])
        return f"iteration {info.iteration} ({info.tier}): shard {shard['index']} ({where}) is unreadable"

    def read(shard: dict) -> dict:
        # whatever a damaged shard trips (KeyError, TypeError, a store error, ...) is a CheckpointError naming it
        with _reading(unreadable(shard)):
            return _shard_tensors(info, shard, check, arrays, total)

    # every shard at once (disjoint ranges of the same arrays); merged in manifest order
    with ThreadPoolExecutor(max(1, min(LOAD_THREADS, len(m["shards"]))), thread_name_prefix="shadow-load") as pool:
        jobs = [pool.submit(read, shard) for shard in m["shards"]]
        for job in futures.as_completed(jobs):
            if job.exception() is not None:
                for other in jobs:
                    other.cancel()
                job.result()  # raises it
            if progress is not None:
                done += m["shards"][jobs.index(job)]["bytes"]
                progress(done, info.bytes)
    # a shard's copy passed over for a damaged header may have made an array for a field no
    # intact shard holds: nothing of it reaches the snapshot
    delivered = {fld for job in jobs for name, fld in _FIELDS.items() if name in job.result()}
    for fld in set(arrays) - delivered:
        del arrays[fld]
    for shard, job in zip(m["shards"], jobs, strict=True):
        tensors = job.result()
        with _reading(unreadable(shard)):
            parts.add(
                shard["start"],
                shard["stop"],
                zip(tensors["param_index"], tensors["steps"], strict=True),
                zip(tensors["param_index"], tensors["has_state"], strict=True),
                [
                    (int(n[len("commit.rank") :]), t.tobytes())
                    for n, t in tensors.items()
                    if n.startswith("commit.rank")
                ],
                {int(n[len("extra.") :]): t for n, t in tensors.items() if n.startswith("extra.")},
            )
    return parts.snapshot(m["job"], m["iteration"], m["optim"], arrays, info.path, tier=info.tier)
