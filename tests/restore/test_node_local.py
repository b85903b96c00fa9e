"""Node-local tiers in one process: a worker's files socket serves only checkpoint shard
files under its own root, a checkpoint whose shards are on a disk this host cannot see
loads through the worker holding them (and is refused when that copy is damaged or no
worker holds it), a damaged copy is passed over for the next holder's (read here or through
its worker) and the result is bit-identical, ``shadow verify`` tells a lost replica from a
checkpoint that cannot be restored, retention's deletes reach the workers' disks, and a
directory's disk id is the same for every worker using it. The cluster-wide cases (separate hosts, a lost
host, a restarted cluster) are in slow/test_multihost.py."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import zmq

from shadow.config.tuning import Tuning
from shadow.core.errors import CheckpointError, ShadowError
from shadow.persist import checkpoints, disks
from shadow.restore.files_client import read_file
from shadow.restore.node_local import ClusterTierSource
from shadow.transport import SocketFactory
from shadow.wire import messages as M
from shadow.worker.address import Binding
from shadow.worker.files import FileServer
from tests.persist.test_persist_units import LAYOUT, _write_checkpoint

pytestmark = pytest.mark.usefixtures("keyless")  # in-process services built without a guard

TUNING = Tuning.load().replace(fetch_timeout_s=5.0)


def _file_server(root: str):
    srv = FileServer(SocketFactory(zmq.Context.instance()), Binding("127.0.0.1", "127.0.0.1"), root)
    srv.open()
    return srv


@pytest.fixture
def server(tmp_path):
    srv = _file_server(str(tmp_path / "disk"))
    yield srv
    srv.close()


@pytest.fixture
def other(tmp_path):
    """A second worker's files socket, on a disk of its own (``replicas=2``)."""
    srv = _file_server(str(tmp_path / "disk2"))
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


def _replicated(tmp_path, server: FileServer, other: FileServer, dir0: str, dir1: str) -> checkpoints.CheckpointInfo:
    """Iteration 5 with a copy of each shard on both disks (``replicas=2``); the manifest
    names ``dir0`` and ``dir1`` as the two workers' directories (a path this host does not
    see: its copy only through its worker)."""
    info = _coordinator_copy(tmp_path, server, dir0)
    shutil.copytree(f"{server.root}/j", f"{other.root}/j")
    for s in info.manifest["shards"]:
        s["holders"].append({"worker": 1, "disk": other.disk["id"], "dir": dir1, "host": "h2"})
    return info


def _workers(*servers: FileServer) -> list[dict]:
    return [{"id": i, "files": srv.endpoint, "disk": srv.disk} for i, srv in enumerate(servers)]


def _shard_file(srv: FileServer, shard: dict) -> str:
    return f"{srv.root}/j/iteration-0000000005/{shard['file']}"


def _param_byte(path: str) -> int:
    """A file offset inside the shard's ``param`` tensor: a flip there reaches the model."""
    from shadow.persist import shardfile

    with open(path, "rb") as f:
        data = f.read()
    _, base, specs = shardfile.tensor_specs(data)
    (lo, hi) = next((lo, hi) for name, _, lo, hi in specs if name == "param")
    return base + (lo + hi) // 2


def _assert_same(snap, want) -> None:
    """Bit-identical: every flat array, the steps, the commit records, the extra state."""
    assert set(snap.arrays) == set(want.arrays)
    for f in want.arrays:
        assert np.array_equal(snap.arrays[f].view(np.uint32), want.arrays[f].view(np.uint32)), f
    assert np.array_equal(snap.steps, want.steps) and np.array_equal(snap.has_state, want.has_state)
    assert snap.blobs == want.blobs and snap.extras.keys() == want.extras.keys()


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


