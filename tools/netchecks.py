"""The checks the network fault matrix runs after every trial (``tools/netfaults.py``):
the status series while it ran, every restore against the trainer's dumped state, the
tiers' contract, and the services' descriptors and memory across trials."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from faultlib import Poller, Trial, read_json

from shadow.restore import open_source
from shadow.restore.resolve import cluster_tiers
from shadow.restore.sources import COMPLETE
from shadow.testing import rss_bytes
from shadow.testing.state import state_differences

if TYPE_CHECKING:
    from netfaults import Rig

LOCAL_KEEP = 3
REMOTE_EVERY = 4
FD_SLACK = 8  # descriptors a service may hold beyond its second trial's count (a new job's sockets)
RSS_SLACK = 64 << 20  # bytes of growth past the second trial's resident memory that count as a leak


class Watch(Poller):
    """Polls the coordinator (client key) and rank 0's progress; keeps the series."""

    def __init__(self, rig: Rig, info: Path, job: str, period: float = 0.1) -> None:
        super().__init__(period)
        self.rig, self.info, self.job = rig, info, job
        self.series: list[tuple[float, dict | None, int]] = []  # (time, status or None, trainer's completed)

    def poll(self) -> None:
        try:
            st = self.rig.cluster.status(timeout=1.0)
        except Exception:
            st = None
        self.series.append((time.time(), st, int(read_json(self.info).get("completed", 0))))

    def committed(self) -> int:
        for _, st, _ in reversed(self.series):
            if st and st.get("job") and st["job"]["name"] == self.job and st["job"]["committed"] is not None:
                return st["job"]["committed"]
        return 0

    def streaming_since(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first status after it with the job ok, every worker ok
        and the cut within one iteration of the trainers (None: never)."""
        for t, st, done in self.series:
            if t < t0 or not st or not st.get("job") or st["job"]["name"] != self.job:
                continue
            job = st["job"]
            if (
                job["status"] in ("ok", "running")
                and all(w["health"] == "ok" for w in st["workers"])
                and job["committed"] is not None
                and job["committed"] >= done - 1
            ):
                return t - t0
        return None

    def regressions(self) -> list[str]:
        """Committed iterations that went back, or passed what the trainers had completed."""
        out, last = [], None
        for _, st, done in self.series:
            j = st.get("job") if st else None
            if not j or j["name"] != self.job or j["committed"] is None:
                continue
            c = j["committed"]
            if last is not None and c < last:
                out.append(f"committed went back from {last} to {c}")
            if done and c > done + 1:  # the info file lags a step behind the status
                out.append(f"committed {c} passed the trainers' {done}")
            last = c
        return out[:5]


def degraded_why(t: Trial) -> str:
    """Why rank 0 went unprotected, as its log says."""
    with contextlib.suppress(OSError):
        for line in (t.tmp / "train-rank0.log").read_text(errors="replace").splitlines():
            if "degraded" in line:
                return line.strip()[:300]
    return "its log does not say"


def dumped(t: Trial, it: int) -> dict | None:
    path = t.tmp / "dump" / f"it{it}-rank0.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def compare(t: Trial, state: dict, where: str) -> str | None:
    """None if ``state`` (a snapshot's state dicts) equals what the trainer dumped after its
    iteration, bit for bit; else what differs."""
    it = state["iteration"]
    if it == 0:
        return None  # the bootstrap's initial state: nothing trained yet
    ref = dumped(t, it)
    if ref is None:
        return f"{where} iteration {it}: the trainer dumped no state for it"
    got = {"model": state["model"], "optimizer": state["optimizer"], "scheduler": state["scheduler"]}
    diffs = state_differences(got, ref)
    if diffs:
        return f"{where} iteration {it} differs from the trainer's: {'; '.join(diffs[:4])}"
    if not torch.equal(state["rng"][0]["torch"], ref["rng"]):
        return f"{where} iteration {it}: rank 0's torch RNG differs"
    return None


def check_restores(rig: Rig, t: Trial, job: str, final: int) -> tuple[list[str], dict]:
    """Every restore there is now: memory's newest and every complete checkpoint of every
    tier, each against the trainer's state at its iteration; and the contract: memory at
    ``final``, the local tier's newest at ``final`` holding at most ``LOCAL_KEEP``, the
    remote tier's newest within ``REMOTE_EVERY`` of it."""
    from shadow.export.state import state_dicts

    bad: list[str] = []
    seen: dict = {}
    src = open_source(rig.cluster.address, timeout=20.0)
    mem = [c for c in src.candidates(job) if c.loadable]
    if not mem:
        bad.append(f"memory holds nothing of job {job} ({getattr(src, 'problem', '')})")
    for c in mem:
        seen["memory"] = c.iteration
        if c.iteration != final:
            bad.append(f"memory holds iteration {c.iteration}, the trainers finished {final}")
        why = compare(t, state_dicts(src.load(c)), "memory")
        if why:
            bad.append(why)
    for tier in cluster_tiers(src):
        cands = [c for c in tier.candidates(job) if c.state == COMPLETE]
        seen[tier.name] = [c.iteration for c in cands]
        for c in cands:
            try:
                why = compare(t, state_dicts(tier.load(c)), f"{tier.name} tier")
            except Exception as exc:
                why = f"{tier.name} tier iteration {c.iteration} did not load: {type(exc).__name__}: {exc}"
            if why:
                bad.append(why)
        newest = max((c.iteration for c in cands), default=None)
        if tier.name == "local":
            if newest != final:
                bad.append(f"the local tier's newest is {newest}, not the last iteration {final}")
            if len(cands) > LOCAL_KEEP:
                bad.append(f"the local tier holds {len(cands)} checkpoints, keep={LOCAL_KEEP}")
        elif newest is None or newest < final - REMOTE_EVERY:
            bad.append(f"the {tier.name} tier's newest is {newest}; every {REMOTE_EVERY} of {final} expected")
    return bad, seen


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def check_leaks(rig: Rig) -> list[str]:
    """Descriptors and memory of every service against the second trial's (same process)."""
    rig.trials += 1
    now = {}
    for host, pid in rig.cluster.pids().items():
        with contextlib.suppress(OSError, AssertionError):
            now[host] = (pid, _descriptors(pid), rss_bytes(pid))
    rig.resources = {host: [fds, rss >> 20] for host, (_, fds, rss) in now.items()}
    if rig.trials <= 2:
        rig.baseline = now
        return []
    out = []
    for host, (pid, fds, rss) in now.items():
        base = rig.baseline.get(host)
        if base is None or base[0] != pid:  # restarted since: its own baseline from now on
            rig.baseline[host] = (pid, fds, rss)
            continue
        if fds > base[1] + FD_SLACK:
            out.append(f"{host} holds {fds} descriptors, {base[1]} after trial 2")
        if rss > base[2] + RSS_SLACK:
            out.append(f"{host} resident memory {rss >> 20} MiB, {base[2] >> 20} MiB after trial 2")
    return out


def wait_persisted(rig: Rig, job: str, final: int, limit: float = 30.0) -> None:
    """Until the cluster has persisted ``final`` to the local tier (or ``limit`` s pass)."""
    deadline = time.monotonic() + limit
    src = open_source(rig.cluster.address, timeout=10.0)
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            src.candidates(job)
            tiers = cluster_tiers(src)
            local = [c.iteration for tier in tiers if tier.name == "local" for c in tier.candidates(job)]
            if final in local:
                return
        time.sleep(0.3)
