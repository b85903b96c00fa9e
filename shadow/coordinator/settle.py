"""Settling a checkpoint once every shard report asked for is in: committing it (its
manifest written, then recorded in the tier's figures and catalog) or, when some copy
failed, was skipped or the replicas' copies differ, counting that and deleting what was
written of it. Each step works on the one tier it is given
(:class:`~shadow.coordinator.catalog.TierState`); when a tier is due and what follows a
commit (retention, the remote copy) is :class:`~shadow.coordinator.persistence.Persistence`'s."""

from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

from shadow.coordinator.catalog import TierState
from shadow.core import sqrttab
from shadow.persist import checkpoints, disks, failed
from shadow.wire.commit import FollowUp, ForgetDirs, Persisted

logger = logging.getLogger(__name__)


def not_taken(tier: TierState, job, iteration: int, got: dict[int, Persisted], problem: str, skip_log_s: float):
    """A checkpoint some copy of which failed (or was skipped, or the replicas' copies
    differ: ``problem``): counted and due again (what was written of it is the caller's to
    delete: :func:`discard`, on the storage lane). ``skip_log_s``: how often skips are
    logged (``SHADOW_PERSIST_SKIP_LOG_S``)."""
    bad = [r for r in got.values() if not r.ok]
    errors = [f"iteration {r.iteration} shard {r.shard}: {r.error}" for r in bad if not r.skipped]
    if not bad:  # every copy was written, but the replicas' copies differ
        errors = [f"iteration {iteration} shard -1: {problem}"]
    if errors:
        tier.failing += 1
    if not errors or tier.failing < 2:
        tier.last = tier.last_ok  # due again at the next cut
    # else failing again (a full disk): the next try follows the tier's schedule, not every cut
    if errors:
        tier.last_error = "; ".join(errors)
        logger.error("tier %s: checkpoint of iteration %d not taken: %s", tier.name, iteration, tier.last_error)
        tier.failures += 1
    else:
        tier.skip(iteration, bad[0].error, skip_log_s)
    if tier.name == "local" and any(r.ok for r in got.values()):  # the copies made, on their disks
        return [ForgetDirs(iteration, [checkpoints.dir_name(iteration, job.generation)])]
    return []


def discard(tier: TierState, job_name: str, iteration: int, generation: int) -> None:
    """A checkpoint that failed never gets a manifest: delete the shards the other
    workers wrote for it, so that on a full disk they do not hold the space the next
    attempt needs (earlier complete checkpoints are never touched). Storage I/O: the
    coordinator runs it on its storage lane."""
    try:
        if failed.discard_torn(tier.storage, job_name, iteration, generation):
            logger.info("tier %s: removed the incomplete checkpoint of iteration %d", tier.name, iteration)
    except Exception as exc:  # storage errors are reported, never fatal; retention retries later
        logger.warning(
            "tier %s: could not remove the incomplete checkpoint of iteration %d: %s: %s",
            tier.name,
            iteration,
            type(exc).__name__,
            exc,
        )


def write_manifest(
    tier: TierState, job, iteration: int, got: dict[int, Persisted], sign_key: bytes | None
) -> dict[str, Any]:
    """Write the manifest of ``iteration`` from its copies' reports ``got`` (the commit),
    signed with ``sign_key`` when given; returns it. Storage errors propagate
    (:func:`manifest_failed` records them)."""
    manifest = new_manifest(tier, job, iteration, got)
    # the coordinator keeps the local tier's manifests on its own disk: the workers' shards
    # may be on theirs (node-local), so the directory may be new here
    checkpoints.write_manifest(tier.storage, job.name, iteration, manifest, sign_key, parents=tier.name == "local")
    return manifest


def new_manifest(tier: TierState, job, iteration: int, got: dict[int, Persisted]) -> dict[str, Any]:
    """The manifest of ``iteration`` from its copies' reports ``got`` (no I/O: the
    coordinator builds it on its loop thread and writes it on its storage lane)."""
    commit = next((r.commit for r in got.values() if r.commit is not None), None)
    return checkpoints.new_manifest(
        job.name,
        iteration,
        job.epoch,
        tier.name,
        job.layout,
        job.layout_hash,
        sqrttab.public(job.optim),  # the replay's table is the workers', not the checkpoint's
        job.world,
        commit.get("tokens") if commit else None,
        commit,
        _manifest_shards(_by_shard(got), holders=tier.name == "local"),
        job.generation,
    )


