"""The coordinator's side of persistence: when each tier is due, collecting the workers'
shard reports, retention, and the catalog of complete checkpoints per tier (kept in
:mod:`~shadow.coordinator.catalog`'s ``TierState``, filled from storage by its ``scan``).
Once a checkpoint's reports are all in, :mod:`~shadow.coordinator.settle` commits it by
writing its manifest, or counts its failure.

The local tier is due by its own schedule at each new cut. The remote tier is due once
its schedule has elapsed since the last remote copy; the next local checkpoint that
completes then goes up (the newest complete one), and local retention keeps it until
the copy is done. A checkpoint a worker skipped (all its images still being written)
is not a failure: it is counted, logged as one summed warning per
``SHADOW_PERSIST_SKIP_LOG_S``, and the next cut is due again; when no next cut comes (the
last iteration of a run, or a pause) the skipped cut itself is asked again
(:meth:`Persistence.retry_skipped`), so the newest state reaches the tier.

Everything it writes on a local file system (manifests, generation records, directories)
gets ``persist.mode``'s permissions (0600 files, 0700 directories by default); with
``persist.sign`` each manifest is signed (:mod:`shadow.persist.signing`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator import settle
from shadow.coordinator.catalog import TierState, scan
from shadow.coordinator.lane import StorageLane
from shadow.persist import checkpoints, retention, signing
from shadow.storage.tier import tiers_for
from shadow.wire.commit import FollowUp, Persisted, UploadCopies

logger = logging.getLogger(__name__)


class Persistence:
    """The tiers' schedules, the workers' shard reports, manifests, retention and the
    catalog of complete checkpoints.

    Threads: only the coordinator's loop thread calls it (from the ``persisted`` handler and
    the cut), so nothing is locked; the metrics thread reads ``tiers`` without writing. The
    storage I/O of a commit (the manifest, retention, deleting what a failed one wrote) runs
    on :attr:`lane` (:mod:`~shadow.coordinator.lane`), off the loop thread; what follows it
    runs back on the loop thread, and the follow-ups it asks for (uploads, deletes) go to
    :attr:`emit` (the cut's ``send``). Before the lane starts (a coordinator driven message
    by message) all of it runs at once and the follow-ups are returned, as they always were.

    ``sign_key``: the manifest key (:func:`shadow.persist.signing.load_key` of
    ``security.manifest_key``), needed when ``persist.sign`` is on and otherwise unused."""

    def __init__(
        self, persist: PersistConfig | None = None, tuning: Tuning | None = None, sign_key: bytes | None = None
    ) -> None:
        self.config = persist if persist is not None else PersistConfig()
        self.tuning = tuning if tuning is not None else Tuning.load()
        if self.config.sign and sign_key is None:
            raise ValueError(
                "persist.sign=true needs the manifest key: set security.manifest_key to a key file "
                f"(make one with `{signing.MAKE_ONE}`)"
            )
        self.sign_key = sign_key if self.config.sign else None
        self.tiers: dict[str, TierState] = {t.name: TierState(t) for t in tiers_for(self.config)}  # nearest first
        self.lane = StorageLane()  # the tiers' I/O off the loop thread, once the coordinator runs
        # where follow-ups that come after the lane's work go (the cut sets its ``send``)
        self.emit: Callable[[Any, list[FollowUp]], None] = _unsent
        self.generations: dict[str, int] = {}  # job -> newest generation seen in any tier
        for t in self.tiers.values():
            scan(t, self.generations, sign_key=self.sign_key)

    def wire(self, generation: int) -> dict[str, Any]:
        """The tiers as a ``configure`` message carries them to the workers (which rebuild
        the :class:`~shadow.config.PersistConfig` with ``from_dict``), with the job's lineage."""
        return {**self.config.to_dict(), "generation": generation}

    def unscanned(self) -> str | None:
        """Why some tier's contents are unknown (its start-up scan failed, and a retry now
        fails too), or None. Such a tier is held (:meth:`hold_unscanned`): never taken for an
        empty one, so the overwrite protection and the job's generation stay sound."""
        problems = []
        if any(t.scan_error for t in self.tiers.values()):
            self.lane.flush()  # the scan sees every write submitted before it
        for t in self.tiers.values():
            if t.scan_error:
                scan(t, self.generations, sign_key=self.sign_key)
            if t.scan_error:
                why = t.scan_error.removeprefix(f"cannot list {t.root}: ")
                problems.append(f"cannot read tier {t.name} ({t.root}): {why}")
        return "; ".join(problems) or None

    def hold_unscanned(self, job: str) -> str | None:
        """At an attach of ``job``: read again every tier whose contents are unknown; one that
        is still unreadable is held, not written for this attach (what it holds is unknown, so
        writing there could mix lineages), and counted as a failure; the attach goes on with
        memory and the other tiers. The local tier held holds the remote one too (the remote
        tier is copied from it). Returns what is held and why, or None."""
        problem = self.unscanned()
        for t in self.tiers.values():
            t.held = ""
            if t.scan_error:
                t.held = f"unreadable when job {job} attached ({t.scan_error}); not written until an attach reads it"
                t.last_error = t.held
                t.failures += 1
        local, remote = self.tiers.get("local"), self.tiers.get("remote")
        if local is not None and local.held and remote is not None and not remote.held:
            remote.held = "the local tier it is copied from is held"
        return problem

    def storage(self) -> list[dict]:
        """Where restores may look, nearest first."""
        return [{"tier": t.name, "root": t.root} for t in self.tiers.values()]

    def newest(self, job: str) -> int:
        return max((t.complete.get(job, -1) for t in self.tiers.values()), default=-1)

    def lineage(self, job: str) -> tuple[int, int]:
        """``(generation, newest complete iteration)`` of ``job`` across the tiers."""
        return self.generations.get(job, 0), self.newest(job)

    def supersede(self, job: str, generation: int, base: int, diverged: bool = False) -> None:
        """``job`` goes on from ``base`` as ``generation``: record it in every tier first, so
        no restore picks an abandoned checkpoint after ``base`` as the newest, even if the
        new generation never persists anything."""
        self.generations[job] = max(self.generations.get(job, 0), generation)
        self.lane.flush()  # every manifest submitted before is written (and recorded) before the record and the scan
        for t in self.tiers.values():
            try:
                checkpoints.write_generation(t.storage, job, generation, base, diverged, self.sign_key)
            except Exception as exc:  # storage errors are reported, never fatal
                t.last_error = f"recording generation {generation} of {job} (from iteration {base}): {exc}"
                logger.error("tier %s: %s", t.name, t.last_error)
                continue
            scan(t, self.generations, job, self.sign_key)

    def reset(self, base: int) -> None:
        self.lane.flush()  # what the previous epoch's commits lead to is recorded before the reset
        for t in self.tiers.values():
            t.last = t.last_ok = (base, time.time(), None)
            t.in_flight.clear()
            t.asked.clear()
            t.requested.clear()
            t.newest = None
            t.last_skip = (-1, 0.0)

    def local_due(self, iteration: int, tokens: int | None, writers: dict[int, int] | None = None) -> bool:
        """Whether the local tier takes the cut ``iteration``; if so, it waits for a report
        from each of ``writers`` (worker id -> its shard: every live replica writes a copy;
        None: one report per shard, from any writer)."""
        t = self.tiers.get("local")
        if t is None or t.held or writers == {} or not t.tier.schedule.due(iteration, time.time(), tokens, t.last):
            return False
        t.last = (iteration, time.time(), tokens)
        t.in_flight[iteration] = {}
        t.asked[iteration] = None if writers is None else dict(writers)
        t.requested[iteration] = time.monotonic()
        return True

    def retry_skipped(self, cut: int, writers: dict[int, int], wait_s: float) -> bool:
        """Whether to ask the local tier for the cut ``cut`` again: its last request was
        skipped at least ``wait_s`` seconds ago (every image was still being written), no
        newer one was made and nothing is in flight; if so it is recorded as asked, as
        :meth:`local_due` does (``writers`` as there)."""
        t = self.tiers.get("local")
        if t is None or t.held or not writers or t.in_flight or t.last_skip[0] != cut or t.last[0] >= cut:
            return False
        if time.monotonic() - t.last_skip[1] < wait_s:
            return False
        t.last_skip = (-1, 0.0)
        return self._asked(t, cut, writers)

    def time_due(self, cut: int, writers: dict[int, int]) -> bool:
        """Whether to ask the local tier for the cut ``cut`` because its time schedule
        (``every_s``) came due after the cut was committed, with no newer cut to take it
        (the trainers stopped, crashed, or step slower than the schedule): without this the
        newest iteration of a run that died would never reach the disk. Recorded as asked,
        as :meth:`local_due` does (``writers`` as there)."""
        t = self.tiers.get("local")
        if t is None or t.held or not writers or t.in_flight or t.last[0] >= cut:
            return False
        every = t.tier.schedule.every_s
        if not every or time.time() - t.last[1] < every:
            return False
        return self._asked(t, cut, writers)

    def ask_last(self, cut: int, writers: dict[int, int]) -> bool:
        """Whether to ask the local tier for the cut ``cut`` before the cluster's memory goes
        to another job: it has not been asked for that cut yet, nothing is in flight, and
        every shard has a live writer. Recorded as asked, as :meth:`local_due` does."""
        t = self.tiers.get("local")
        if t is None or t.held or not writers or t.in_flight or t.last[0] >= cut:
            return False
        return self._asked(t, cut, writers)

    @staticmethod
    def _asked(t: TierState, cut: int, writers: dict[int, int]) -> bool:
        """Record the local tier ``t`` as asked for the cut ``cut`` of ``writers`` (a request
        outside its schedule, as :meth:`local_due` records one); True."""
        t.last = (cut, time.time(), t.last[2])
        t.in_flight[cut] = {}
        t.asked[cut] = dict(writers)
        t.requested[cut] = time.monotonic()
        return True

    def file_for(self, tier: str, shard: int, nshards: int) -> str | None:
        """The file name tier ``tier`` gives shard ``shard`` of ``nshards`` (None: no such tier)."""
        t = self.tiers.get(tier)
        return None if t is None else checkpoints.shard_name(shard, nshards, t.tier.codec.compress)

    def on_report(self, job, rep: Persisted, nshards: int) -> list[FollowUp]:
        """Record one shard copy's report (``rep.worker``: the writer's id); once every copy
        asked for is in, settle the checkpoint (:meth:`_settle`). Returns what to send next."""
        tier = self.tiers.get(rep.tier)
        if tier is None or rep.iteration not in tier.in_flight:
            return []
        if rep.worker < 0:  # a report that does not name its writer: the shard's one writer
            rep = dataclasses.replace(rep, worker=rep.shard)
        asked = tier.asked.get(rep.iteration)  # None: a report per shard, from any writer
        who = rep.worker if asked is not None else rep.shard
        if asked is not None and who not in asked:
            return []
        tier.in_flight[rep.iteration][who] = rep
        return self._settle(tier, job, rep.iteration, nshards)

    def writer_lost(self, job, worker: int, nshards: int) -> list[FollowUp]:
        """Worker ``worker`` is lost: the copies it was asked to write will not come. A
        checkpoint in flight whose shard has another copy asked goes on without it (and
        completes once the others are in); one whose shard no one else writes fails. Returns
        what to send next, as :meth:`on_report` does."""
        follow: list[FollowUp] = []
        for tier in self.tiers.values():
            for it in list(tier.asked):
                asked = tier.asked[it]
                if not asked or worker not in asked or worker in tier.in_flight.get(it, {}):
                    continue
                shard = asked[worker]
                if any(s == shard for w, s in asked.items() if w != worker):
                    del asked[worker]  # the other replicas' copies stand for it
                else:
                    error = f"worker {worker}, the last writer of this shard, was lost"
                    tier.in_flight[it][worker] = Persisted(
                        epoch=job.epoch, iteration=it, tier=tier.name, shard=shard, ok=False, error=error, worker=worker
                    )
                logger.warning(
                    "tier %s: checkpoint of iteration %d: worker %d was lost while writing", tier.name, it, worker
                )
                follow += self._settle(tier, job, it, nshards)
        return follow

    def _settle(self, tier: TierState, job, iteration: int, nshards: int) -> list[FollowUp]:
        """Once every report asked for is in: commit the checkpoint of ``iteration``, or
        count its failure (or skip) and drop what was written of it (:mod:`settle`). A
        finished remote copy lets local retention drop what it held for it."""
        got: dict[int, Persisted] = tier.in_flight[iteration]
        asked = tier.asked.get(iteration)
        if len(got) < (nshards if asked is None else len(asked)):
            return []
        del tier.in_flight[iteration]
        tier.asked.pop(iteration, None)
        tier.requested.pop(iteration, None)
        problem = settle.copies_differ(got.values())
        if problem or not all(r.ok for r in got.values()):
            follow = settle.not_taken(tier, job, iteration, got, problem, self.tuning.persist_skip_log_s)
            follow += self._discard(tier, job, iteration)
        else:
            follow = self._commit(tier, job, iteration, got)
        if tier.name == "remote" and "local" in self.tiers:  # a copy ended: what local retention held may go
            local, retain = self.tiers["local"], self._retention(self.tiers["local"], job.name)

            def then(deleted: list[str] | None, exc: BaseException | None) -> list[FollowUp]:
                if exc is not None:  # storage errors are reported, never fatal
                    logger.error("tier local: retention after a remote copy: %s: %s", type(exc).__name__, exc)
                    return []
                return settle.forget(iteration, deleted or [])

            follow += self._later(job, f"retention of tier {local.name}", retain, then)
        return follow

    def _later(
        self,
        job,
        what: str,
        work: Callable[[], Any],
        then: Callable[[Any, BaseException | None], list[FollowUp]],
    ) -> list[FollowUp]:
        """``work()`` on the lane, then ``then(result, error)`` on the loop thread, which says
        what follows: returned here when it ran at once (no lane thread), else sent through
        :attr:`emit` when it runs."""
        out: list[FollowUp] = []
        now = True

        def done(result: Any, exc: BaseException | None) -> None:
            follow = then(result, exc)
            if now:
                out.extend(follow)
            elif follow:
                self.emit(job, follow)

        self.lane.submit(what, work, done)
        now = False
        return out

    def _discard(self, tier: TierState, job, iteration: int) -> list[FollowUp]:
        """Delete what was written of a checkpoint that failed (on the lane)."""
        name, generation = job.name, job.generation
        self.lane.submit(
            f"discarding iteration {iteration} on tier {tier.name}",
            lambda: settle.discard(tier, name, iteration, generation),
            lambda _, __: None,
        )
        return []

    def _retention(self, tier: TierState, job_name: str) -> Callable[[], list[str]]:
        """Retention of ``tier``, to run on the lane (what it reads of the state is read now);
        on the local tier, checkpoints from the oldest one whose remote copy is in flight on
        are kept (for SHADOW_PERSIST_UPLOAD_HOLD_S at most)."""
        keep = tier.tier.schedule.keep
        remote = self.tiers.get("remote")
        now, hold = time.monotonic(), self.tuning.persist_upload_hold_s
        copying = [
            it for it, t in (remote.requested.items() if remote and tier.name == "local" else ()) if now - t < hold
        ]
        busy = set(tier.in_flight)  # (a copy: the loop changes the dict while the lane deletes)
        storage, name = tier.storage, tier.name

        def retain() -> list[str]:
            kept = keep
            if kept and copying:
                done = checkpoints.list_checkpoints(storage, name, job_name)
                kept = max(kept, sum(1 for c in done if c.iteration >= min(copying)))
            return retention.retain(storage, job_name, kept, busy=busy)

        return retain

    def _commit(self, tier: TierState, job, iteration: int, got: dict[int, Persisted]) -> list[FollowUp]:
        """Every copy of ``iteration`` is in and sound: write its manifest (the commit) and run
        retention on the lane, then record it in the catalog and say what follows (the remote
        copy, deletes)."""
        try:
            manifest = settle.new_manifest(tier, job, iteration, got)
        except Exception as exc:  # (a report that cannot make a manifest) counted as a failed write
            return settle.manifest_failed(tier, job, iteration, exc) + self._discard(tier, job, iteration)
        name, storage, sign_key, local = job.name, tier.storage, self.sign_key, tier.name == "local"
        retain = self._retention(tier, job.name)

        def work() -> list[str]:
            checkpoints.write_manifest(storage, name, iteration, manifest, sign_key, parents=local)
            return retain()

        def then(deleted: list[str] | None, exc: BaseException | None) -> list[FollowUp]:
            if exc is not None:  # storage errors are reported, never fatal
                return settle.manifest_failed(tier, job, iteration, exc) + self._discard(tier, job, iteration)
            deleted = deleted or []
            follow = settle.forget(iteration, deleted) if local else []
            skip_log_s = self.tuning.persist_skip_log_s
            if settle.completed(tier, job, iteration, manifest, got, deleted, skip_log_s) and local:
                follow += self._remote_due(job)
            return follow

        return self._later(job, f"the manifest of iteration {iteration} on tier {tier.name}", work, then)

    def _remote_due(self, job) -> list[FollowUp]:
        """When the remote schedule has elapsed since the last remote copy: copy the newest
        complete local checkpoint (unless it is there or on its way already)."""
        remote, local = self.tiers.get("remote"), self.tiers["local"]
        if remote is None or remote.held or local.newest is None:
            return []
        iteration, tokens, got = local.newest
        if (
            iteration in remote.in_flight
            or iteration <= remote.complete.get(job.name, -1)
            or not remote.tier.schedule.due(iteration, time.time(), tokens, remote.last)
        ):
            return []
        remote.last = (iteration, time.time(), tokens)
        remote.in_flight[iteration] = {}
        remote.asked[iteration] = {r.worker: shard for shard, r in got.items()}
        remote.requested[iteration] = time.monotonic()
        return [UploadCopies(iteration, dict(got))]


def _unsent(job, follows: list[FollowUp]) -> None:
    """:attr:`Persistence.emit` before a cut sets it: nothing to send them to."""
    if follows:
        logger.warning("follow-ups of a commit with no cut to send them: %s", follows)