def test_a_linked_job_or_checkpoint_directory_is_neither_served_nor_deleted_through(tmp_path, server):
    """Row 17 (issue 38): a link in place of a job's or a checkpoint's directory led the
    files socket (and retention's deletes) out of the worker's tier."""
    elsewhere = tmp_path / "elsewhere"
    _write_checkpoint(str(elsewhere), "j", 5, LAYOUT)
    (info,) = checkpoints.list_checkpoints(str(elsewhere), job="j")
    shard = info.manifest["shards"][0]
    os.makedirs(server.root, exist_ok=True)
    os.symlink(elsewhere / "j", f"{server.root}/j")  # the job's directory is a link
    with pytest.raises(ShadowError, match="cannot read"):
        read_file(server.endpoint, "j", "iteration-0000000005", shard, TUNING)
    os.unlink(f"{server.root}/j")
    os.makedirs(f"{server.root}/j")
    os.symlink(elsewhere / "j" / "iteration-0000000005", f"{server.root}/j/iteration-0000000005")
    with pytest.raises(ShadowError, match="cannot read"):
        read_file(server.endpoint, "j", "iteration-0000000005", shard, TUNING)
    os.unlink(f"{server.root}/j/iteration-0000000005")
    os.rmdir(f"{server.root}/j")
    os.symlink(elsewhere / "j", f"{server.root}/j")
    _write_checkpoint(server.root, "k", 6, LAYOUT)
    server.forget("j", ["iteration-0000000005"])
    server.forget("k", ["iteration-0000000006"])  # deleted after the first was carried out (one queue)
    deadline = time.monotonic() + 30
    while os.path.exists(f"{server.root}/k/iteration-0000000006"):
        assert time.monotonic() < deadline, "the files thread deleted nothing"
        time.sleep(0.05)
    assert (elsewhere / "j" / "iteration-0000000005").is_dir()


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
    # a directory named as a checkpoint's that holds anything else is not one (row 11, issue 38)
    other = tmp_path / "disk" / "j" / "iteration-0000000008"
    other.mkdir()
    (other / "thesis.tex").write_text("not a checkpoint")
    _write_checkpoint(server.root, "j", 9, LAYOUT)
    server.forget("j", ["iteration-0000000008", "iteration-0000000009"])
    while (tmp_path / "disk" / "j" / "iteration-0000000009").exists():
        assert time.monotonic() < deadline + 30
        time.sleep(0.05)
    assert (other / "thesis.tex").read_text() == "not a checkpoint"


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
    from shadow.transport.client import dealer

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


def test_readers_that_never_read_cost_a_bounded_number_of_transfers(tmp_path, server, monkeypatch):
    """Row 3 (issue 38): 151 connections that asked for a file and read nothing grew a
    worker by 2 GB and kept a real restore waiting. At most ``MAX_TRANSFERS`` files go out at
    once, one per connection; the rest are told "busy" and counted, and a real read asks
    again until a silent reader is dropped."""
    from shadow.transport.client import dealer
    from shadow.worker import files as files_mod

    monkeypatch.setattr(files_mod, "SEND_TIMEOUT_S", 1.0)
    _write_checkpoint(server.root, "j", 5, LAYOUT)
    (info,) = checkpoints.list_checkpoints(server.root, job="j")
    shard = info.manifest["shards"][1]
    big = f"{server.root}/j/iteration-0000000005/{shard['file']}"
    with open(big, "ab") as f:  # many chunks: a silent reader's queue fills and its transfer stays
        f.write(b"\0" * (32 << 20))
    shard = {**shard, "bytes": shard["bytes"] + (32 << 20)}
    request = M.encode("read_file", job="j", dir="iteration-0000000005", file=shard["file"], bytes=shard["bytes"])
    silent = [dealer(zmq.Context.instance(), server.endpoint, rcvhwm=1) for _ in range(files_mod.MAX_TRANSFERS + 3)]
    try:
        heads = []
        for s in silent:
            s.send(request)
            assert s.poll(10_000)
            heads.append(M.decode(s.recv()))
        kinds = [h["t"] if h["t"] != "error" else h["code"] for h in heads]
        assert kinds == ["file_reply"] * files_mod.MAX_TRANSFERS + ["busy"] * 3, kinds
        assert server.rejected["files_busy"] == 3
        data = read_file(server.endpoint, "j", "iteration-0000000005", shard, TUNING)  # waits its turn
        assert len(data) == shard["bytes"]
    finally:
        for s in silent:
            s.close(linger=0)