def manifest_failed(tier: TierState, job, iteration: int, exc: BaseException) -> list[FollowUp]:
    """Writing the manifest of ``iteration`` (or the retention after it) raised ``exc``:
    counted and due again (the shards written for it are the caller's to delete:
    :func:`discard`; never one whose manifest did get written)."""
    where = checkpoints.checkpoint_dir(tier.root, job.name, iteration, job.generation)
    tier.last_error = f"writing the manifest of iteration {iteration}: {failed.write_error(exc, tier.name, where)}"
    logger.error("tier %s: %s", tier.name, tier.last_error)
    tier.failing += 1
    if tier.failing < 2:
        tier.last = tier.last_ok
    tier.failures += 1
    if tier.name == "local":
        return [ForgetDirs(iteration, [checkpoints.dir_name(iteration, job.generation)])]
    return []


def completed(
    tier: TierState,
    job,
    iteration: int,
    manifest: dict[str, Any],
    got: dict[int, Persisted],
    deleted: list[str],
    skip_log_s: float,
) -> bool:
    """Record a written manifest in the tier's figures and catalog (``deleted``: what
    retention removed after it); False when it came after the shadow diverged (written,
    listed superseded, never the newest)."""
    tokens = manifest["tokens"]
    if iteration >= tier.last_ok[0]:  # an older checkpoint can complete after a newer one
        tier.last_ok = (iteration, time.time(), tokens)
    tier.failing = 0
    nbytes = sum(s["bytes"] for s in manifest["shards"])
    tier.count += 1
    tier.bytes += nbytes
    tier.last_error = ""
    diverged = getattr(job, "diverged", None)  # a JobRec's (the last right iteration), once diverged
    if diverged is not None and iteration > diverged:
        # asked for before the divergence was found: its manifest is written, and listed as
        # superseded (the generation record), but it is never the tier's newest nor uploaded
        logger.warning(
            "tier %s: iteration %d of job %s completed after the shadow diverged (after iteration %d); "
            "it is superseded, never restorable",
            tier.name,
            iteration,
            job.name,
            diverged,
        )
        return False
    tier.complete[job.name] = max(tier.complete.get(job.name, -1), iteration)
    last = tier.last_complete
    if last is None or last["iteration"] <= iteration or last["job"] != job.name:
        tier.last_complete = {
            "job": job.name,
            "iteration": iteration,
            "time": manifest["created"],
            "bytes": nbytes,
            "seconds": max(r.seconds for r in got.values()),
        }
    logger.info(
        "tier %s: checkpoint of %s iteration %d complete (%d bytes, %d shards)%s",
        tier.name,
        job.name,
        iteration,
        nbytes,
        len(manifest["shards"]),
        f"; retention removed {len(deleted)}" if deleted else "",
    )
    tier.log_skips(skip_log_s)
    if tier.newest is None or tier.newest[0] < iteration:
        # one copy per shard goes up
        tier.newest = (iteration, tokens, {index: c[0] for index, c in _by_shard(got).items()})
    return True


def forget(iteration: int, deleted: list[str]) -> list[FollowUp]:
    """Retention deleted checkpoint directories ``deleted`` (paths): the workers delete them too."""
    if not deleted:
        return []
    return [ForgetDirs(iteration, [posixpath.basename(d.rstrip("/")) for d in deleted])]


def copies_differ(reports) -> str:
    """Why the copies of a shard that replicas wrote cannot be one checkpoint's ("" when they
    can): replicas apply the same iterations bit for bit, so their files must be equal."""
    by_shard: dict[int, set] = {}
    for r in reports:
        if r.ok:
            by_shard.setdefault(r.shard, set()).add((r.bytes, r.checksum))
    for shard, kinds in sorted(by_shard.items()):
        if len(kinds) > 1:
            return f"the replicas of shard {shard} wrote different files ({sorted(kinds)}): their states differ"
    return ""


def _by_shard(got: dict[int, Persisted]) -> dict[int, list[Persisted]]:
    """Shard -> its copies' reports, by worker id."""
    copies: dict[int, list[Persisted]] = {}
    for wid in sorted(got):
        copies.setdefault(got[wid].shard, []).append(got[wid])
    return copies


def _manifest_shards(copies: dict[int, list[Persisted]], holders: bool) -> list[dict[str, Any]]:
    """The manifest's shard entries, from the first copy of each shard; ``holders``: where
    its copies are (a local tier's are on the writers' disks; the remote tier is one store)."""
    return [
        {
            "index": r.shard,
            "start": r.start,
            "stop": r.stop,
            "file": r.file,
            "bytes": r.bytes,
            "checksum": r.checksum,
            "blob_ranks": r.blob_ranks,
            "raw_bytes": r.raw_bytes,
            "compress": r.compress,
            **({"holders": [disks.holder(c.worker, c.disk) for c in copies[index]]} if holders else {}),
        }
        for index in sorted(copies)
        for r in copies[index][:1]
    ]
