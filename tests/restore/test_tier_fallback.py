"""A restore through a cluster takes the newest checkpoint intact in any of its tiers.

The case: every iteration persisted to a local tier with keep=3, every 4 to a remote one;
the writers fall behind, so iterations 3-9 are skipped (a worker's images were all still
being written) and never complete; the local tier holds 1, 2 and 10 (keep counts complete
checkpoints, not iterations), the remote tier the copy of 10. One byte of the local 10
flipped: the restore must take the remote copy of 10, not fall back 8 iterations to the
local 2 because the local tier is tried to its end first."""

from __future__ import annotations

import importlib
import os
import time

import pytest

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator.persistence import Persistence
from shadow.core.errors import CheckpointError
from shadow.persist import checkpoints
from shadow.persist.writer import SKIPPED, ShardPersister
from shadow.restore.sources import Candidate
from shadow.restore.storage_source import TierSource
from shadow.testing import retention_problems
from shadow.wire.commit import UploadCopies
from tests.persist.test_persist_schedule import JOB, RANGES, TIER, _state

resolve_mod = importlib.import_module("shadow.restore.resolve")  # the package names a function so


def _persist(local: str, remote: str, skipped: range) -> Persistence:
    """Two real persisters and the coordinator's :class:`Persistence` (local every 1, keep 3;
    remote every 4, keep 3) through iterations 1-10; shard 0 reports ``skipped`` ones skipped,
    as a worker whose images are all being written does."""
    persist = {"local": dict(TIER, every_n=1, dir=local), "remote": dict(TIER, every_n=4, url=remote)}
    cfg = PersistConfig.from_dict(persist)
    pers = Persistence(cfg)
    pers.reset(0)
    ps = [
        ShardPersister(cfg, "j", i, 2, _state(lo, hi), tuning=Tuning.load(persist_buffers=1))
        for i, (lo, hi) in enumerate(RANGES)
    ]
    try:
        for it in range(1, 11):
            assert pers.local_due(it, None)
            for p in ps:
                if p.shard == 0 and it in skipped:
                    pers.on_report(JOB, p.report(it, 1, "local", False, SKIPPED, skipped=True), 2)
                else:
                    p.snapshot(it, 1, 1, {0: b"rec"}, {"tokens": None})
            deadline = time.monotonic() + 30
            while any(t.in_flight for t in pers.tiers.values()):
                assert time.monotonic() < deadline, {n: t.last_error for n, t in pers.tiers.items()}
                for p in ps:
                    for rep in p.results():
                        for f in pers.on_report(JOB, rep, 2):
                            if isinstance(f, UploadCopies):
                                for shard, r in f.copies.items():
                                    ps[shard].upload(f.iteration, 1, r.bytes, r.checksum)
                time.sleep(0.002)
    finally:
        for p in ps:
            assert p.close()
    return pers


