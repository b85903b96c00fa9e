"""The committed cut, and freezing it.

Iteration k is committed only when every (healthy) worker has reported ``prepared(k)``;
then every worker is told to apply through k (the writers of a persisted checkpoint
snapshot it in that pass) and every trainer rank learns the new cut, its flow-control
credit. A failure that breaks the chain *degrades* the job: the checkpoint stays frozen at
the last cut until every worker answers again and the trainers resync.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import JobStatus
from shadow.wire.commit import ApplyCut, FollowUp, Forget, Persisted, Prepared, Upload, UploadCopies

logger = logging.getLogger(__name__)

Msg = dict[str, Any]


class Cut:
    """Handlers ``configured``, ``prepared``, ``persisted`` and ``audited`` (all from workers),
    the cut itself (:meth:`advance`), and :meth:`degrade` / :meth:`maybe_resync`."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence) -> None:
        self.state, self.out, self.persist = state, out, persist
        persist.emit = self.send  # what a commit finished on the storage lane asks for next

    def on_configured(self, env: list[bytes], msg: Msg) -> None:
        st, job = self.state, self.state.job
        w = st.worker(env[0])
        if w is None or job is None or msg["epoch"] != job.epoch:
            return
        w.configured = msg["epoch"]
        w.prepared, w.stale = job.base - 1, ""
        w.kept = job.keep is not None and msg.get("kept") is True
        if job.status == JobStatus.CONFIGURING and all(x.configured == job.epoch for x in st.workers):
            job.status = JobStatus.BOOTSTRAPPING
            workers = [
                {
                    "id": x.id,
                    "data": x.data,
                    "start": job.ranges[x.id][0],
                    "stop": job.ranges[x.id][1],
                    "shard": st.shard_of(x),
                    "mode": x.data_mode,
                }
                for x in st.workers
            ]
            self.out.to_trainers(
                job,
                "attached",
                each=lambda rank: {**st.data_keys(rank, st.workers), "token": job.rank_token(rank)},
                epoch=job.epoch,
                job_id=job.job_id,
                workers=workers,
                **({"took_over": job.took_over} if job.took_over else {}),
                # every worker kept the base: the ranks prove their state equal instead of sending it
                **({"keep": True} if job.keep is not None and all(x.kept for x in st.workers) else {}),
            )
            logger.info("job %s epoch %d attached: %d ranks, %d workers", job.name, job.epoch, job.world, len(workers))

    def on_prepared(self, env: list[bytes], msg: Msg) -> None:
        st, job = self.state, self.state.job
        w = st.worker(env[0])
        if w is None or job is None or msg["epoch"] != job.epoch:
            return
        p = Prepared(msg["epoch"], msg["iteration"], msg["tokens"])
        w.prepared = max(w.prepared, p.iteration)
        if p.tokens is not None:
            st.tokens[p.iteration] = p.tokens
        self.advance()

    def _live(self) -> list:
        """The workers the cut waits for: every one, or with replicas the healthy ones."""
        st, now = self.state, time.monotonic()
        if st.replicas == 1:
            return st.workers
        return [x for x in st.workers if not x.out_of_service and not x.undelivered and st.alive(x, now)]

    def _writers(self, live: list) -> dict[int, int]:
        """Every live replica of a shard writes its own copy, to its own disk (node-local
        tiers): worker id -> shard; none when some shard has no live copy."""
        writers = {x.id: self.state.shard_of(x) for x in live}
        return writers if len(set(writers.values())) == self.state.nshards else {}

    def advance(self) -> None:
        """The cut: the newest iteration every healthy worker has prepared (and, while a
        replica copies from its peer, no further than the copied iteration)."""
        st, job = self.state, self.state.job
        live = self._live()
        if job is None or not live:
            return
        cut = min(x.prepared for x in live)
        if job.cut_ceiling is not None:
            cut = min(cut, job.cut_ceiling)
        if cut <= job.cut:
            return
        job.cut, job.cut_time = cut, time.time()
        st.retired = None  # the new epoch holds its base: restores read it, not the previous epoch's
        if job.status == JobStatus.BOOTSTRAPPING:
            job.status = JobStatus.RUNNING
        writers = self._writers(live)
        # a diverged epoch is never persisted again (what it holds is not the trainer's state)
        persist = job.diverged is None and self.persist.local_due(cut, st.tokens.get(cut), writers)
        if persist:
            job.writers = {}
            for wid, shard in writers.items():
                job.writers.setdefault(shard, set()).add(wid)
        for x in live:
            # a writer snapshots the cut in the apply pass itself
            self._send(x, ApplyCut(job.epoch, cut, persist=persist and x.id in writers))
        self.out.to_trainers(job, "progress", epoch=job.epoch, applied=cut)
        for it in [i for i in st.tokens if i < cut]:
            del st.tokens[it]

    def retry_persist(self) -> None:
        """(Periodic.) The local tier's request for the cut was skipped (its images were all
        still being written) and no newer cut has come to be due instead, as after a run's
        last iteration; or the tier's time schedule came due after the cut with no newer cut
        to take it (the trainers stopped or died): ask the writers for that cut, which they
        still hold."""
        st, job = self.state, self.state.job
        if job is None or job.diverged is not None or job.status not in (JobStatus.RUNNING, JobStatus.DETACHED):
            return
        live = self._live()
        writers = self._writers(live)
        if self.persist.retry_skipped(job.cut, writers, st.tuning.heartbeat_s):
            why = "skipped, nothing newer"
        elif job.cut >= job.base and self.persist.time_due(job.cut, writers):
            why = "its time schedule came due with no newer iteration"
        else:
            return
        job.writers = {}
        for wid, shard in writers.items():
            job.writers.setdefault(shard, set()).add(wid)
        logger.info("tier local: asking for the checkpoint of iteration %d (%s)", job.cut, why)
        for x in live:
            if x.id in writers:
                self._send(x, ApplyCut(job.epoch, job.cut, persist=True))

    def keep_last(self) -> str | None:
        """Before the cluster's memory goes to another job: the held job's last committed
        iteration to the local tier, asked of its writers once (they still hold it, as in
        :meth:`retry_persist`). Returns what the new job waits for while it is written, or
        None once it is on the tier, or cannot be (no local tier, nothing committed, a
        diverged or degraded job, a shard with no live writer, a request that failed)."""
        job = self.state.job
        t = self.persist.tiers.get("local")
        if job is None or t is None or t.held or job.diverged is not None or job.cut < job.base:
            return None
        if job.status not in (JobStatus.RUNNING, JobStatus.DETACHED) or t.complete.get(job.name, -1) >= job.cut:
            return None
        waiting = f"the local tier is writing job {job.name!r}'s last iteration {job.cut}, before its memory is reused"
        if job.cut in t.in_flight:
            return waiting
        live = self._live()
        writers = self._writers(live)
        if not self.persist.ask_last(job.cut, writers):
            return None  # asked before and it did not complete, or no live writer for some shard
        job.writers = {}
        for wid, shard in writers.items():
            job.writers.setdefault(shard, set()).add(wid)
        logger.info("tier local: asking for job %s's last iteration %d before its memory is reused", job.name, job.cut)
        for x in live:
            if x.id in writers:
                self._send(x, ApplyCut(job.epoch, job.cut, persist=True))
        return waiting

    def on_persisted(self, env: list[bytes], msg: Msg) -> None:
        st, job = self.state, self.state.job
        if job is None or msg["epoch"] != job.epoch:
            return
        problem = self._not_its_shard(env, msg)
        if problem:
            st.refuse(st.sender_role, "not_the_writer")
            logger.warning("refused a persisted report: %s", problem)
            self.out.reply(env, "error", code="refused", message=problem)
            return
        w = st.worker(env[0])
        assert w is not None  # _not_its_shard found it
        self.send(job, self.persist.on_report(job, Persisted.from_msg(msg, w.id), st.nshards))

    def writer_lost(self, w) -> None:
        """Worker ``w`` is lost: the checkpoint copies it was writing will not come."""
        job = self.state.job
        if job is not None:
            self.send(job, self.persist.writer_lost(job, w.id, self.state.nshards))

    def send(self, job, follows: list[FollowUp]) -> None:
        """Send what settling a checkpoint asks for next: each copy's writer uploads it to
        the remote tier; every worker deletes the directories retention dropped."""
        st = self.state
        for f in follows:
            if isinstance(f, UploadCopies):
                for r in f.copies.values():
                    x = next((y for y in st.workers if y.id == r.worker), None)
                    if x is not None:
                        self._send(x, Upload(job.epoch, f.iteration, r.bytes, r.checksum))
            else:
                for x in st.workers:
                    self._send(x, Forget(job.name, list(f.dirs)))

    def _send(self, w, message: ApplyCut | Upload | Forget) -> None:
        self.out.to_worker(w, message.kind, **message.fields())

    def _not_its_shard(self, env: list[bytes], msg: Msg) -> str:
        """Why a ``persisted`` report cannot be taken from this connection ("" when it can):
        only the worker asked to write a shard reports it (after a coordinator restart, before
        any request: a worker of that shard), and only under the file name the tier gives it."""
        st, job, shard = self.state, self.state.job, msg["shard"]
        w = st.worker(env[0])
        assert job is not None
        writer = job.writers.get(shard)
        if w is None or not (w.id in (writer or ()) or (writer is None and st.shard_of(w) == shard)):
            who = "an unregistered connection" if w is None else f"worker {w.id}"
            return f"{who} reported shard {shard} of iteration {msg['iteration']}, which it was not asked to write"
        want = self.persist.file_for(msg["tier"], shard, st.nshards)
        if msg["ok"] and want is not None and msg["file"] != want:
            return f"worker {w.id} reported shard {shard} as {msg['file']!r}; the {msg['tier']} tier names it {want!r}"
        return ""

    def on_audited(self, env: list[bytes], msg: Msg) -> None:
        job = self.state.job
        if job is None or msg["epoch"] != job.epoch:
            return
        a = job.audit
        a["checked"] += msg["checked"]
        a["last_iteration"] = msg["iteration"]
        a["max_ulp"] = max(a["max_ulp"], msg["max_ulp"])
        if msg["ok"] and msg["detail"]:
            a["last_deviation"] = f"iteration {msg['iteration']}: {msg['detail']}"
        if msg["ok"] and job.diverged is None:
            job.verified = max(job.verified, msg["iteration"])
        if not msg["ok"]:
            a["mismatches"] += 1
            a["last_mismatch"] = f"iteration {msg['iteration']}: {msg['detail']}"
            logger.error(
                "divergence audit failed at iteration %d (max %d ulp): %s",
                msg["iteration"],
                msg["max_ulp"],
                msg["detail"],
            )
            self.out.to_trainers(
                job, "audit", epoch=job.epoch, iteration=msg["iteration"], ok=False, detail=msg["detail"]
            )
            self.diverge(job, max(job.verified, job.base), f"audit of iteration {msg['iteration']}: {msg['detail']}")

    def diverge(self, job, verified: int, why: str) -> None:
        """The shadow's state differs from the trainer's after iteration ``verified`` (the
        newest audited bit-identical, else the epoch's base, which was copied from the
        trainer). That is final for this epoch: memory stops serving the job, nothing after
        ``verified`` is persisted, and every tier records a new generation from ``verified``
        so no checkpoint of this epoch after it is ever restorable (``shadow ls`` lists them
        superseded). The trainers resync: a new epoch copied from their state is right again."""
        if job.diverged is not None:
            return
        job.diverged = verified
        generation = max(job.generation, self.persist.generations.get(job.name, 0)) + 1
        self.persist.supersede(job.name, generation, verified, diverged=True)
        logger.error(
            "job %s epoch %d: the shadow diverged from the trainer after iteration %d (%s); checkpoints after it "
            "are superseded (generation %d) and memory serves none until the trainers resync",
            job.name,
            job.epoch,
            verified,
            why,
            generation,
        )
        self.degrade(f"the shadow diverged from the trainer after iteration {verified} ({why})")

    def degrade(self, reason: str) -> None:
        """Freeze the checkpoint at the current cut: the trainers hear why, and a resync
        follows once every worker answers again."""
        job = self.state.job
        if job is None or job.status in (JobStatus.DETACHED, JobStatus.CONFIGURING):
            return
        job.status, job.reason, job.degraded_at = JobStatus.DEGRADED, reason, time.monotonic()
        self.out.to_trainers(job, "degraded", epoch=job.epoch, reason=f"{reason}; checkpoint frozen at {job.cut}")
        self.maybe_resync()

    def maybe_resync(self) -> None:
        """Once every worker slot is alive again, ask the trainers to resync the cluster
        (a new epoch bootstrapped from their state at an iteration boundary)."""
        st, job, now = self.state, self.state.job, time.monotonic()
        if job is None or job.status != JobStatus.DEGRADED or job.resync_requested:
            return
        if len(st.workers) < st.expected or not all(st.alive(w, now) for w in st.workers):
            return
        if not all(w.last_seen > job.degraded_at for w in st.workers):
            return  # every worker must have answered since the failure (a frozen one has not)
        job.resync_requested = True
        st.resyncs[job.name] = st.resyncs.get(job.name, 0) + 1
        logger.info("job %s: all %d workers alive; asking the trainers to resync", job.name, len(st.workers))
        self.out.to_trainers(job, "resync", epoch=job.epoch)
