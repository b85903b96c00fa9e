"""What the coordinator answers to ``status`` and ``restore_info``: the cluster view, and
where the newest restorable checkpoint is (shadow memory, the previous epoch while a
re-attach bootstraps, the storage tiers)."""

from __future__ import annotations

import json
import logging
import posixpath
import time
from typing import Any

from shadow.coordinator import scope
from shadow.coordinator.cluster import ClusterState
from shadow.coordinator.outbox import Outbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.records import Health, JobStatus
from shadow.core import sqrttab
from shadow.core.layout import Layout
from shadow.persist import checkpoints, fsglob
from shadow.security import Peer
from shadow.wire import messages as M

Msg = dict[str, Any]
logger = logging.getLogger(__name__)

#: the manifests one ``catalog_reply`` carries at most (its limit is 256 MiB): the newest first
CATALOG_BYTES = 128 << 20
#: a generation record the catalog carries is at most this big (one is a few hundred bytes)
GENERATION_BYTES = 64 << 10


class Queries:
    """Handlers ``status`` and ``restore_info`` (from any client)."""

    def __init__(self, state: ClusterState, out: Outbox, persist: Persistence, guard: Any = None) -> None:
        self.state, self.out, self.persist, self.guard = state, out, persist, guard
        # (tier, job) -> (what it was read from, entries, generation records)
        self._catalogs: dict[tuple, tuple[list, list, list]] = {}
        self._replies: dict[tuple, tuple[Any, tuple, bytes]] = {}  # (tier, job) -> (version, (torn, left out), reply)

    def on_status(self, env: list[bytes], msg: Msg) -> None:
        view = status_view(self.state, self.persist, self.guard)
        self.out.reply(env, "status_reply", status=scope.status(view, self.state.sender))

    def on_restore_info(self, env: list[bytes], msg: Msg) -> None:
        """Where the newest checkpoint is: shadow memory (if complete) and the storage tiers."""
        st = self.state
        memory = memory_info(st, msg["job"])
        if memory is not None:  # mac mode: a ticket of this reader's own for each worker
            by_id = {w.id: w for w in st.workers}
            retired = st.job is not None and memory["epoch"] != st.job.epoch  # the previous epoch answers
            memory = dict(memory)
            memory["workers"] = [
                {**e, **(by_id[e["id"]].fetch_ticket(retired) if e["id"] in by_id else {})} for e in memory["workers"]
            ]
        storage = self.persist.storage()
        now = time.monotonic()
        peer = st.sender  # a job-scoped reader's tickets read the job it asked for, no other
        reads = scope.named_job(st, "restore_info", msg) if peer is not None and peer.jobs is not None else None
        for tier in storage:
            if tier["tier"] == "local":  # the workers that serve their disks' shard files
                tier["workers"] = [  # mac mode: with a ticket of this reader's own for each
                    {"id": w.id, "files": w.files, "disk": w.disk, **w.files_ticket(reads)}
                    for w in st.workers
                    if w.files and st.alive(w, now)
                ]
        self.out.reply(
            env,
            "restore_info_reply",
            info={
                "memory": memory,
                "memory_error": "" if memory else memory_error(st, msg["job"]),
                "storage": storage,
                "job": st.job.name if st.job and (st.sender is None or st.sender.may(st.job.name)) else None,
            },
        )

    def on_catalog(self, env: list[bytes], msg: Msg) -> None:
        """A tier's checkpoints as the coordinator keeps them (its own copy of the manifests
        of a node-local tier): each manifest's bytes, for the client to check itself."""
        tier = self.persist.tiers.get(msg["tier"])
        if tier is None:
            self.out.reply(env, "error", code="refused", message=f"this cluster has no {msg['tier']!r} tier")
            return
        job, peer = msg["job"], self.state.sender
        scoped = job is None and peer is not None and peer.jobs is not None  # every job: the peer's only

        def then(raw: bytes | None, exc: BaseException | None) -> None:
            if exc is not None or raw is None:  # an unreadable tier is an answer, not a crash
                self.out.reply(env, "error", code="internal", message=f"cannot list tier {tier.name}: {exc}")
                return
            self.out.reply_encoded(env, raw)

        # listed on the storage lane (a tier may be slow to list); the reply goes from the loop
        self.persist.lane.submit(
            f"the catalog of tier {tier.name}", lambda: self._catalog_reply(tier, job, peer if scoped else None), then
        )

    def _catalog_reply(self, tier, job: str | None, peer: Peer | None = None) -> bytes:
        """The encoded ``catalog_reply``, built once per version of the tier: every request
        for an unchanged tier gets the same bytes (held once by zmq, however many clients
        have yet to read them). ``peer``: a job-scoped reader's catalog of every job, with
        its jobs' entries only (built for it alone)."""
        entries, torn, left_out, generations = self._catalog(tier, job)
        if peer is not None:
            mine = lambda path: peer.may(path.split("/", 1)[0])  # noqa: E731  (<job>/...)
            return M.encode(
                "catalog_reply",
                root=tier.root,
                checkpoints=[e for e in entries if mine(e[0])],
                torn=[t for t in torn if mine(t)],
                generations=[g for g in generations if mine(g[0])],
            )
        key = (tier.name, job)
        version = self._catalogs.get(key)  # the same object while the tier's manifests are unchanged
        cached = self._replies.get(key)
        if cached is not None and cached[0] is version and cached[1] == (torn, left_out):
            return cached[2]
        raw = M.encode(
            "catalog_reply",
            root=tier.root,
            checkpoints=entries,
            torn=torn,
            generations=generations,
            **({"left_out": left_out} if left_out else {}),
        )
        self._replies[key] = (version, (torn, left_out), raw)
        return raw

    def _catalog(self, tier, job: str | None) -> tuple[list, list, int, list]:
        """``(entries, torn, left out, generation records)`` of ``tier`` for ``job``, newest
        entries first, within :data:`CATALOG_BYTES`. Read with the cluster's manifest key
        (``persist.sign``), as a reader of the tier with the key reads it; the generation
        records go along as they are, ``[path under the root, bytes]``, for the client to
        check with its own key. The manifests are read and checked again only when the
        tier's manifests and generation records changed (their names, sizes and times): a tier
        that keeps every checkpoint holds many. Runs on the storage lane (the caches are the
        lane's alone), never on the loop thread once the coordinator runs."""
        st = tier.storage
        paths = sorted(st.list(fsglob.pattern(st.base, job, "iteration-*", checkpoints.MANIFEST)))
        records = sorted(st.list(fsglob.pattern(st.base, job, "generation-*.json")))
        stamp = [(p, _stamp(st.info(p))) for p in paths + records]
        key = (tier.name, job)
        cached = self._catalogs.get(key)
        if cached is not None and cached[0] == stamp:
            entries, generations = cached[1], cached[2]
        else:
            found = checkpoints.list_checkpoints(st, tier.name, job, sign_key=self.persist.sign_key)
            entries = [
                [
                    _relative(st.base, c.path),
                    json.dumps(c.manifest).encode(),
                    "diverged" if c.diverged else c.superseded,
                ]
                for c in found
            ]
            generations = []
            for p in records:
                try:
                    raw = st.cat(p) if (st.info(p).get("size") or 0) <= GENERATION_BYTES else None
                except OSError as exc:
                    logger.warning("tier %s: cannot read %s for the catalog: %s", tier.name, p, exc)
                    continue
                if raw is None:
                    logger.warning("tier %s: %s is over %d bytes, no generation record", tier.name, p, GENERATION_BYTES)
                    continue
                generations.append([posixpath.relpath(p, st.base.rstrip("/") or "/"), raw])
            self._catalogs[key] = (stamp, entries, generations)
        sent, total = [], 0
        for e in reversed(entries):  # the newest first, as a restore picks
            if total + len(e[1]) > CATALOG_BYTES:
                break
            sent.append(e)
            total += len(e[1])
        if len(sent) < len(entries):
            logger.warning(
                "tier %s: the catalog sent the %d newest of %d checkpoints (%d MiB of manifests at most)",
                tier.name,
                len(sent),
                len(entries),
                CATALOG_BYTES >> 20,
            )
        torn = [_relative(st.base, d) for d in checkpoints.list_torn(st, job)]
        return sent[::-1], torn, len(entries) - len(sent), generations


