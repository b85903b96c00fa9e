"""The coordinator's samples for its /metrics endpoint (read at scrape time; see
:mod:`shadow.metrics`): the cluster view of every worker, the job, and the tiers."""

from __future__ import annotations

import time
from typing import Any

from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import Health, JobStatus
from shadow.metrics import Samples

#: the health states of registered workers, as the metric ``shadow_workers`` labels them
HEALTH = tuple(h.value for h in Health if h is not Health.STARTING)


def samples(st: ClusterState, persist: Persistence, guard: Any = None) -> Samples:
    """The :data:`shadow.metrics.COORDINATOR` samples of a coordinator's state, tiers and guard."""
    now, job = time.monotonic(), st.job
    workers = list(st.workers)
    counts = dict.fromkeys(HEALTH, 0)
    for w in workers:
        counts[st.health(w, now).value] += 1
    out: Samples = {
        "shadow_workers_expected": [((), st.expected)],
        "shadow_workers": [((h,), n) for h, n in counts.items()],
        "shadow_worker_applied_iteration": [((str(w.id),), w.applied) for w in workers],
        "shadow_frames_received": [((str(w.id),), w.frames_in) for w in workers],
        "shadow_bytes_received": [((str(w.id),), w.bytes_in) for w in workers],
        "shadow_rejected_frames": [
            *(((str(w.id), r), n) for w in workers for r, n in dict(w.rejected).items()),
            *((("coordinator", r), n) for r, n in dict(st.rejected).items()),
        ],
        "shadow_replay": [((str(w.id),), (w.replay_s, w.replayed)) for w in workers],
        "shadow_resyncs": [((name,), n) for name, n in {**({job.name: 0} if job else {}), **st.resyncs}.items()],
        "shadow_auth_refused": [((r,), n) for r, n in (dict(guard.refused) if guard else {}).items()],
        "shadow_refused_messages": [((role, reason), n) for (role, reason), n in dict(st.refused).items()],
    }
    if job is not None:
        committed = job.cut >= job.base
        seen = max((w.received for w in workers), default=-1)
        out["shadow_job_degraded"] = [((job.name,), 1 if job.status == JobStatus.DEGRADED else 0)]
        out["shadow_job_epoch"] = [((job.name,), job.epoch)]
        if committed:
            out["shadow_committed_iteration"] = [((job.name,), job.cut)]
            out["shadow_lag_iterations"] = [((job.name,), max(0, seen - job.cut))]
            out["shadow_lag_seconds"] = [((job.name,), time.time() - job.cut_time if seen > job.cut else 0.0)]
            out["shadow_checkpoint_complete_timestamp_seconds"] = [(("memory",), job.cut_time)]
            out["shadow_checkpoint_complete_iteration"] = [(("memory",), job.cut)]
    for name, t in dict(persist.tiers).items():
        out.setdefault("shadow_persist_checkpoints", []).append(((name,), t.count))
        out.setdefault("shadow_persist_failures", []).append(((name,), t.failures))
        out.setdefault("shadow_persist_skipped", []).append(((name,), t.skipped))
        out.setdefault("shadow_persist_bytes", []).append(((name,), t.bytes))
        last = t.last_complete
        if last is not None:
            if last.get("seconds") is not None:
                out.setdefault("shadow_persist_duration_seconds", []).append(((name,), last["seconds"]))
            if last.get("time") is not None:
                out.setdefault("shadow_checkpoint_complete_timestamp_seconds", []).append(((name,), last["time"]))
            out.setdefault("shadow_checkpoint_complete_iteration", []).append(((name,), last["iteration"]))
    return out
