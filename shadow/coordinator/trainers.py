"""What the coordinator hears from trainer ranks besides attach/detach: heartbeats (how a
restarted coordinator finds them; how lost messages are found; whether a job's trainers are
still there, :func:`heard_window_s`), and ``lagging`` (policy skip)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from shadow.config.tuning import Tuning
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.cut import Cut
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.records import JobStatus
from shadow.coordinator.replicas import Replicas

logger = logging.getLogger(__name__)


Msg = dict[str, Any]


def heard_window_s(tuning: Tuning) -> float:
    """How recent a rank's last ``trainer_hb`` must be for the rank to count as still there:
    ``SHADOW_WORKER_LOST_S``, the grace the lost-message check gives a rank's heartbeat (and
    the silence after which a worker is lost). Ranks heartbeat every ``SHADOW_HEARTBEAT_S``."""
    return tuning.worker_lost_s


class Trainers:
    """Handlers ``trainer_hb``, ``paused`` and ``lagging`` (trainers), and the periodic
    :meth:`check_transit`."""

    def __init__(self, state: ClusterState, out: Outbox, cut: Cut, replicas: Replicas) -> None:
        self.state, self.out, self.cut, self.replicas = state, out, cut, replicas

    def check_transit(self, now: float | None = None) -> None:
        """Frames lost in transit with nothing sent after them (so no sequence gap shows):
        a rank reported, at least SHADOW_WORKER_LOST_S ago, having sent more messages to a
        worker than the worker has received, the worker has received nothing since, and it
        said so in a heartbeat sent once that grace had passed.

        A worker is judged on what it reported, never on its silence: one whose loop was busy
        (a long replay, a starved CPU) reports nothing meanwhile, and its last heartbeat from
        before the grace ran out says nothing about frames still queued for it. Its next one
        either shows them taken or shows them missing."""
        now = time.monotonic() if now is None else now
        job = self.state.job
        if job is None or job.status not in (JobStatus.RUNNING, JobStatus.BOOTSTRAPPING):
            return
        grace = heard_window_s(self.state.tuning)
        for rank, samples in job.sent.items():
            sample = None
            while len(samples) > 1 and now - samples[1][0] >= grace:
                samples.popleft()
            if samples and now - samples[0][0] >= grace:
                sample = samples[0]
            if sample is None:
                continue
            t, sent = sample
            for w in self.state.workers:
                if (
                    w.epoch != job.epoch
                    or w.undelivered
                    or w.out_of_service
                    or w.busy_at >= t
                    or w.last_seen < t + grace  # no report since the frames had their grace
                    or w.joined_at >= t
                    or w.id >= len(sent)
                    or rank >= len(w.seq)
                ):
                    continue
                if w.seq[rank] < sent[w.id]:
                    w.undelivered = (
                        f"{sent[w.id] - w.seq[rank]} data messages from rank {rank} never arrived "
                        f"(received {w.seq[rank]} of {sent[w.id]})"
                    )
                    logger.error("worker %d: %s", w.id, w.undelivered)
                    self.replicas.down(w, f"worker {w.id}: {w.undelivered}")
                    return

    def on_trainer_hb(self, env: list[bytes], msg: Msg) -> None:
        """Trainer ranks heartbeat so that a restarted coordinator can find them again (and
        so that they can tell it is there: every heartbeat is answered)."""
        self.out.reply(env, "alive", epoch=msg["epoch"])
        job = self.state.job
        if job is None and len(self.state.workers) < self.state.expected:
            return  # just restarted: the workers have not all rejoined yet, the job may yet be rebuilt
        if job is None or msg["job_id"] != job.job_id or msg["epoch"] != job.epoch:
            self.out.reply(
                env,
                "degraded",
                epoch=msg["epoch"],
                reason=(
                    f"the coordinator does not hold this session (epoch {msg['epoch']}; it holds "
                    f"{'no job' if job is None else f'epoch {job.epoch}'})"
                ),
            )
            now = time.monotonic()
            if job is None and all(
                self.state.alive(w, now) for w in self.state.workers
            ):  # a cluster without the job: re-attach
                self.out.reply(env, "resync", epoch=msg["epoch"])
            return
        if not 0 <= msg["rank"] < job.world:
            self.state.rejected.add("bad_rank")
            return
        if job.trainers.get(msg["rank"]) != env[0] and not job.rank_token_ok(msg["rank"], msg.get("token")):
            # a connection that is not the rank's: only the rank's token (from its attached) rebinds it
            self.state.refuse(self.state.sender_role, "not_the_rank")
            logger.warning("refused a heartbeat naming rank %d from another connection without its token", msg["rank"])
            return
        job.heard[msg["rank"]] = time.monotonic()
        if job.dropped:  # a rank of a dropped job came back: it stops streaming, and is never asked to resync
            self.out.reply(env, "degraded", epoch=job.epoch, reason=job.dropped)
            return
        job.sent.setdefault(msg["rank"], deque(maxlen=256)).append((time.monotonic(), msg["seq"]))
        if job.trainers.get(msg["rank"]) == env[0]:
            return
        new = msg["rank"] not in job.trainers
        job.trainers[msg["rank"]] = env[0]
        logger.info("job %s: trainer rank %d %s", job.name, msg["rank"], "found" if new else "reconnected")
        if job.cut >= job.base:
            self.out.reply(env, "progress", epoch=job.epoch, applied=job.cut)
        if job.status == JobStatus.DEGRADED:
            self.out.reply(env, "degraded", epoch=job.epoch, reason=job.reason)
            if job.resync_requested:
                self.out.reply(env, "resync", epoch=job.epoch)

    def on_paused(self, env: list[bytes], msg: Msg) -> None:
        """A rank stopped streaming on its own (it heard nothing from the coordinator for a
        while): the job cannot advance without its frames, so degrade it; the resync follows
        once every worker answers."""
        job = self.state.job
        if job is None or msg["epoch"] != job.epoch or job.status in (JobStatus.DEGRADED, JobStatus.DETACHED):
            return  # no job: the heartbeat path asks for a fresh attach once the cluster is whole
        if not self.state.from_rank(env, msg["rank"]):
            return
        self.cut.degrade(f"rank {msg['rank']} stopped streaming: {msg['reason']}")

    def on_lagging(self, env: list[bytes], msg: Msg) -> None:
        """Policy skip: a rank ran more than SHADOW_MAX_LAG iterations ahead and stopped streaming."""
        job = self.state.job
        if job is None or msg["epoch"] != job.epoch or job.status in (JobStatus.DEGRADED, JobStatus.DETACHED):
            return
        if not self.state.from_rank(env, msg["rank"]):
            return
        behind = [
            w.id for w in self.state.workers if w.prepared < msg["iteration"] - self.state.tuning.max_lag_iterations
        ]
        self.cut.degrade(
            f"rank {msg['rank']} reached iteration {msg['iteration']} with the cluster at "
            f"{msg['applied']} (policy skip); workers {behind} are behind"
        )
