"""A worker's samples for its /metrics endpoint (read at scrape time; see
:mod:`shadow.metrics`)."""

from __future__ import annotations

import time

from shadow.metrics import Samples


def samples(worker) -> Samples:
    """The :data:`shadow.metrics.WORKER` samples of ``worker`` (a
    :class:`~shadow.worker.server.Worker`): its :class:`~shadow.worker.state.WorkerState`
    and its data path's receive counters, read without a lock from the HTTP thread."""
    w, data = worker.state, worker.data
    s = w.assignment
    out: Samples = {
        "shadow_worker_up_seconds": [((), time.monotonic() - w.started)],
        "shadow_worker_stale": [((), 1 if s is not None and s.stale else 0)],
        "shadow_worker_applied": [((), s.applied if s is not None else -1)],
        "shadow_worker_seen": [((), s.seen if s is not None else -1)],
        "shadow_worker_frames_received": [((), data.frames_in)],
        "shadow_worker_bytes_received": [((), data.bytes_in)],
        "shadow_worker_rejected_frames": [((reason,), n) for reason, n in dict(w.rejected).items()],
        "shadow_worker_replay": [((), (w.replay_s, w.replayed))],
        "shadow_worker_resyncs": [((), max(0, w.configures - 1))],
    }
    persisted = dict(w.persisted)
    out["shadow_worker_persist"] = [((tier,), (t[0], t[1])) for tier, t in persisted.items()]
    out["shadow_worker_persist_bytes"] = [((tier,), t[2]) for tier, t in persisted.items()]
    out["shadow_worker_persist_failures"] = [((tier,), t[3]) for tier, t in persisted.items()]
    return out