def _flip_largest_shard(info: checkpoints.CheckpointInfo) -> None:
    shard = max(info.manifest["shards"], key=lambda s: s["bytes"])
    path = os.path.join(info.path, shard["file"])
    with open(path, "r+b") as f:
        f.seek(shard["bytes"] // 2)
        b = f.read(1)[0]
        f.seek(shard["bytes"] // 2)
        f.write(bytes([b ^ 0x10]))


class _NoMemory:
    """A cluster whose workers hold nothing (every process was killed and a new one started)."""

    job = "j"
    problem = "no job in memory"

    def __init__(self, *args) -> None:
        pass

    def candidates(self, job):
        return []


def test_a_damaged_local_checkpoint_falls_back_to_the_remote_copy_not_to_an_older_local_one(tmp_path, monkeypatch):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    pers = _persist(local, remote, skipped=range(3, 10))
    assert pers.tiers["local"].skipped == 7 and pers.tiers["local"].failures == 0
    # what the tiers hold: keep=3 complete checkpoints locally, however far apart; the copy of 10 remotely
    held = checkpoints.list_checkpoints(local)
    assert [c.iteration for c in held] == [1, 2, 10]
    assert [c.iteration for c in checkpoints.list_checkpoints(remote)] == [10]
    assert retention_problems(local, "j", 3) == [] and retention_problems(remote, "j", 3) == []

    _flip_largest_shard(held[-1])
    assert retention_problems(local, "j", 3) == []  # 1 and 2 are intact
    assert TierSource("local", local).candidates("j")[-1].iteration == 10
    tiers = [TierSource("local", local), TierSource("remote", remote)]
    monkeypatch.setattr(resolve_mod, "MemorySource", _NoMemory)
    monkeypatch.setattr(resolve_mod, "cluster_tiers", lambda *args: tiers)
    snap = resolve_mod.resolve("tcp://127.0.0.1:9", job="j")
    assert (snap.iteration, snap.tier) == (10, "remote")  # was (2, "local"): 8 iterations lost
    # an explicit iteration still comes from the nearest tier holding it intact
    assert (resolve_mod.resolve("tcp://127.0.0.1:9", job="j", iteration=2).tier) == "local"
    # a directory is one source: the local tier alone falls back within itself
    assert resolve_mod.resolve(local, job="j").iteration == 2


class _Tier:
    """A listed tier whose loads are scripted: ``bad`` iterations are damaged, and a tier
    with ``down`` fails every read as an unreachable store does."""

    def __init__(self, name: str, listed: list[Candidate], bad=(), down: bool = False) -> None:
        self.name, self.root, self.listed, self.bad, self.down = name, f"/{name}", listed, set(bad), down
        self.loads: list[int] = []
        self.listings = 0

    def candidates(self, job):
        self.listings += 1
        return list(self.listed)

    def load(self, c, progress=None):
        self.loads.append(c.iteration)
        if self.down:
            raise ConnectionError("store unreachable")
        if c.iteration in self.bad:
            raise CheckpointError(f"iteration {c.iteration} ({self.name}): fails its checksum")
        return (self.name, c.iteration)


def _c(tier: str, it: int, state: str = "complete", gen: int = 0) -> Candidate:
    return Candidate("j", it, tier, f"/{tier}/{it}", state, gen)


def test_pick_newest_across_tiers():
    pick_newest = resolve_mod.pick_newest
    # the nearest tier's newest intact: no other tier is even listed
    near, far = _Tier("local", [_c("local", 8), _c("local", 9)]), _Tier("remote", [_c("remote", 9)])
    assert pick_newest([near, far], "j")[2] == ("local", 9) and far.listings == 0
    # damaged nearby: the farther copy of the same one, before an older one nearby
    near, far = _Tier("local", [_c("local", 8), _c("local", 9)], bad={9}), _Tier("remote", [_c("remote", 9)])
    assert pick_newest([near, far], "j")[2] == ("remote", 9) and near.loads == [9]
    # a newer generation wins over a higher iteration of an older one; one some tier lists superseded is never taken
    near = _Tier("local", [_c("local", 12, "superseded"), _c("local", 5, gen=1)], bad={5})
    far = _Tier("remote", [_c("remote", 12), _c("remote", 4, gen=1)])
    assert pick_newest([near, far], "j")[2] == ("remote", 4)
    # an unreachable tier is passed over after its first failed read
    near = _Tier("local", [_c("local", 3), _c("local", 8)], bad={8})
    far = _Tier("remote", [_c("remote", 7), _c("remote", 6)], down=True)
    assert pick_newest([near, far], "j")[2] == ("local", 3) and far.loads == [7]
    # the nearest tier holds none: the others are listed
    near, far = _Tier("local", []), _Tier("remote", [_c("remote", 4)])
    assert pick_newest([near, far], "j")[2] == ("remote", 4)
    # nothing restorable: every tier says why
    with pytest.raises(CheckpointError, match=r"local: iteration 3 \(local\): fails.*remote: no complete checkpoint"):
        pick_newest([_Tier("local", [_c("local", 3)], bad={3}), _Tier("remote", [])], "j")


def test_retention_problems_name_what_breaks_the_contract(tmp_path):
    from tests.persist.test_persist_units import LAYOUT, _write_checkpoint

    root = str(tmp_path / "t")
    for it in (1, 2, 3, 4):
        _write_checkpoint(root, "j", it, LAYOUT)
    os.makedirs(checkpoints.checkpoint_dir(root, "j", 0))  # torn, older than the newest complete one
    (over,) = [p for p in retention_problems(root, "j", 3) if "more than" in p]
    assert "4 complete checkpoints of j" in over and "(1, 2, 3, 4), more than 3" in over
    assert not [p for p in retention_problems(root, "j", 3, killed=True) if "more than" in p]
    assert not [p for p in retention_problems(root, "j", 3, copying=[1]) if "more than" in p]
    assert [p for p in retention_problems(root, "j", 4) if "torn" in p]
    assert retention_problems(root, "j", 4, in_flight=[0]) == []
    for c in checkpoints.list_checkpoints(root):
        _flip_largest_shard(c)
    (none_intact,) = retention_problems(root, "j", 4, in_flight=[0])
    assert "reads back intact" in none_intact
