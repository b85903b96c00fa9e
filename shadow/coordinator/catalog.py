"""What the coordinator knows of each storage tier (:class:`TierState`: requests in flight,
the catalog of complete checkpoints, its figures), and the scan that fills the catalog from
what the tier holds, at start-up and again for a job whose lineage changes."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from shadow.persist import checkpoints
from shadow.storage import Storage, storage_for
from shadow.storage.tier import Tier

logger = logging.getLogger(__name__)


@dataclass
class TierState:
    """What the coordinator tracks of one :class:`~shadow.storage.tier.Tier`: requests in
    flight, what it holds complete, and its figures (status ``persist``, the metrics)."""

    tier: Tier
    last: tuple = (0, 0.0, None)  # (iteration, time, tokens) of the last request
    last_ok: tuple = (0, 0.0, None)  # ... of the last request that became a complete checkpoint
    in_flight: dict = field(default_factory=dict)  # iteration -> {worker id: report}
    asked: dict = field(default_factory=dict)  # iteration in flight -> {worker id: shard} of the writers asked
    complete: dict = field(default_factory=dict)  # job -> newest complete iteration
    last_complete: dict | None = None  # {"job", "iteration", "time", "bytes", "seconds"}
    last_error: str = ""
    scan_error: str = ""  # the start-up scan failed: what this tier holds is unknown
    held: str = ""  # why this tier is not written for the attached job (unreadable when it attached), or ""
    count: int = 0
    bytes: int = 0
    failures: int = 0
    skipped: int = 0  # requests a worker skipped (not failures)
    last_skip: tuple = (-1, 0.0)  # (iteration, monotonic time) of the newest request skipped
    failing: int = 0  # failures in a row (a full disk, say); after two, retries follow the schedule
    requested: dict = field(default_factory=dict)  # iteration in flight -> monotonic time of the request
    newest: tuple | None = None  # (iteration, tokens, {shard: report}) of the newest complete one this run
    skip_log: dict = field(default_factory=lambda: {"count": 0, "lo": 0, "hi": 0, "at": float("-inf"), "why": ""})

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def root(self) -> str:
        return self.tier.root

    @property
    def storage(self) -> Storage:
        """Where the tier writes: on a local file system, with ``persist.mode``'s permissions."""
        return self.tier.storage

    def status(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "schedule": asdict(self.tier.schedule),
            "last_complete": self.last_complete,
            "last_error": self.last_error,
            "count": self.count,
            "bytes": self.bytes,
            "failures": self.failures,
            "skipped": self.skipped,
            "in_flight": sorted(self.in_flight),
            "held": self.held,
        }

    def skip(self, iteration: int, reason: str, log_s: float) -> None:
        """A checkpoint request a worker skipped (every image still being written): counted,
        and logged with the others in one warning at most every ``log_s`` seconds."""
        self.skipped += 1
        if iteration >= self.last_skip[0]:  # two in flight may settle out of order: the newest counts
            self.last_skip = (iteration, time.monotonic())
        s = self.skip_log
        s["lo"] = iteration if not s["count"] else min(s["lo"], iteration)
        s["hi"] = max(s["hi"], iteration) if s["count"] else iteration
        s["count"] += 1
        s["why"] = reason
        self.log_skips(log_s)

    def log_skips(self, log_s: float) -> None:
        """One warning for the skips since the last one, at most every ``log_s`` seconds
        (SHADOW_PERSIST_SKIP_LOG_S)."""
        s, now = self.skip_log, time.monotonic()
        if not s["count"] or now - s["at"] < log_s:
            return
        span = f"iteration {s['lo']}" if s["lo"] == s["hi"] else f"iterations {s['lo']}-{s['hi']}"
        logger.warning(
            "tier %s: %d checkpoint request%s skipped (%s; %d in all)%s; not a failure: the next cut is "
            "due again (if this persists, raise SHADOW_PERSIST_BUFFERS or the tier's interval)",
            self.name,
            s["count"],
            "" if s["count"] == 1 else "s",
            span,
            self.skipped,
            f": {s['why']}" if s["why"] else "",
        )
        s.update(count=0, at=now)


def _probe(root: str | Storage) -> None:
    """Raise if what tier ``root`` holds cannot be known (no permission, a symlink loop, an
    unreachable store): its listing would pass for empty. A root that does not exist, or is
    not a directory, holds no checkpoint (writing one fails, and is reported then)."""
    st = storage_for(root)
    try:
        info = st.info(st.base)
    except (FileNotFoundError, NotADirectoryError):
        return
    if info.get("type") != "directory":
        logger.warning(
            "tier root %s is a %s, not a directory: it holds no checkpoint, and none can be written there",
            st.url,
            info.get("type", "non-directory"),
        )
        return
    for entry in st.ls(st.base):  # each job directory must be listable too
        if entry.get("type") == "directory":
            st.ls(entry["name"])


def scan(tier: TierState, generations: dict[str, int], job: str | None = None, sign_key: bytes | None = None) -> None:
    """Fill ``tier`` from what it holds (of ``job``, or of every job: then the tier's root is
    probed first), and raise ``generations`` (job -> newest generation) to what it records.
    A listing that fails leaves ``tier.last_error`` (and, for every job, ``scan_error``)."""
    try:
        if job is None:
            _probe(tier.storage)  # a listing of an unreadable root is empty, not an error
        found = checkpoints.list_checkpoints(tier.storage, tier.name, job, sign_key=sign_key)
        for name in {c.job for c in found} | ({job} if job else set()):
            marks = checkpoints.read_generations(tier.storage, name, sign_key=sign_key)
            generations[name] = max([generations.get(name, 0), *marks] + [c.generation for c in found if c.job == name])
    except Exception as exc:  # an unreachable tier must not stop the coordinator
        tier.last_error = f"cannot list {tier.root}: {type(exc).__name__}: {exc}"
        logger.error("tier %s: %s", tier.name, tier.last_error)
        if job is None:  # what the tier holds is unknown: never taken as "nothing"
            tier.scan_error = tier.last_error
        return
    if job is None and tier.scan_error:
        logger.info("tier %s at %s is readable again", tier.name, tier.root)
        if tier.last_error == tier.scan_error:
            tier.last_error = ""
        tier.scan_error = ""
    if job is not None:
        tier.complete.pop(job, None)
    for c in found:
        if not c.superseded:  # an abandoned iteration is never the newest
            tier.complete[c.job] = max(tier.complete.get(c.job, -1), c.iteration)
    if found:
        c = found[-1]
        tier.last_complete = {
            "job": c.job,
            "iteration": c.iteration,
            "time": c.manifest.get("created"),
            "bytes": c.bytes,
            "seconds": None,
        }
        logger.info(
            "tier %s at %s: %d complete checkpoints, newest %s iteration %d",
            tier.name,
            tier.root,
            len(found),
            c.job,
            c.iteration,
        )
