"""Finding the checkpoint to restore: from a live cluster, its memory first, then its
tiers; or straight from a directory / fsspec URL. Every source is a
:class:`~shadow.restore.sources.RestoreSource`, and one rule picks from each (:func:`pick`);
a cluster's tiers are picked from together (:func:`pick_newest`): the newest intact
checkpoint in any of them, the nearest tier's copy first, so a damaged checkpoint in the
local tier falls back to the remote tier's copy of it before an older local one.

Signed manifests (:mod:`shadow.persist.signing`): a tier read with a manifest key lists a
checkpoint whose manifest is unsigned or fails its signature as unreadable, so
:func:`pick` never returns it (the newest falls back to an older one, with a warning; an
explicit iteration is an error saying why). :func:`resolve` takes the key from
``$SHADOW_MANIFEST_KEY`` when given none; the lower-level functions only as passed."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shadow.config.tuning import Tuning
from shadow.core.errors import CheckpointError, ShadowError
from shadow.core.snapshot import Snapshot
from shadow.restore.memory import MemorySource, MovedOn, ParamSink
from shadow.restore.sources import COMPLETE, INCOMPLETE, UNREADABLE, Candidate, RestoreSource

if TYPE_CHECKING:  # a tier's readers and codecs load only when a tier is read
    from shadow.persist.checkpoints import CheckpointInfo
    from shadow.restore.storage_source import TierSource
    from shadow.storage import Storage

logger = logging.getLogger(__name__)

# shadow.persist.signing.ENV, named here too: a restore from memory loads nothing of shadow.persist
KEY_ENV = "SHADOW_MANIFEST_KEY"


def is_endpoint(source: str) -> bool:
    """Whether ``source`` names a live cluster (its coordinator's address) rather than a
    checkpoint directory."""
    return source.startswith(("tcp://", "ipc://", "inproc://"))


def open_source(
    source: str, timeout: float | None = None, tuning: Tuning | None = None, sign_key: bytes | None = None
) -> MemorySource | TierSource:
    """The source ``source`` names: a cluster's memory for a coordinator address, else the
    tier at that path or URL (reported as ``local`` for a path, ``remote`` for a URL).
    ``timeout``: how long the coordinator may take to answer (default:
    ``tuning.connect_timeout_s``); ``tuning``: default :meth:`Tuning.load`; ``sign_key``:
    the manifest key a tier is read with (None: signatures are not checked)."""
    if is_endpoint(source):
        tuning = Tuning.load() if tuning is None else tuning
        return MemorySource(source, tuning.connect_timeout_s if timeout is None else timeout, tuning)
    from shadow.restore.storage_source import TierSource
    from shadow.storage.url import source_tier

    return TierSource(source_tier(source), source, sign_key=sign_key)


def cluster_tiers(src: MemorySource, sign_key: bytes | None = None) -> list[TierSource]:
    """The persisted tiers of the cluster behind ``src``, nearest first, as its last answer
    named them, each read with ``sign_key``."""
    tiers = src.tiers()
    for tier in tiers:
        tier.sign_key = sign_key
    return tiers


def pick(
    source: RestoreSource, job: str | None = None, iteration: int | None = None, progress=None
) -> tuple[Candidate, Snapshot]:
    """The newest complete checkpoint of ``source`` that reads back intact (or exactly
    ``iteration``), with its candidate.

    When picking the newest, a damaged checkpoint is skipped (with a warning) in favour of
    the next older one, and a superseded one is never taken; so is one the source refused
    (``unreadable``: a damaged manifest, or one failing its signature). An explicit
    ``iteration`` that is damaged or refused is an error saying why. Without ``job``, a
    source holding several jobs is an error."""
    listed = source.candidates(job)
    found = [c for c in listed if c.loadable]
    root = source.root
    if job is None and len({c.job for c in found}) > 1:
        raise CheckpointError(f"{root} holds several jobs {sorted({c.job for c in found})}; pass job=")
    if iteration is not None:
        found = [c for c in found if c.iteration == iteration]
        refused = [c for c in listed if c.state == UNREADABLE and c.iteration == iteration and job in (None, c.job)]
        if not found and refused:
            raise CheckpointError(
                f"the checkpoint of job {refused[-1].job} iteration {iteration} under {root} cannot be used "
                f"({refused[-1].path}): {refused[-1].error}"
            )
        if not found:
            raise CheckpointError(f"no complete checkpoint of iteration {iteration} under {root}")
        return found[-1], source.load(found[-1], progress)
    if not found:
        raise CheckpointError(_none_complete(root, listed, job))
    errors = []
    for c in reversed([c for c in found if c.state == COMPLETE]):  # never an abandoned iteration
        try:
            return c, source.load(c, progress)
        except CheckpointError as exc:
            logger.warning(
                "skipping checkpoint %s iteration %d at %s, trying the next older one: %s",
                c.job,
                c.iteration,
                c.path,
                exc,
            )
            errors.append(str(exc))
    if not errors:  # every one found was superseded or diverged: a generation record says so
        raise CheckpointError(_none_restorable(root, found))
    raise CheckpointError("every checkpoint under " + root + " is damaged: " + "; ".join(errors))


def _none_complete(root: str, listed: list[Candidate], job: str | None) -> str:
    """Why a source that lists no loadable checkpoint has none (its torn and unreadable ones)."""
    torn = [c.path for c in listed if c.state == INCOMPLETE]
    extra = f" ({len(torn)} incomplete, e.g. {torn[-1]})" if torn else ""
    bad = [c for c in listed if c.state == UNREADABLE and job in (None, c.job)]
    if bad:
        extra += f" ({len(bad)} unreadable, e.g. {bad[-1].path}: {bad[-1].error})"
    return f"no complete checkpoint under {root}{extra}"


def _none_restorable(root: str, found: list[Candidate]) -> str:
    """Why a source whose loadable checkpoints are all superseded or diverged has none to restore."""
    states = sorted({c.state for c in found})
    return (
        f"no restorable checkpoint under {root}: every one found ({len(found)}) is {' or '.join(states)} "
        "by a generation record of its job (a later run went on from an older iteration); `shadow ls` "
        "lists them, and `shadow restore iteration=N` takes a superseded one explicitly"
    )


def pick_newest(
    tiers: Sequence[RestoreSource], job: str | None = None, progress=None
) -> tuple[RestoreSource, Candidate, Snapshot]:
    """The newest complete checkpoint that reads back intact in any of ``tiers`` (nearest
    first), with its tier and candidate: :func:`pick` over several tiers at once.

    The nearest tier's newest complete checkpoint is tried first, before any other tier is
    listed (the remote tiers are copied from it: they hold nothing newer, and a restore from
    an intact local tier touches no other). Once that fails, every tier is listed and their
    complete checkpoints are tried newest first, by generation and iteration, the nearest
    tier's copy first where several hold the same one. So a damaged checkpoint falls back to
    a farther tier's copy of it, or of a newer one than the nearer tier's next, before an
    older one nearby: a local tier whose requests were skipped while the writers were behind
    may hold nothing between its damaged newest and one many iterations older (retention
    keeps the newest ``keep`` complete ones, however far apart), while the remote tier holds
    an intact copy of that newest. A checkpoint some tier lists superseded or diverged is
    never taken from another. A tier that cannot be listed, or whose read fails with anything
    but a damaged checkpoint (an unreachable store), is passed over. Raises
    :class:`CheckpointError` saying, per tier, why none was taken."""
    listed: list[tuple[int, Candidate]] = []  # (the tier's index, a candidate of it)
    why: dict[int, list[str]] = {i: [] for i in range(len(tiers))}

    def list_tier(i: int) -> None:
        try:
            listed.extend((i, c) for c in tiers[i].candidates(job))
        except Exception as exc:  # an unreachable remote tier: the others may still serve
            why[i].append(f"cannot list it: {type(exc).__name__}: {exc}")

    def newest_first() -> list[tuple[int, Candidate]]:
        found = [(i, c) for i, c in listed if c.loadable]
        if job is None and len({c.job for _, c in found}) > 1:
            raise CheckpointError(f"the tiers hold several jobs {sorted({c.job for _, c in found})}; pass job=")
        abandoned = {(c.job, c.generation, c.iteration) for _, c in found if c.state != COMPLETE}
        return sorted(
            ((i, c) for i, c in found if c.state == COMPLETE and (c.job, c.generation, c.iteration) not in abandoned),
            key=lambda ic: (ic[1].generation or 0, ic[1].iteration, -ic[0]),
            reverse=True,
        )

    if tiers:
        list_tier(0)
    all_listed = len(tiers) <= 1
    tried: set[tuple[int, str]] = set()
    unreachable: set[int] = set()
    while True:
        nxt = next(((i, c) for i, c in newest_first() if (i, c.path) not in tried and i not in unreachable), None)
        if not all_listed and (nxt is None or tried):  # the nearest tier's newest failed, or it has none
            for i in range(1, len(tiers)):
                list_tier(i)
            all_listed = True
            continue
        if nxt is None:
            break
        i, c = nxt
        tried.add((i, c.path))
        try:
            return tiers[i], c, tiers[i].load(c, progress)
        except CheckpointError as exc:
            why[i].append(str(exc))
            logger.warning(
                "skipping checkpoint %s iteration %d at %s (%s tier), trying the next newest in any tier: %s",
                c.job,
                c.iteration,
                c.path,
                tiers[i].name,
                exc,
            )
        except Exception as exc:  # the tier's store failed, not the checkpoint: its other ones would too
            unreachable.add(i)
            why[i].append(f"reading iteration {c.iteration}: {type(exc).__name__}: {exc}")
            logger.warning("tier %s failed reading %s: %s: %s", tiers[i].name, c.path, type(exc).__name__, exc)
    parts = []
    for i, tier in enumerate(tiers):
        mine = [c for j, c in listed if j == i]
        loadable = [c for c in mine if c.loadable]
        if why[i]:
            parts.append(f"{tier.name}: " + "; ".join(why[i]))
        elif not loadable:
            parts.append(f"{tier.name}: {_none_complete(tier.root, mine, job)}")
        else:
            parts.append(f"{tier.name}: {_none_restorable(tier.root, loadable)}")
    raise CheckpointError("no restorable checkpoint in any tier: " + "; ".join(parts))


def find_checkpoint(
    root: str | Storage,
    tier: str,
    job: str | None = None,
    iteration: int | None = None,
    check: bool = True,
    progress=None,
    sign_key: bytes | None = None,
) -> tuple[CheckpointInfo, Snapshot]:
    """:func:`pick` from the tier at ``root``: the checkpoint's catalog entry and its snapshot.
    ``sign_key``: the manifest key to check signatures with (None: not checked)."""
    from shadow.restore.storage_source import TierSource

    c, snap = pick(TierSource(tier, root, check, sign_key), job, iteration, progress)
    return c.handle, snap


def holds_job(
    source: str,
    job: str | None = None,
    timeout: float | None = None,
    tuning: Tuning | None = None,
    sign_key: bytes | None = None,
) -> bool:
    """Whether ``source`` holds a checkpoint of job ``job`` (any job when None) to resume
    from: for a live cluster, its memory or a tier as the coordinator knows them (``shadow
    jobs``; a reply that left jobs out counts as holding it); for a directory or URL, any
    checkpoint listed there, readable or not. A fresh start is decided only on False: a job
    held but not restorable must fail its restore, never start over silently."""
    if is_endpoint(source):
        from shadow.transport.client import ask
        from shadow.wire import messages as M

        tuning = Tuning.load() if tuning is None else tuning
        wait = tuning.connect_timeout_s if timeout is None else timeout
        reply = ask(source, M.encode("jobs"), wait, ("jobs_reply",))
        return jobs_hold(reply["jobs"], job, bool(reply.get("left_out")))
    src = open_source(source, timeout, tuning, sign_key)
    return any(c.state != INCOMPLETE for c in src.candidates(job))


def jobs_hold(rows: list, job: str | None, left_out: bool = False) -> bool:
    """Whether the rows of a ``jobs_reply`` hold job ``job`` (any: None) to resume from: a
    checkpoint in memory or a tier, or a held job that went past its start (it committed an
    iteration, or its epoch began after one: a re-attach whose bootstrap did not finish, whose
    restore must fail saying why rather than start over). A job held from iteration 0 that
    never committed one (its ranks died in their first iteration) has nothing to resume."""
    for r in rows:
        if not isinstance(r, dict) or job not in (None, r.get("name")):
            continue
        restorable = r.get("restorable")
        if isinstance(restorable, dict) and any(v is not None for v in restorable.values()):
            return True
        if r.get("held") and (r.get("committed") is not None or (r.get("base") or 0) > 0):
            return True
    return left_out


def resolve(
    source: str,
    job: str | None = None,
    iteration: int | None = None,
    timeout: float | None = None,
    attempts: int = 5,
    progress=None,
    tuning: Tuning | None = None,
    sign_key: bytes | None = None,
    sink: ParamSink | None = None,
    ranges=None,
) -> Snapshot:
    """The checkpoint to restore from ``source`` (newest complete, or ``iteration``). From
    a cluster: its memory, else the newest checkpoint intact in any of its tiers
    (:func:`pick_newest`; an explicit ``iteration``: the nearest tier's intact copy).

    ``progress(done_bytes, total_bytes)`` is called as shards arrive, if given; ``tuning``
    bounds the waits on a live cluster (default: :meth:`Tuning.load`). ``sign_key``: the
    manifest key persisted tiers are read with (default: the file ``$SHADOW_MANIFEST_KEY``
    names, if set; with none, signatures are not checked). A live cluster's memory has no
    manifest: its connection is what CURVE (``security``) protects. ``sink``: live
    parameters a fetch from memory receives the parameters into, when the cluster holds
    their layout (see :class:`ParamSink`); a tier is always read into flat arrays, so a
    damaged file, found only by its whole-file checksum, never reaches the model.
    ``ranges``: flat element ranges a fetch from memory reads only (an FSDP2 rank's rows:
    the snapshot then holds those, :attr:`Snapshot.ranges`); a tier is read whole."""
    key = sign_key
    if key is None and os.environ.get(KEY_ENV):
        from shadow.persist import signing

        key = signing.env_key()
    src = open_source(source, timeout, tuning, key)
    if not isinstance(src, MemorySource):
        return pick(src, job, iteration, progress)[1]
    errors = []
    for attempt in range(attempts):
        held = src.candidates(job)
        if not held:
            errors.append(f"memory: {src.problem}")
            break
        mem = held[-1]
        if iteration is not None and mem.iteration != iteration:
            errors.append(f"memory: holds iteration {mem.iteration}, not {iteration}")
            break
        try:
            return src.load(mem, progress, sink, ranges)
        except MovedOn as exc:  # training is live and moved on: take the newer cut
            logger.info("restore raced a live cluster (%s); retrying", exc)
            time.sleep(0.05 * (attempt + 1))
        except ShadowError as exc:
            errors.append(f"memory: {exc}")
            break
    else:
        errors.append(f"memory: the cluster kept moving on during {attempts} attempts")
    job = job or src.job
    tiers = cluster_tiers(src, key)
    if iteration is None:  # the newest intact one in any tier (a damaged one nearby is no reason to go older)
        try:
            tier, _, snap = pick_newest(tiers, job, progress)
            logger.info("restoring from the %s tier (%s): %s", tier.name, tier.root, "; ".join(errors))
            return snap
        except CheckpointError as exc:
            errors.append(str(exc))
    else:  # that iteration: the nearest tier's intact copy of it
        for tier in tiers:
            try:
                snap = pick(tier, job, iteration, progress)[1]
                logger.info("restoring from the %s tier (%s): %s", tier.name, tier.root, "; ".join(errors))
                return snap
            except CheckpointError as exc:
                errors.append(f"{tier.name}: {exc}")
            except Exception as exc:  # an unreachable remote tier
                errors.append(f"{tier.name}: {type(exc).__name__}: {exc}")
    raise ShadowError(f"no restorable checkpoint behind {source}: " + "; ".join(errors))
