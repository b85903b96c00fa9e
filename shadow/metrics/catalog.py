"""Every metric shadow exports, in one place: name, type, help and labels.

The coordinator, the workers and the trainers build their samples from these entries
(``shadow.metrics`` collectors), the Grafana dashboard in ``deploy/grafana`` may only
reference them, and the tests scrape each endpoint and check the names below appear.

Types follow Prometheus: a ``counter`` ``x`` is exposed as ``x_total``; a ``summary``
``x`` as ``x_sum`` and ``x_count`` (so ``rate(x_sum) / rate(x_count)`` is the mean per
event, e.g. replay seconds per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  #: "gauge", "counter" or "summary"
    help: str
    labels: tuple[str, ...] = ()

    def exposed(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "summary":
            return (self.name + "_sum", self.name + "_count")
        return (self.name,)


def _m(name: str, kind: str, help: str, *labels: str) -> Metric:
    return Metric(name, kind, help, labels)


COORDINATOR = (
    _m(
        "shadow_refused_messages",
        "counter",
        "Control messages refused because of their sender, by role (peer: unauthenticated) and reason.",
        "role",
        "reason",
    ),
    _m("shadow_workers_expected", "gauge", "Worker slots the cluster is configured for."),
    _m("shadow_workers", "gauge", "Workers by health (ok, joining, stale, out, lost).", "health"),
    _m(
        "shadow_job_degraded",
        "gauge",
        "1 while the job is degraded (streaming paused until the resync).",
        "training_job",
    ),
    _m("shadow_job_epoch", "gauge", "The job's epoch: it grows by one at every (re-)attach.", "training_job"),
    _m(
        "shadow_committed_iteration",
        "gauge",
        "Newest iteration every shard has applied: the in-memory checkpoint.",
        "training_job",
    ),
    _m("shadow_lag_iterations", "gauge", "Iterations the trainers have sent beyond the committed one.", "training_job"),
    _m(
        "shadow_lag_seconds",
        "gauge",
        "Seconds since the committed iteration was reached, while the trainers are ahead of it (0 when caught up).",
        "training_job",
    ),
    _m(
        "shadow_resyncs",
        "counter",
        "Re-attaches after a degrade (each rebuilds the workers' state from the trainers).",
        "training_job",
    ),
    _m("shadow_worker_applied_iteration", "gauge", "Newest iteration each worker has applied.", "worker"),
    _m("shadow_frames_received", "counter", "Gradient and state frames each worker received.", "worker"),
    _m("shadow_bytes_received", "counter", "Frame bytes each worker received.", "worker"),
    _m("shadow_rejected_frames", "counter", "Frames and messages refused, by worker and reason.", "worker", "reason"),
    _m(
        "shadow_replay",
        "summary",
        "Seconds each worker spent applying iterations (sum) and the iterations applied (count).",
        "worker",
    ),
    _m("shadow_persist_checkpoints", "counter", "Complete checkpoints written per tier since start.", "tier"),
    _m("shadow_persist_failures", "counter", "Checkpoints of a tier that failed (a shard's write or copy).", "tier"),
    _m(
        "shadow_persist_skipped",
        "counter",
        "Checkpoint requests of a tier that a worker skipped because its "
        "images were all still being written (not failures: the next cut is due again).",
        "tier",
    ),
    _m("shadow_persist_bytes", "counter", "Bytes of complete checkpoints written per tier since start.", "tier"),
    _m(
        "shadow_persist_duration_seconds",
        "gauge",
        "Seconds the newest complete checkpoint of a tier took, request to manifest (slowest shard).",
        "tier",
    ),
    _m(
        "shadow_checkpoint_complete_timestamp_seconds",
        "gauge",
        "Unix time the newest complete checkpoint of "
        "each tier (memory, local, remote) was reached: what a scheduler reads before it preempts.",
        "tier",
    ),
    _m(
        "shadow_checkpoint_complete_iteration", "gauge", "Iteration of the newest complete checkpoint per tier.", "tier"
    ),
    _m("shadow_auth_refused", "counter", "Connections refused by CURVE authentication, by reason.", "reason"),
)

WORKER = (
    _m("shadow_worker_up_seconds", "gauge", "Seconds since this worker process started."),
    _m("shadow_worker_stale", "gauge", "1 while this worker's state is stale (waiting for a resync or a copy)."),
    _m("shadow_worker_applied", "gauge", "Newest iteration this worker has applied (-1: none)."),
    _m("shadow_worker_seen", "gauge", "Newest iteration this worker has received frames of (-1: none)."),
    _m("shadow_worker_frames_received", "counter", "Frames this worker received."),
    _m("shadow_worker_bytes_received", "counter", "Frame bytes this worker received."),
    _m("shadow_worker_rejected_frames", "counter", "Frames and messages this worker refused, by reason.", "reason"),
    _m("shadow_worker_replay", "summary", "Seconds spent applying iterations (sum) and iterations applied (count)."),
    _m(
        "shadow_worker_resyncs",
        "counter",
        "Times this worker's state was rebuilt after its first (a resync from the trainers or a copy from a peer).",
    ),
    _m(
        "shadow_worker_persist",
        "summary",
        "Seconds spent writing (local) or copying (remote) shards (sum) and shards written (count), per tier.",
        "tier",
    ),
    _m("shadow_worker_persist_bytes", "counter", "Shard bytes written per tier.", "tier"),
    _m("shadow_worker_persist_failures", "counter", "Shard writes or copies that failed, per tier.", "tier"),
)

TRAINER = (
    _m("shadow_trainer_iteration", "gauge", "Iterations this rank has completed while attached.", "rank"),
    _m(
        "shadow_trainer_committed_iteration",
        "gauge",
        "Newest iteration the cluster has committed, as this rank last heard.",
        "rank",
    ),
    _m(
        "shadow_trainer_hook",
        "summary",
        "Seconds of shadow work on the training thread (comm hook, staging, "
        "commit) summed over steps (sum) and the steps (count).",
        "rank",
    ),
    _m(
        "shadow_trainer_blocked_seconds",
        "counter",
        "Seconds the training thread waited for the shadow (full staging ring, policy block).",
        "rank",
    ),
    _m("shadow_trainer_staging_ring_occupancy", "gauge", "Fraction of the staging ring in use now.", "rank"),
    _m("shadow_trainer_staging_ring_high_water", "gauge", "Highest fraction of the staging ring ever in use.", "rank"),
    _m("shadow_trainer_bytes_sent", "counter", "Bytes this rank sent to the shadow cluster.", "rank"),
    _m("shadow_trainer_messages_sent", "counter", "Messages this rank sent to the shadow cluster.", "rank"),
    _m("shadow_trainer_degraded", "gauge", "1 while this rank is not streaming because the job is degraded.", "rank"),
    _m(
        "shadow_trainer_unprotected_steps",
        "gauge",
        "Steps in a row this rank trained without new checkpoints (0 while protected).",
        "rank",
    ),
)

ALL = {m.name: m for m in COORDINATOR + WORKER + TRAINER}


def exposed_names() -> set[str]:
    """Every sample name any shadow endpoint exposes."""
    return {n for m in ALL.values() for n in m.exposed()}
