"""The coordinator's samples for its /metrics endpoint (read at scrape time; see
:mod:`shadow.metrics`): the cluster view of every worker, the job, and the tiers."""

from __future__ import annotations

import time

from shadow.metrics import Samples

HEALTH = ("ok", "joining", "stale", "out", "lost")


def health(coord, w, now: float) -> str:
    job = coord.job
    if not w.alive(now):
        return "lost"
    if job is not None and w.id in job.joining:
        return "joining"
    if w.stale or w.transit:
        return "stale"
    return "out" if w.out else "ok"


def samples(coord) -> Samples:
    """The :data:`shadow.metrics.COORDINATOR` samples of coordinator ``coord``."""
    now, job = time.monotonic(), coord.job
    workers = list(coord.workers)
    counts = dict.fromkeys(HEALTH, 0)
    for w in workers:
        counts[health(coord, w, now)] += 1
    out: Samples = {
        "shadow_workers_expected": [((), coord.expected)],
        "shadow_workers": [((h,), n) for h, n in counts.items()],
        "shadow_worker_applied_iteration": [((str(w.id),), w.applied) for w in workers],
        "shadow_frames_received": [((str(w.id),), w.frames_in) for w in workers],
        "shadow_bytes_received": [((str(w.id),), w.bytes_in) for w in workers],
        "shadow_rejected_frames": [
            *(((str(w.id), r), n) for w in workers for r, n in dict(w.rejected).items()),
            *((("coordinator", r), n) for r, n in dict(coord.rejected).items()),
        ],
        "shadow_replay": [((str(w.id),), (w.replay_s, w.replayed)) for w in workers],
        "shadow_resyncs": [((name,), n) for name, n in {**({job.name: 0} if job else {}), **coord.resyncs}.items()],
        "shadow_auth_refused": [((r,), n) for r, n in (dict(coord.guard.refused) if coord.guard else {}).items()],
    }
    if job is not None:
        committed = job.cut >= job.base
        seen = max((w.seen for w in workers), default=-1)
        out["shadow_job_degraded"] = [((job.name,), 1 if job.status == "degraded" else 0)]
        out["shadow_job_epoch"] = [((job.name,), job.epoch)]
        if committed:
            out["shadow_committed_iteration"] = [((job.name,), job.cut)]
            out["shadow_lag_iterations"] = [((job.name,), max(0, seen - job.cut))]
            out["shadow_lag_seconds"] = [((job.name,), time.time() - job.cut_time if seen > job.cut else 0.0)]
            out["shadow_checkpoint_complete_timestamp_seconds"] = [(("memory",), job.cut_time)]
            out["shadow_checkpoint_complete_iteration"] = [(("memory",), job.cut)]
    for name, t in dict(coord.persist.tiers).items():
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