def _stamp(info: dict) -> tuple:
    """What tells a file's version from another's: its size and modification time."""
    return info.get("size"), str(info.get("mtime", info.get("LastModified", "")))


def _relative(base: str, path: str) -> str:
    """``<job>/<iteration directory>`` of a checkpoint directory under ``base``."""
    return posixpath.relpath(path.rstrip("/"), base.rstrip("/") or "/")


def status_view(st: ClusterState, persist: Persistence, guard: Any = None) -> dict[str, Any]:
    """What ``shadow status`` shows: workers (and processes still starting), the job, the
    tiers, what is restorable. Reads only; ``guard`` is the CURVE guard, if any."""
    now, job = time.monotonic(), st.job
    out: dict[str, Any] = {
        "expected_workers": st.expected,
        "replicas": st.replicas,
        "shards": st.nshards,
        "uptime_s": time.time() - st.started,
        "rejected": dict(st.rejected),
        "attach_pending": st.pending_view(),
        "security": {
            "curve": guard is not None,
            "accepted": guard.accepted if guard else 0,
            "refused": dict(guard.refused) if guard else {},
            "refused_by_role": {f"{role}/{reason}": n for (role, reason), n in dict(st.refused).items()},
        },
        "workers": [_worker_view(st, w, now) for w in st.workers] + _starting_view(st),
        "job": None,
        "persist": {
            name: {**t.status(), "scan_error": t.scan_error}  # scan_error: attaches are refused
            for name, t in persist.tiers.items()
        },
        "loop": st.loop.view() if st.loop is not None else None,  # the loop's slow steps
    }
    if job is not None:
        out["job"] = _job_view(st, job)
        memory = memory_info(st, job.name)
        out["restorable"] = {
            "memory": memory["iteration"] if memory else None,
            **{name: t.complete.get(job.name) for name, t in persist.tiers.items()},
        }
    return out


