"""Node-local tiers in one process: a worker's files socket serves only checkpoint shard
files under its own root, a checkpoint whose shards are on a disk this host cannot see
loads through the worker holding them (and is refused when that copy is damaged or no
worker holds it), retention's deletes reach the workers' disks, and a directory's disk id
is the same for every worker using it. The cluster-wide cases (separate hosts, a lost
host, a restarted cluster) are in test_multihost.py."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import zmq

from shadow.errors import CheckpointError, ShadowError
from shadow.persist import checkpoints, disks
from shadow.restore.cluster_tier import ClusterTierSource, read_file
from shadow.transport import SocketFactory
from shadow.tuning import Tuning
from shadow.wire import messages as M
from shadow.worker.address import Binding
from shadow.worker.files import FileServer
from tests.test_persist_units import LAYOUT, _write_checkpoint

TUNING = Tuning.load().replace(fetch_timeout_s=5.0)


@pytest.fixture
def server(tmp_path):
    srv = FileServer(SocketFactory(zmq.Context.instance()), Binding("127.0.0.1", "127.0.0.1"), str(tmp_path / "disk"))
    srv.open()
    yield srv
    srv.close()


def _coordinator_copy(tmp_path, server: FileServer, holder_dir: str) -> checkpoints.CheckpointInfo:
    """Iteration 5 of job ``j`` written to the worker's disk; the manifest, with the shards'
    holders, on the coordinator's disk only (as a node-local tier keeps it)."""
    _write_checkpoint(server.root, "j", 5, LAYOUT)
    (on_disk,) = checkpoints.list_checkpoints(server.root, job="j")
    manifest = dict(on_disk.manifest)
    manifest["shards"] = [
        {**s, "holders": [{"worker": 0, "disk": server.disk["id"], "dir": holder_dir, "host": "elsewhere"}]}
        for s in manifest["shards"]
    ]
    coord = str(tmp_path / "coordinator")
    checkpoints.write_manifest(coord, "j", 5, manifest, parents=True)
    (info,) = checkpoints.list_checkpoints(coord, job="j")
    return info


