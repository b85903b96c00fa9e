"""The coordinator's side of persistence: when each tier is due, collecting the workers'
shard reports, committing a checkpoint by writing its manifest, retention, and the
catalog of complete checkpoints per tier."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shadow.persist import catalog

logger = logging.getLogger(__name__)

TIERS = ("local", "remote")


def due(cfg: dict, iteration: int, now: float, tokens: int | None, last: tuple[int, float, int | None]) -> bool:
    """Whether a tier with schedule ``cfg`` should checkpoint ``iteration``, given the
    ``(iteration, time, tokens)`` of its last checkpoint request."""
    last_it, last_t, last_tokens = last
    if cfg["every_n"] and iteration - last_it >= cfg["every_n"]:
        return True
    if cfg["every_s"] and now - last_t >= cfg["every_s"]:
        return True
    if cfg["every_tokens"] and tokens is not None and tokens - (last_tokens or 0) >= cfg["every_tokens"]:
        return True
    return False


@dataclass
class Tier:
    name: str
    cfg: dict
    root: str
    last: tuple = (0, 0.0, None)  # (iteration, time, tokens) of the last request
    last_ok: tuple = (0, 0.0, None)  # ... of the last request that became a complete checkpoint
    in_flight: dict = field(default_factory=dict)  # iteration -> {shard: report}
    complete: dict = field(default_factory=dict)  # job -> newest complete iteration
    last_complete: dict | None = None  # {"job", "iteration", "time", "bytes", "seconds"}
    last_error: str = ""
    count: int = 0
    bytes: int = 0
    failures: int = 0

    def status(self) -> dict:
        return {"root": self.root, "schedule": {k: self.cfg[k] for k in ("every_n", "every_s", "every_tokens", "keep")},
                "last_complete": self.last_complete, "last_error": self.last_error, "count": self.count,
                "bytes": self.bytes, "failures": self.failures, "in_flight": sorted(self.in_flight)}


class Persistence:
    def __init__(self, persist: dict) -> None:
        self.config = persist
        self.tiers: dict[str, Tier] = {}
        for name, key in (("local", "dir"), ("remote", "url")):
            cfg = persist.get(name, {})
            if cfg.get(key):
                self.tiers[name] = Tier(name, cfg, cfg[key])
        for t in self.tiers.values():
            self._scan(t)

    def _scan(self, tier: Tier) -> None:
        try:
            found = catalog.list_checkpoints(tier.root, tier.name)
        except Exception as exc:  # an unreachable tier must not stop the coordinator
            tier.last_error = f"cannot list {tier.root}: {exc}"
            logger.error("tier %s: %s", tier.name, tier.last_error)
            return
        for c in found:
            tier.complete[c.job] = max(tier.complete.get(c.job, -1), c.iteration)
        if found:
            c = found[-1]
            tier.last_complete = {"job": c.job, "iteration": c.iteration, "time": c.manifest.get("created"),
                                  "bytes": c.bytes, "seconds": None}
            logger.info("tier %s at %s: %d complete checkpoints, newest %s iteration %d",
                        tier.name, tier.root, len(found), c.job, c.iteration)

    def storage(self) -> list[dict]:
        """Where restores may look, nearest first."""
        return [{"tier": t.name, "root": t.root} for t in self.tiers.values()]

    def newest(self, job: str) -> int:
        return max((t.complete.get(job, -1) for t in self.tiers.values()), default=-1)

    def reset(self, base: int) -> None:
        for t in self.tiers.values():
            t.last = t.last_ok = (base, time.time(), None)
            t.in_flight.clear()

    def local_due(self, iteration: int, tokens: int | None) -> bool:
        t = self.tiers.get("local")
        if t is None or not due(t.cfg, iteration, time.time(), tokens, t.last):
            return False
        t.last = (iteration, time.time(), tokens)
        t.in_flight[iteration] = {}
        return True

    def on_report(self, job, rep: dict, nshards: int) -> list[tuple[str, int, dict]]:
        """Record one worker's report; returns follow-up requests ``(kind, iteration, per-shard)``."""
        tier = self.tiers.get(rep["tier"])
        if tier is None or rep["iteration"] not in tier.in_flight:
            return []
        got = tier.in_flight[rep["iteration"]]
        got[rep["shard"]] = rep
        if len(got) < nshards:
            return []
        del tier.in_flight[rep["iteration"]]
        failed = [r for r in got.values() if not r["ok"]]
        if failed:
            tier.last_error = "; ".join(f"iteration {r['iteration']} shard {r['shard']}: {r['error']}" for r in failed)
            logger.error("tier %s: checkpoint of iteration %d not taken: %s", tier.name, rep["iteration"],
                         tier.last_error)
            tier.last = tier.last_ok  # due again at the next cut
            tier.failures += 1
            return []
        return self._commit(tier, job, rep["iteration"], got)

    def _commit(self, tier: Tier, job, iteration: int, got: dict) -> list:
        shards = [{"index": r["shard"], "start": r["start"], "stop": r["stop"], "file": r["file"],
                   "bytes": r["bytes"], "checksum": r["checksum"], "blob_ranks": r["blob_ranks"],
                   "raw_bytes": r.get("raw_bytes", r["bytes"]), "compress": r.get("compress", "none")}
                  for r in got.values()]
        commit = next((r["commit"] for r in got.values() if r["commit"] is not None), None)
        tokens = commit.get("tokens") if commit else None
        manifest = catalog.new_manifest(job.name, iteration, job.epoch, tier.name, job.layout, job.layout_hash,
                                        job.optim, job.world, tokens, commit, shards)
        try:
            catalog.write_manifest(tier.root, job.name, iteration, manifest)
            deleted = catalog.retain(tier.root, job.name, tier.cfg["keep"])
        except Exception as exc:  # storage errors are reported, never fatal
            tier.last_error = f"writing the manifest of iteration {iteration}: {type(exc).__name__}: {exc}"
            if isinstance(exc, FileNotFoundError):
                tier.last_error += (f" (the coordinator cannot see the shards the workers wrote under {tier.root}: "
                                    "a tier's path must be storage the coordinator and every worker share -- one "
                                    "host, or a shared mount; with node-local disks on several hosts, use "
                                    "persist.remote.url for durable copies)")
            logger.error("tier %s: %s", tier.name, tier.last_error)
            tier.last = tier.last_ok
            tier.failures += 1
            return []
        tier.last_ok = (iteration, time.time(), tokens)
        nbytes = sum(s["bytes"] for s in shards)
        tier.count += 1
        tier.bytes += nbytes
        tier.last_error = ""
        tier.complete[job.name] = max(tier.complete.get(job.name, -1), iteration)
        if tier.last_complete is None or tier.last_complete["iteration"] <= iteration or \
                tier.last_complete["job"] != job.name:
            tier.last_complete = {"job": job.name, "iteration": iteration, "time": manifest["created"],
                                  "bytes": nbytes, "seconds": max(r["seconds"] for r in got.values())}
        logger.info("tier %s: checkpoint of %s iteration %d complete (%d bytes, %d shards)%s", tier.name,
                    job.name, iteration, nbytes, len(shards), f"; retention removed {len(deleted)}" if deleted else "")
        remote = self.tiers.get("remote")
        if tier.name == "local" and remote is not None and due(remote.cfg, iteration, time.time(), tokens, remote.last):
            remote.last = (iteration, time.time(), tokens)
            remote.in_flight[iteration] = {}
            return [("upload", iteration, {r["shard"]: r for r in got.values()})]
        return []