def _worker_view(st: ClusterState, w, now: float) -> dict[str, Any]:
    job = st.job
    return {
        "id": w.id,
        "pid": w.pid,
        "data": w.data,
        "mode": w.data_mode,
        "serve": w.serve,
        "files": w.files,
        "start": job.ranges[w.id][0] if job else None,
        "stop": job.ranges[w.id][1] if job else None,
        "applied": w.applied,
        "prepared": w.prepared,
        "seen": w.received,
        "shard": st.shard_of(w),
        "health": st.health(w, now).value,
        "stale": w.stale or w.undelivered,
        "rejected": w.rejected,
        "frames_in": w.frames_in,
        "bytes_in": w.bytes_in,
        "bytes_per_s": round(w.rate_in, 1),
        "replay_s": round(w.replay_s, 6),
        "replayed": w.replayed,
        "replay_s_per_iteration": None if w.replay_per_it is None else round(w.replay_per_it, 6),
        "last_seen_s": round(now - w.last_seen, 3),
        "ready": st.alive(w, now),
        "memory": w.memory if w.memory >= 0 else None,
    }


def _job_view(st: ClusterState, job) -> dict[str, Any]:
    received = max((w.received for w in st.workers), default=-1)
    held = job.cut >= job.base  # the epoch holds its base: a committed iteration
    return {
        "name": job.name,
        "epoch": job.epoch,
        "status": job.status.value,
        "world": job.world,
        "committed": job.cut if held else None,
        "base": job.base,
        "lag_iterations": max(0, received - job.cut) if held else None,
        "lag_s": round(time.time() - job.cut_time, 3) if held and received > job.cut else 0.0,
        "elements": Layout.from_dict(job.layout).total,
        "optim": sqrttab.public(job.optim),
        "audit": job.audit,
        "diverged": job.diverged,
        "reason": job.reason if job.status == JobStatus.DEGRADED else "",
        "trainers": sorted(job.trainers),
        "resyncs": st.resyncs.get(job.name, 0),
        "cut_time": job.cut_time if held else None,
    }


def _starting_view(st: ClusterState) -> list[dict[str, Any]]:
    """Worker processes still compiling their kernels, in slots no registered worker
    holds (a restarted worker's slot shows its old record, lost, until it registers)."""
    held = {w.id for w in st.workers}
    return [
        {
            "id": p["worker_id"],
            "pid": p["pid"],
            "data": None,
            "serve": None,
            "start": None,
            "stop": None,
            "applied": -1,
            "prepared": -1,
            "seen": -1,
            "shard": None,
            "health": Health.STARTING.value,
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
            "starting_s": p["seconds"],
        }
        for p in sorted(st.starting.values(), key=lambda x: x["worker_id"])
        if p["worker_id"] not in held
    ]


def memory_error(st: ClusterState, job_name: str | None) -> str:
    """Why shadow memory cannot serve job ``job_name`` (any job: None), or ""."""
    job = st.job
    if job is None or (job_name is not None and job_name != job.name):
        return (
            f"shadow memory holds no checkpoint for job {job_name!r}"
            if job_name
            else "shadow memory holds no checkpoint yet: no trainer has attached"
        )
    if job.cut < job.base:
        return f"job {job.name!r} has not finished its bootstrap; no checkpoint in memory yet"
    if job.diverged is not None:
        return (
            f"job {job.name!r}: the shadow diverged from the trainer after iteration {job.diverged} (a divergence "
            "audit failed); memory serves no checkpoint of it until the trainers resync (restore from a tier: "
            f"iteration {job.diverged} or older)"
        )
    if st.serving() is None:
        now = time.monotonic()
        lost = [w.id for w in st.workers if not st.healthy(w, now)]
        return (
            f"workers {lost} are lost or stale and some shard has no healthy copy; "
            "the in-memory checkpoint is incomplete"
        )
    return ""


def memory_info(st: ClusterState, job_name: str | None) -> dict[str, Any] | None:
    """The iteration shadow memory serves for ``job_name`` (any job: None) and the workers
    that serve it, or None; while a (re-)attach bootstraps, the previous epoch's."""
    job = st.job
    if job is not None and job.cut < job.base and st.retired is not None and job_name in (None, st.retired["job"]):
        return st.retired  # a (re-)attach is bootstrapping: the previous epoch still answers
    if memory_error(st, job_name):
        return None
    job, serving = st.job, st.serving()
    assert job is not None and serving is not None  # as memory_error found them
    return {
        "job": job.name,
        "epoch": job.epoch,
        "iteration": job.cut,
        "generation": job.generation,
        "layout": job.layout,
        "layout_hash": job.layout_hash,
        "world": job.world,
        "optim": sqrttab.public(job.optim),
        "workers": [
            {"id": w.id, "serve": w.serve, "start": job.ranges[w.id][0], "stop": job.ranges[w.id][1]} for w in serving
        ],
    }
