"""A worker's files socket in mac mode (``security.data=mac``), in one process: the socket is
in clear, a read needs a ticket of that worker's files key (the coordinator's restore info)
and the request's MAC, and every chunk of the reply comes under a GMAC bound to the request.
A man in the middle that flips a bit, moves a chunk, strips the tags, changes the salt or
replays an earlier reply is caught before the bytes are used; a read without a valid ticket
is refused and counted; a restore whose one copy was altered on the way takes the next copy
and is bit-identical. The cluster-wide case (a keyed cluster restoring through the worker
holding its local tier) is in slow/test_curve_cluster.py."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import zmq

from shadow import security
from shadow.core.errors import ShadowError
from shadow.persist import checkpoints
from shadow.restore import files_client
from shadow.restore.files_client import read_file
from shadow.restore.node_local import ClusterTierSource
from shadow.transport import SocketFactory
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.worker import files as files_mod
from shadow.worker.address import Binding
from shadow.worker.files import FileServer
from tests.persist.test_persist_units import LAYOUT, _write_checkpoint
from tests.restore.test_node_local import TUNING, _coordinator_copy, _through

DIR = "iteration-0000000005"


@pytest.fixture
def keyed(tmp_path, monkeypatch):
    """A files socket in mac mode, sending small chunks (a shard file is several)."""
    monkeypatch.setattr(files_mod, "FILE_CHUNK_BYTES", 1024)
    srv = FileServer(
        SocketFactory(zmq.Context.instance()),
        Binding("127.0.0.1", "127.0.0.1"),
        str(tmp_path / "disk"),
        keyed=True,
        rejected=Counter(),
    )
    srv.open()
    _write_checkpoint(srv.root, "j", 5, LAYOUT)
    yield srv
    srv.close()


def _auth(srv: FileServer, job: str | None = None) -> tuple[bytes, bytes]:
    """What the coordinator hands a reader for ``srv`` (records.WorkerRec.files_ticket);
    ``job``: a job-scoped reader's, which reads that job only."""
    assert srv.key is not None
    ticket = tags.files_ticket(srv.key, job)
    return ticket, tags.ticket_key(srv.key, ticket)


def _ticket(srv: FileServer) -> dict:
    """``_auth`` as the restore info's worker entry carries it."""
    ticket, key = _auth(srv)
    return {"ticket": ticket, "key": key}


def _shard(srv: FileServer, i: int = 1) -> dict:
    (info,) = checkpoints.list_checkpoints(srv.root, job="j")
    return info.manifest["shards"][i]


def _file(srv: FileServer, shard: dict) -> bytes:
    with open(f"{srv.root}/j/{DIR}/{shard['file']}", "rb") as f:
        return f.read()


