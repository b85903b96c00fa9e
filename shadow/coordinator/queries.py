"""What the coordinator answers to ``status`` and ``restore_info``: the cluster view, and
where the newest restorable checkpoint is (shadow memory, the previous epoch while a
re-attach bootstraps, the storage tiers)."""

from __future__ import annotations

import time

from shadow.coordinator._host import CoordinatorHost
from shadow.coordinator.metrics import health
from shadow.layout import Layout


class QueryMixin(CoordinatorHost):
    def _on_status(self, env, msg) -> None:
        self._reply(env, "status_reply", status=self.status())

    def status(self) -> dict:
        now, job = time.monotonic(), self.job
        seen = max((w.seen for w in self.workers), default=-1)
        out = {
            "expected_workers": self.expected,
            "replicas": self.replicas,
            "shards": self.nshards,
            "uptime_s": time.time() - self.started,
            "rejected": dict(self.rejected),
            "attach_pending": self.pending_view(),
            "security": {
                "curve": self.guard is not None,
                "accepted": self.guard.accepted if self.guard else 0,
                "refused": dict(self.guard.refused) if self.guard else {},
            },
            "workers": [
                {
                    "id": w.id,
                    "pid": w.pid,
                    "data": w.data,
                    "serve": w.serve,
                    "start": job.ranges[w.id][0] if job else None,
                    "stop": job.ranges[w.id][1] if job else None,
                    "applied": w.applied,
                    "prepared": w.prepared,
                    "seen": w.seen,
                    "shard": self.shard_of(w),
                    "health": health(self, w, now),
                    "stale": w.stale or w.transit,
                    "rejected": w.rejected,
                    "frames_in": w.frames_in,
                    "bytes_in": w.bytes_in,
                    "bytes_per_s": round(w.rate_in, 1),
                    "replay_s": round(w.replay_s, 6),
                    "replayed": w.replayed,
                    "replay_s_per_iteration": None if w.replay_per_it is None else round(w.replay_per_it, 6),
                    "last_seen_s": round(now - w.last_seen, 3),
                    "ready": w.alive(now),
                    "memory": w.memory if w.memory >= 0 else None,
                }
                for w in self.workers
            ]
            + self._starting_view(),
            "job": None,
            "persist": {
                name: {**t.status(), "scan_error": t.scan_error}  # scan_error: attaches are refused
                for name, t in self.persist.tiers.items()
            },
        }
        if job is not None:
            out["job"] = {
                "name": job.name,
                "epoch": job.epoch,
                "status": job.status,
                "world": job.world,
                "committed": job.cut if job.cut >= job.base else None,
                "base": job.base,
                "lag_iterations": max(0, seen - job.cut) if job.cut >= job.base else None,
                "lag_s": round(time.time() - job.cut_time, 3) if job.cut >= job.base and seen > job.cut else 0.0,
                "elements": Layout.from_dict(job.layout).total,
                "optim": job.optim,
                "audit": job.audit,
                "reason": job.reason if job.status == "degraded" else "",
                "trainers": sorted(job.trainers),
                "resyncs": self.resyncs.get(job.name, 0),
                "cut_time": job.cut_time if job.cut >= job.base else None,
            }
            memory = self._memory_info(job.name)
            out["restorable"] = {
                "memory": memory["iteration"] if memory else None,
                **{name: t.complete.get(job.name) for name, t in self.persist.tiers.items()},
            }
        return out

    def _starting_view(self) -> list[dict]:
        """Worker processes still compiling their kernels, in slots no registered worker
        holds (a restarted worker's slot shows its old record, lost, until it registers)."""
        held = {w.id for w in self.workers}
        return [
            {
                "id": st["worker_id"],
                "pid": st["pid"],
                "data": None,
                "serve": None,
                "start": None,
                "stop": None,
                "applied": -1,
                "prepared": -1,
                "seen": -1,
                "shard": None,
                "health": "starting",
                "stale": "",
                "rejected": {},
                "frames_in": 0,
                "bytes_in": 0,
                "bytes_per_s": 0.0,
                "replay_s": 0.0,
                "replayed": 0,
                "replay_s_per_iteration": None,
                "last_seen_s": 0.0,
                "ready": False,
                "memory": None,
                "starting_s": st["seconds"],
            }
            for st in sorted(self.starting.values(), key=lambda x: x["worker_id"])
            if st["worker_id"] not in held
        ]

    def _on_restore_info(self, env, msg) -> None:
        """Where the newest checkpoint is: shadow memory (if complete) and the storage tiers."""
        memory = self._memory_info(msg["job"])
        self._reply(
            env,
            "restore_info_reply",
            info={
                "memory": memory,
                "memory_error": "" if memory else self._memory_error(msg["job"]),
                "storage": self.persist.storage(),
                "job": self.job.name if self.job else None,
            },
        )

    def _memory_error(self, job_name: str | None) -> str:
        job = self.job
        if job is None or (job_name is not None and job_name != job.name):
            return (
                f"shadow memory holds no checkpoint for job {job_name!r}"
                if job_name
                else "shadow memory holds no checkpoint yet: no trainer has attached"
            )
        if job.cut < job.base:
            return f"job {job.name!r} has not finished its bootstrap; no checkpoint in memory yet"
        if self.serving() is None:
            now = time.monotonic()
            lost = [w.id for w in self.workers if not self.healthy(w, now)]
            return (
                f"workers {lost} are lost or stale and some shard has no healthy copy; "
                "the in-memory checkpoint is incomplete"
            )
        return ""

    def _memory_info(self, job_name: str | None) -> dict | None:
        job = self.job
        if (
            job is not None
            and job.cut < job.base
            and self.retired is not None
            and job_name in (None, self.retired["job"])
        ):
            return self.retired  # a (re-)attach is bootstrapping: the previous epoch still answers
        if job is not None and job.cut >= job.base:
            self.retired = None
        if self._memory_error(job_name):
            return None
        job, serving = self.job, self.serving()
        assert job is not None and serving is not None  # as _memory_error found them
        return {
            "job": job.name,
            "epoch": job.epoch,
            "iteration": job.cut,
            "generation": job.generation,
            "layout": job.layout,
            "layout_hash": job.layout_hash,
            "world": job.world,
            "optim": job.optim,
            "workers": [
                {"id": w.id, "serve": w.serve, "start": job.ranges[w.id][0], "stop": job.ranges[w.id][1]}
                for w in serving
            ],
        }