def _flip(path: str, offset: int) -> None:
    """Flip one bit of the file at ``offset``: damage on a disk."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _through(src: ClusterTierSource, info: checkpoints.CheckpointInfo) -> checkpoints.CheckpointInfo:
    info.locate = lambda shard: src._locate(info, shard)
    return info


def test_a_checkpoint_on_a_disk_only_its_worker_sees_loads_through_it(tmp_path, server):
    info = _coordinator_copy(tmp_path, server, "/nonexistent/disk")  # the holder's path is not on this host
    direct = checkpoints.load(checkpoints.list_checkpoints(server.root, job="j")[0])
    workers = [{"id": 0, "files": server.endpoint, "disk": server.disk}]
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING)
    snap = checkpoints.load(_through(src, info))
    assert server.served == 2  # both shards came over the files socket
    assert snap.iteration == 5 and set(snap.arrays) == set(direct.arrays)
    for f in direct.arrays:
        assert np.array_equal(snap.arrays[f], direct.arrays[f])
    assert np.array_equal(snap.steps, direct.steps) and snap.blobs == direct.blobs

    # a holder directory this host does see is read directly, not through the worker
    info = _coordinator_copy(tmp_path / "again", server, server.root)
    checkpoints.load(_through(src, info))
    assert server.served == 2
    # the same path on this host that is another disk (its mark differs) is not the holder's
    decoy = tmp_path / "decoy"
    shutil.copytree(server.root, decoy)
    (decoy / disks.MARK).write_text("e" * 32)
    info = _coordinator_copy(tmp_path / "third", server, str(decoy))
    checkpoints.load(_through(src, info))
    assert server.served == 4
    # and a client told to read nothing itself goes through the worker too
    direct_off = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING, direct=False)
    info = _coordinator_copy(tmp_path / "fourth", server, server.root)
    checkpoints.load(_through(direct_off, info))
    assert server.served == 6


def test_a_damaged_or_unheld_copy_is_refused(tmp_path, server):
    info = _coordinator_copy(tmp_path, server, "/nonexistent/disk")
    shard = info.manifest["shards"][1]
    path = f"{server.root}/j/{info.path.rsplit('/', 1)[1]}/{shard['file']}"
    _flip(path, shard["bytes"] - 1)  # one bit of the worker's copy flips
    workers = [{"id": 0, "files": server.endpoint, "disk": server.disk}]
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING)
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoints.load(_through(src, info))
    other = [{"id": 1, "files": server.endpoint, "disk": {"id": "f" * 32, "dir": "/d", "host": "h"}}]
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", other, 1.0, TUNING)
    with pytest.raises(CheckpointError, match="no live worker holds it"):
        checkpoints.load(_through(src, info))


@pytest.mark.parametrize(
    "job,directory,name,why",
    [
        ("../j", "iteration-0000000005", "shard-00000-of-00002.safetensors", "A-Za-z0-9"),
        ("j", "../../etc", "shard-00000-of-00002.safetensors", "not a checkpoint directory"),
        ("j", "iteration-0000000005", "../../../etc/passwd", "not a shard file"),
        ("j", "iteration-0000000005", "manifest.json", "not a shard file"),
        ("j", "iteration-0000000009", "shard-00000-of-00002.safetensors", "no such file"),
    ],
)
def test_the_files_socket_serves_shard_files_only(tmp_path, server, job, directory, name, why):
    _write_checkpoint(server.root, "j", 5, LAYOUT)
    with pytest.raises(ShadowError, match=why):
        read_file(server.endpoint, job, directory, {"file": name, "bytes": 100}, TUNING)
    # the right size is part of the request: a file of another size is not this checkpoint's
    (info,) = checkpoints.list_checkpoints(server.root, job="j")
    shard = info.manifest["shards"][0]
    with pytest.raises(ShadowError, match="not a regular file of"):
        read_file(server.endpoint, "j", "iteration-0000000005", {**shard, "bytes": shard["bytes"] + 1}, TUNING)
    assert len(read_file(server.endpoint, "j", "iteration-0000000005", shard, TUNING)) == shard["bytes"]


def test_a_link_in_a_workers_tier_is_not_followed(tmp_path, server):
    _write_checkpoint(server.root, "j", 5, LAYOUT)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    d = f"{server.root}/j/iteration-0000000005"
    name = "shard-00000-of-00002.safetensors"
    shutil.move(f"{d}/{name}", str(tmp_path / "moved"))
    (tmp_path / "link").symlink_to(secret)
    shutil.move(str(tmp_path / "link"), f"{d}/{name}")
    with pytest.raises(ShadowError, match="cannot read"):
        read_file(server.endpoint, "j", "iteration-0000000005", {"file": name, "bytes": 64}, TUNING)


def test_forget_deletes_checkpoint_directories_only(tmp_path, server):
    for it in (5, 6):
        _write_checkpoint(server.root, "j", it, LAYOUT)
    keep = tmp_path / "disk" / "j" / "notes"
    keep.mkdir()
    server.forget("j", ["iteration-0000000005", "../../x", "notes", "iteration-0000000007"])
    deadline = time.monotonic() + 5
    while (tmp_path / "disk" / "j" / "iteration-0000000005").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sorted(p.name for p in (tmp_path / "disk" / "j").iterdir()) == ["iteration-0000000006", "notes"]


def test_a_directory_has_one_disk_id(tmp_path, caplog):
    a, b = disks.describe(str(tmp_path / "a")), disks.describe(str(tmp_path / "a"))
    assert a == b and len(a["id"]) == 32 and a["dir"] == str(tmp_path / "a")
    assert disks.describe(str(tmp_path / "b"))["id"] != a["id"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / disks.MARK).write_text("not an id")
    assert disks.describe(str(tmp_path / "c"))["id"] == "" and "does not hold a disk id" in caplog.text
    assert (tmp_path / "c" / disks.MARK).read_text() == "not an id"  # left for a person to look at


def test_a_client_that_stops_reading_holds_up_no_other(tmp_path, server):
    """Files go out a chunk each in turn, each as its client's queue has room: a client
    that asked and reads nothing does not stop another from getting the whole file."""
    from shadow.client import dealer

    _write_checkpoint(server.root, "j", 5, LAYOUT)
    (info,) = checkpoints.list_checkpoints(server.root, job="j")
    shard = info.manifest["shards"][1]
    big = f"{server.root}/j/iteration-0000000005/{shard['file']}"
    with open(big, "ab") as f:  # many chunks: the silent client's queue fills
        f.write(b"\0" * (64 << 20))
    shard = {**shard, "bytes": shard["bytes"] + (64 << 20)}
    silent = dealer(zmq.Context.instance(), server.endpoint, rcvhwm=1)
    try:
        silent.send(
            M.encode("read_file", job="j", dir="iteration-0000000005", file=shard["file"], bytes=shard["bytes"])
        )
        time.sleep(0.5)
        # (a head held up behind the silent client would time out: HEAD_TIMEOUT_S)
        data = read_file(server.endpoint, "j", "iteration-0000000005", shard, TUNING)
        assert len(data) == shard["bytes"]
    finally:
        silent.close(linger=0)


def test_a_damaged_copy_on_one_disk_is_passed_over_for_its_replicas(tmp_path, server):
    """replicas=2 on two disks, one copy of a shard damaged: the restore takes the other."""
    info = _coordinator_copy(tmp_path, server, "/nonexistent/disk")
    other = FileServer(
        SocketFactory(zmq.Context.instance()), Binding("127.0.0.1", "127.0.0.1"), str(tmp_path / "disk2")
    )
    other.open()
    try:
        shutil.copytree(f"{server.root}/j", f"{other.root}/j")
        shard = info.manifest["shards"][1]
        _flip(f"{server.root}/j/iteration-0000000005/{shard['file']}", shard["bytes"] // 2)
        for s in info.manifest["shards"]:
            s["holders"].append({"worker": 1, "disk": other.disk["id"], "dir": "/nonexistent/disk2", "host": "h2"})
        workers = [
            {"id": 0, "files": server.endpoint, "disk": server.disk},
            {"id": 1, "files": other.endpoint, "disk": other.disk},
        ]
        src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING)
        snap = checkpoints.load(_through(src, info))
        direct = checkpoints.load(checkpoints.list_checkpoints(other.root, job="j")[0])
        assert all(np.array_equal(snap.arrays[f], direct.arrays[f]) for f in direct.arrays)
        assert other.served == 1  # only the damaged shard came from the second disk
    finally:
        other.close()


def test_verify_through_the_cluster_reads_every_copy(tmp_path, server):
    """Each holder's copy is read and checked: a damaged one and one no live worker holds
    are each a problem naming its disk; the intact copies are not."""
    info = _coordinator_copy(tmp_path, server, "/nonexistent/disk")
    shard = info.manifest["shards"][0]
    _flip(f"{server.root}/j/iteration-0000000005/{shard['file']}", shard["bytes"] // 2)
    for s in info.manifest["shards"]:
        s["holders"].append({"worker": 7, "disk": "d" * 32, "dir": "/nonexistent/gone", "host": "gone"})
    workers = [{"id": 0, "files": server.endpoint, "disk": server.disk}]
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING)
    problems = src.verify_copies(info)
    assert len(problems) == 3, problems  # shard 0 damaged on disk 0; both shards missing on the lost disk
    assert sum(f"on disk {server.disk['id']}" in p and "shard 0" in p for p in problems) == 1
    assert sum(f"on disk {'d' * 32}" in p for p in problems) == 2


def test_the_coordinators_catalog_is_read_again_only_when_the_tier_changed(tmp_path, monkeypatch):
    """``catalog`` answers from what it read last while the tier's manifests are unchanged,
    reads again when one is added, and sends the newest manifests that fit its budget,
    saying how many older ones it left out."""
    from shadow.config import PersistConfig
    from shadow.coordinator import queries
    from shadow.coordinator.outbox import RecordingOutbox
    from shadow.coordinator.persistence import Persistence
    from shadow.coordinator.state import ClusterState

    root = tmp_path / "manifests"
    tier = {"every_n": 1, "keep": 0, "dir": str(root)}
    q = queries.Queries(
        ClusterState(expected=1), RecordingOutbox(), Persistence(PersistConfig.from_dict({"local": tier}))
    )
    reads = []
    real = checkpoints.list_checkpoints
    monkeypatch.setattr(checkpoints, "list_checkpoints", lambda *a, **k: reads.append(1) or real(*a, **k))

    def ask() -> dict:
        q.on_catalog([b"c"], {"t": "catalog", "tier": "local", "job": "j"})
        return q.out.last("catalog_reply", b"c")

    for it in (1, 2):
        _write_checkpoint(str(root), "j", it, LAYOUT)
    assert [e[0] for e in ask()["checkpoints"]] == ["j/iteration-0000000001", "j/iteration-0000000002"]
    ask()
    assert len(reads) == 1  # unchanged: not read again
    _write_checkpoint(str(root), "j", 3, LAYOUT)
    assert len(ask()["checkpoints"]) == 3 and len(reads) == 2
    size = len(ask()["checkpoints"][-1][1])
    monkeypatch.setattr(queries, "CATALOG_BYTES", 2 * size + 10)
    got = ask()
    assert [e[0] for e in got["checkpoints"]] == ["j/iteration-0000000002", "j/iteration-0000000003"]
    assert got["left_out"] == 1
    assert q.out.last("catalog_reply", b"c") is not None and M.decode(M.encode("catalog_reply", **got))