def test_a_damaged_copy_on_one_disk_is_passed_over_for_its_replicas(tmp_path, server, other):
    """replicas=2 on two disks, one copy of a shard damaged: the restore takes the other."""
    info = _replicated(tmp_path, server, other, "/nonexistent/disk", "/nonexistent/disk2")
    shard = info.manifest["shards"][1]
    _flip(_shard_file(server, shard), shard["bytes"] // 2)
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", _workers(server, other), 1.0, TUNING)
    snap = checkpoints.load(_through(src, info))
    _assert_same(snap, checkpoints.load(checkpoints.list_checkpoints(other.root, job="j")[0]))
    assert other.served == 1  # only the damaged shard came from the second disk


def _damage(monkeypatch, path: str, how: str, shard: dict) -> None:
    """Damage this host's read of the copy at ``path``: a bit flipped in its data, the file
    cut short, a header that parses but names a field the intact copy does not hold, or a
    read error from the disk (the file itself intact: its worker, reading it on its own
    host, still can)."""
    if how == "flip":
        _flip(path, _param_byte(path))
    elif how == "header":  # the same length (the header's padding is spaces): only the checksum tells
        import struct

        with open(path, "r+b") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            head = f.read(hlen)
            renamed = head.replace(b'"exp_avg_sq":', b'"max_exp_avg_sq":', 1)
            assert renamed != head and renamed.endswith(b"    ")
            f.seek(8)
            f.write(renamed[:-4])
    elif how == "short":
        with open(path, "r+b") as f:
            f.truncate(shard["bytes"] // 2)
    else:
        from shadow.persist import shardfile

        real = shardfile.read_into

        def failing(p, target):
            if p == path:
                raise OSError(5, "Input/output error", p)
            return real(p, target)

        monkeypatch.setattr(shardfile, "read_into", failing)


@pytest.mark.parametrize("how", ["flip", "short", "header", "unreadable"])
@pytest.mark.parametrize("second", ["here", "through its worker"])
def test_a_damaged_copy_read_here_is_passed_over_for_the_next_holders(
    tmp_path, server, other, monkeypatch, caplog, how, second
):
    """Both disks' directories visible to the restoring process (or only the first's): disk
    0's copy of shard 1 read here is damaged, so disk 1's copy is read -- here, or through
    its worker -- and the snapshot is bit-identical to disk 1's, nothing of the bad copy
    left in the flat arrays its read went into."""
    dir1 = other.root if second == "here" else "/nonexistent/disk2"
    info = _replicated(tmp_path, server, other, server.root, dir1)
    want = checkpoints.load(checkpoints.list_checkpoints(other.root, job="j")[0])
    shard = info.manifest["shards"][1]
    _damage(monkeypatch, _shard_file(server, shard), how, shard)
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", _workers(server, other), 1.0, TUNING)
    snap = checkpoints.load(_through(src, info))
    _assert_same(snap, want)
    served = (server.served, other.served)
    if second == "here":
        assert served == (0, 0)  # every shard read from the disks directly
    elif how == "unreadable":
        assert served == (1, 0)  # this host cannot read it, disk 0's worker can
    else:
        assert served == (0, 1)  # disk 0's own worker is not asked for the same bad file
    assert f"passing over its copy on disk {server.disk['id']}" in caplog.text


def test_every_copy_damaged_fails_naming_each(tmp_path, server, other):
    """Disk 0's copy (read here) fails its checksum, disk 1's (through its worker) is short:
    the load fails, naming both copies and why."""
    info = _replicated(tmp_path, server, other, server.root, "/nonexistent/disk2")
    shard = info.manifest["shards"][1]
    _flip(_shard_file(server, shard), _param_byte(_shard_file(server, shard)))
    with open(_shard_file(other, shard), "r+b") as f:
        f.truncate(shard["bytes"] - 1)
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", _workers(server, other), 1.0, TUNING)
    with pytest.raises(CheckpointError) as err:
        checkpoints.load(_through(src, info))
    msg = str(err.value)
    assert "iteration 5 (local): shard 1: no intact copy" in msg, msg
    assert f"disk {server.disk['id']} (worker 0, host elsewhere, read here from {_shard_file(server, shard)})" in msg
    assert "fails its checksum" in msg
    assert f"disk {other.disk['id']} (worker 1, " in msg and f"through worker 1 at {other.endpoint}" in msg
    assert f"not a regular file of {shard['bytes']} bytes" in msg, msg
    assert server.served == 0  # its worker would serve the same damaged file


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
    got = src.check_copies(info)
    assert got.unrestorable == [0] and not got.restorable  # shard 0 has no intact copy left
    lost = sorted((c["shard"], c["disk"]) for c in got.lost)
    assert lost == sorted([(0, server.disk["id"]), (0, "d" * 32), (1, "d" * 32)])  # a random disk id sorts anywhere


def test_verify_tells_a_lost_replica_from_a_checkpoint_that_cannot_be_restored(
    tmp_path, server, other, monkeypatch, capsys
):
    """``shadow verify`` through a cluster: every copy intact is OK (exit 0); a copy damaged
    whose shard has another intact one is DEGRADED, still restorable (exit 0, ``ok`` false,
    ``restorable`` true, the lost copy named); a shard with no intact copy is CORRUPT (exit 1)."""
    import importlib
    import json

    import shadow.restore
    from shadow.cli._commands import cmd_verify
    from shadow.config import VerifyConfig
    from shadow.restore.storage_source import TierSource

    info = _replicated(tmp_path, server, other, "/nonexistent/disk", other.root)
    checkpoints.write_manifest(info.root, "j", 5, info.manifest)  # the coordinator's copy names both holders
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", _workers(server, other), 1.0, TUNING)
    monkeypatch.setattr(src, "candidates", lambda job: TierSource.candidates(src, job))  # no coordinator here

    class NoMemory:
        def __init__(self, *args) -> None:
            pass

        def candidates(self, job):
            return []

    monkeypatch.setattr(shadow.restore, "MemorySource", NoMemory)
    resolve = importlib.import_module("shadow.restore.resolve")  # the module (the package names a function so)
    monkeypatch.setattr(resolve, "cluster_tiers", lambda *args: [src])

    def verify(json_out: bool) -> tuple[int, str]:
        capsys.readouterr()
        rc = cmd_verify(VerifyConfig(source="tcp://127.0.0.1:9", json=json_out, timeout=1.0))
        return rc, capsys.readouterr().out

    rc, out = verify(False)
    assert rc == 0 and "j iteration 5 (local tier): OK (2 shards" in out, out
    shard = info.manifest["shards"][1]
    _flip(_shard_file(server, shard), _param_byte(_shard_file(server, shard)))
    rc, out = verify(False)
    assert rc == 0 and "j iteration 5 (local tier): DEGRADED: lost replica, still restorable (1 copy" in out, out
    assert f"shard 1 on disk {server.disk['id']} (worker 0" in out and "fails its checksum" in out, out
    rc, out = verify(True)
    (r,) = json.loads(out)
    assert rc == 0 and (r["ok"], r["status"], r["restorable"], r["unrestorable_shards"]) == (
        False,
        "degraded",
        True,
        [],
    )
    assert [(c["shard"], c["disk"], c["worker"]) for c in r["lost_copies"]] == [(1, server.disk["id"], 0)]
    assert len(r["problems"]) == 1 and "fails its checksum" in r["problems"][0]

    with open(_shard_file(other, shard), "r+b") as f:  # the other copy of shard 1 too: none is left
        f.truncate(shard["bytes"] // 2)
    rc, out = verify(False)
    assert rc == 1 and "j iteration 5 (local tier): CORRUPT (2 shards" in out, out
    assert "shard 1: no intact copy left: not restorable" in out and "short or damaged" in out, out
    rc, out = verify(True)
    (r,) = json.loads(out)
    assert rc == 1 and (r["ok"], r["status"], r["restorable"], r["unrestorable_shards"]) == (
        False,
        "corrupt",
        False,
        [1],
    )
    assert len(r["lost_copies"]) == 2


def test_the_coordinators_catalog_is_read_again_only_when_the_tier_changed(tmp_path, monkeypatch):
    """``catalog`` answers from what it read last while the tier's manifests are unchanged,
    reads again when one is added, and sends the newest manifests that fit its budget,
    saying how many older ones it left out."""
    from shadow.config import PersistConfig
    from shadow.coordinator import queries
    from shadow.coordinator.cluster import ClusterState
    from shadow.coordinator.outbox import RecordingOutbox
    from shadow.coordinator.persistence import Persistence

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