class _Middle:
    """A man in the middle of a files socket: each request goes on to ``upstream`` and its
    reply comes back changed as ``how`` says (``None``: unchanged). ``replay``: the first
    reply is passed on and kept, and every later request is answered with it."""

    def __init__(self, upstream: str, how: str | None, door: security.Door) -> None:
        self.upstream, self.how, self.door = upstream, how, door
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        security.doorkeeper(ctx).door(self.front, lambda user, password: "")  # readers come through a door
        self.endpoint = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.kept: list[list[bytes]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread first: ``front`` is closed only once its thread has let go of it
        (closing it under a blocked poll or recv can hang the context's term)."""
        self._stop.set()
        self._thread.join(15)  # past one relay's longest wait for the files socket (10 s)
        assert not self._thread.is_alive(), "the middle's thread did not stop"
        self.front.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.front.poll(50):
                continue
            client, request = self.front.recv_multipart()
            if self.how == "replay" and self.kept is not None:
                for m in self.kept:
                    self.front.send_multipart([client, *m])
                continue
            reply = self._relay(request)
            if self.how == "replay":
                self.kept = reply
            for m in self._change(reply):
                self.front.send_multipart([client, *m])

    def _relay(self, request: bytes) -> list[list[bytes]]:
        """The whole reply to ``request``: the head, then each chunk's frames."""
        back = zmq.Context.instance().socket(zmq.DEALER)
        self.door.apply(back)
        back.connect(self.upstream)
        try:
            back.send(request)
            assert back.poll(10_000), "the files socket did not answer"
            head = back.recv()
            out = [[head]]
            msg = M.decode(head)
            if msg["t"] != "file_reply":
                return out
            got = 0
            while got < msg["bytes"]:
                assert back.poll(10_000), "the files socket stopped sending"
                frames = back.recv_multipart()
                got += len(frames[-1])
                out.append(frames)
            return out
        finally:
            back.close(linger=0)

    def _change(self, reply: list[list[bytes]]) -> list[list[bytes]]:
        if self.how in (None, "replay") or len(reply) < 3:
            return reply
        head, chunks = reply[0][0], [list(c) for c in reply[1:]]
        if self.how == "flip":  # one bit of the second chunk's bytes
            data = bytearray(chunks[1][-1])
            data[len(data) // 2] ^= 0x01
            chunks[1][-1] = bytes(data)
        elif self.how == "swap":  # the first two chunks change places (tags and all)
            chunks[0], chunks[1] = chunks[1], chunks[0]
        elif self.how == "strip":  # the bytes without their tags
            chunks = [[c[-1]] for c in chunks]
        elif self.how == "salt":  # another salt in the head
            msg = M.decode(head)
            head = M.encode("file_reply", bytes=msg["bytes"], chunk=msg["chunk"], salt=tags.new_ticket())
        return [[head], *chunks]


@pytest.fixture
def middle(keyed):
    made: list[_Middle] = []

    def make(how: str | None) -> _Middle:
        # one who sees the clear stream sees a door's credential too: the middle passes the door
        made.append(_Middle(keyed.endpoint, how, security.ticket_door(*_auth(keyed))))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_a_read_with_a_ticket_comes_whole_and_under_its_mac(keyed, middle):
    shard = _shard(keyed)
    assert shard["bytes"] > 2 * files_mod.FILE_CHUNK_BYTES  # several chunks, each with its tag
    assert read_file(keyed.endpoint, "j", DIR, shard, TUNING, _auth(keyed)) == _file(keyed, shard)
    # the man in the middle that changes nothing changes nothing (the proxy itself is sound)
    assert read_file(middle(None).endpoint, "j", DIR, shard, TUNING, _auth(keyed)) == _file(keyed, shard)
    assert keyed.served == 2 and not keyed.rejected


@pytest.mark.parametrize(
    "how,why",
    [
        ("flip", "chunk 2 of the file fails its MAC"),
        ("swap", "chunk 1 of the file fails its MAC"),
        ("strip", "not a tag and bytes"),
        ("salt", "chunk 1 of the file fails its MAC"),
    ],
)
def test_a_reply_changed_on_the_way_is_refused_before_its_bytes_are_used(keyed, middle, how, why):
    shard = _shard(keyed)
    with pytest.raises(ShadowError, match=why):
        read_file(middle(how).endpoint, "j", DIR, shard, TUNING, _auth(keyed))


def test_an_earlier_reply_replayed_answers_no_later_read(keyed, middle):
    """The same ticket, the same file: the second read's fresh nonce makes the first reply's
    tags check under nothing the client expects."""
    shard, auth, m = _shard(keyed), _auth(keyed), middle("replay")
    assert read_file(m.endpoint, "j", DIR, shard, TUNING, auth) == _file(keyed, shard)
    with pytest.raises(ShadowError, match="chunk 1 of the file fails its MAC"):
        read_file(m.endpoint, "j", DIR, shard, TUNING, auth)
    assert keyed.served == 1  # the second read never reached the worker


def _raw_read(srv: FileServer, **fields) -> dict:
    """A ``read_file`` sent as is, through the door with a valid ticket's credential (past
    it, each request's ticket is checked again); the head of the answer."""
    from shadow.transport.client import dealer

    shard = _shard(srv)
    what = {"job": "j", "dir": DIR, "file": shard["file"], "bytes": shard["bytes"]}
    what.update({k: fields.pop(k) for k in ("job", "file") if k in fields})
    what.update({"bytes": fields.pop("nbytes")} if "nbytes" in fields else {})
    sock = dealer(zmq.Context.instance(), srv.endpoint, curve=False, door=security.ticket_door(*_auth(srv)))
    try:
        sock.send(M.encode("read_file", **what, **fields))
        assert sock.poll(10_000)
        return M.decode(sock.recv())
    finally:
        sock.close(linger=0)


def test_a_read_without_a_valid_ticket_is_refused_and_counted(keyed, tmp_path, keyless, monkeypatch):
    shard = _shard(keyed)
    ticket, key = _auth(keyed)
    nonce = tags.new_ticket()
    ok_mac = tags.file_mac(key, "j", DIR, shard["file"], shard["bytes"], nonce)
    other = FileServer(
        SocketFactory(zmq.Context.instance()), Binding("127.0.0.1", "127.0.0.1"), str(tmp_path / "d2"), keyed=True
    )
    assert other.key is not None
    stale = tags.ticket_key(other.key, ticket)  # the worker's previous process (another files key)
    cases = {
        "none": {},
        "forged key": {
            "ticket": ticket,
            "nonce": nonce,
            "mac": tags.file_mac(b"k" * 32, "j", DIR, shard["file"], shard["bytes"], nonce),
        },
        "another process's key": {
            "ticket": ticket,
            "nonce": nonce,
            "mac": tags.file_mac(stale, "j", DIR, shard["file"], shard["bytes"], nonce),
        },
        "the MAC of another file": {
            "ticket": ticket,
            "nonce": nonce,
            "mac": tags.file_mac(key, "j", DIR, _shard(keyed, 0)["file"], shard["bytes"], nonce),
        },
        "another nonce": {"ticket": ticket, "nonce": tags.new_ticket(), "mac": ok_mac},
        "a short ticket": {"ticket": ticket[:8], "nonce": nonce, "mac": ok_mac},
    }
    for name, fields in cases.items():
        head = _raw_read(keyed, **fields)
        assert head["t"] == "error" and "no valid ticket" in head["message"], name
    assert keyed.rejected["files_bad_ticket"] == len(cases) and keyed.served == 0
    # and the request as the coordinator's ticket makes it is served
    head = _raw_read(keyed, ticket=ticket, nonce=nonce, mac=ok_mac)
    assert head["t"] == "file_reply" and len(head["salt"]) == tags.SALT_SIZE
    # a read without a ticket gets no further than the door: nothing is answered
    monkeypatch.setattr(files_client, "HEAD_TIMEOUT_S", 1.0)
    with pytest.raises(ShadowError, match="no answer"):
        read_file(keyed.endpoint, "j", DIR, shard, TUNING)
    assert keyed.rejected["files_bad_ticket"] == len(cases)  # it never reached the files thread


def test_a_copy_altered_on_the_way_is_passed_over_and_the_restore_is_exact(tmp_path, keyed, middle):
    """Two ways to the worker's copy: the first through a man in the middle, the second
    straight; the checkpoint loads bit for bit from the second."""
    info = _coordinator_copy(tmp_path, keyed, "/nonexistent/disk")
    direct = checkpoints.load(checkpoints.list_checkpoints(keyed.root, job="j")[0])
    bad = middle("flip")
    workers = [
        {"id": 0, "files": bad.endpoint, "disk": keyed.disk, **_ticket(keyed)},
        {"id": 0, "files": keyed.endpoint, "disk": keyed.disk, **_ticket(keyed)},
    ]
    src = ClusterTierSource("local", info.root, "tcp://127.0.0.1:9", workers, 1.0, TUNING, direct=False)
    snap = checkpoints.load(_through(src, info))
    for f in direct.arrays:
        assert np.array_equal(snap.arrays[f].view(np.uint32), direct.arrays[f].view(np.uint32)), f
    assert np.array_equal(snap.steps, direct.steps) and snap.blobs == direct.blobs


def test_a_reader_that_never_reads_its_refusals_delays_no_other_read(keyed, keyless):
    """Issue 53, item 4: each error reply to a peer whose queue was full blocked the files
    thread for the socket's send timeout (1 s), so 5 s of ticketless requests from a peer
    that never reads delayed a legitimate 50 MB read from 0.2 s to 14 s, and still after
    the attacker stopped. A refusal now never waits: a peer that does not read gets none
    (counted ``files_reply_dropped``), and the read beside it is served at once."""
    import time

    from shadow.transport.client import dealer

    shard = _shard(keyed)
    want = _file(keyed, shard)
    t0 = time.monotonic()
    assert read_file(keyed.endpoint, "j", DIR, shard, TUNING, _auth(keyed)) == want
    alone = time.monotonic() - t0
    # a ticket's holder (a stranger no longer gets past the door) sending ticketless requests
    flood = dealer(zmq.Context.instance(), keyed.endpoint, curve=False, door=security.ticket_door(*_auth(keyed)))
    flood.setsockopt(zmq.RCVHWM, 1)
    flood.setsockopt(zmq.RCVBUF, 4096)
    try:
        request = M.encode("read_file", job="j", dir=DIR, file=shard["file"], bytes=shard["bytes"])
        deadline = time.monotonic() + 60
        # never read: the worker's queue to this peer fills (the kernel buffers first, then zmq's)
        while keyed.rejected["files_reply_dropped"] < 50 and time.monotonic() < deadline:
            for _ in range(500):
                if not flood.poll(0, zmq.POLLOUT):
                    break
                flood.send(request, zmq.NOBLOCK)
            time.sleep(0.01)
        assert keyed.rejected["files_reply_dropped"] >= 50, keyed.rejected
        t0 = time.monotonic()
        assert read_file(keyed.endpoint, "j", DIR, shard, TUNING, _auth(keyed)) == want
        beside = time.monotonic() - t0
    finally:
        flood.close(linger=0)
    # the thread was never held: before, every reply dropped here had cost it 1 s
    assert beside < max(10 * alone, 2.0), (beside, alone, keyed.rejected)


def test_a_job_scoped_readers_ticket_reads_its_job_only(keyed):
    """A ticket handed to a reader limited to job ``j`` reads ``j``'s files; the same ticket
    is refused on job ``k``'s, and a ticket made by splicing the head of an every-job ticket
    onto it has no key that checks out."""
    _write_checkpoint(keyed.root, "k", 5, LAYOUT)
    shard = _shard(keyed)
    (other,) = checkpoints.list_checkpoints(keyed.root, job="k")
    mine, key = _auth(keyed, job="j")
    nonce = tags.new_ticket()

    def read(job: str, ticket: bytes, key: bytes, s: dict) -> dict:
        mac = tags.file_mac(key, job, DIR, s["file"], s["bytes"], nonce)
        return _raw_read(keyed, job=job, ticket=ticket, nonce=nonce, mac=mac, file=s["file"], nbytes=s["bytes"])

    assert read("j", mine, key, shard)["t"] == "file_reply"
    head = read("k", mine, key, other.manifest["shards"][1])
    assert head["t"] == "error" and "does not read job 'k'" in head["message"]
    assert keyed.rejected["files_scope"] == 1
    every, _ = _auth(keyed)
    widened = every[:8] + mine[8:]  # the tag of an every-job ticket, the rest of the scoped one
    head = read("k", widened, key, other.manifest["shards"][1])
    assert head["t"] == "error" and "no valid ticket" in head["message"]
    assert keyed.rejected["files_scope"] == 1 and keyed.rejected["files_bad_ticket"] == 1
