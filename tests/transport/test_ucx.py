"""The UCX data path's own behaviour (the checks it shares with ZeroMQ run over both in
test_transport_receive.py): what it refuses before any frame is read, a dead or vanished
peer on either end, the per-worker choice of transport, and the settings around it."""

from __future__ import annotations

import collections
import struct
import time

import numpy as np
import pytest
import zmq

from shadow.config import ClusterConfig, TransportConfig, WorkerConfig
from shadow.config.security import SecurityConfig
from shadow.testing.faults import sever
from shadow.transport import ucx, ucx_send
from shadow.transport.channels import Channels
from shadow.transport.send import DataSender
from shadow.transport.ucx_base import _array

pytestmark = pytest.mark.skipif(not ucx.available(), reason=f"UCX for Python is not installed: {ucx.INSTALL}")


#: this test's senders, polled as a trainer's sender thread polls its own
_SENDERS: list[DataSender] = []


def pump_until(sock: ucx.UcxDataSocket, cond, what: str, timeout: float = 30) -> None:
    """Progress ``sock`` as the worker's loop does, and the senders as their threads do,
    until ``cond()``; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s (rejected {dict(sock.rejected)})")
        sock.pump()
        for out in _SENDERS:
            out.poll()
        sock.wait(0.02)


@pytest.fixture(autouse=True)
def _forget_senders():
    yield
    _SENDERS.clear()


def read_all(sock: ucx.UcxDataSocket) -> list[list[bytes]]:
    out = []
    while True:
        try:
            first = sock.recv_first()
        except zmq.Again:
            return out
        msg = [first]
        while sock.more():
            msg.append(bytes(sock.recv_next()))
        out.append(msg)


@pytest.fixture
def sock():
    s = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=4, rejected=collections.Counter())
    yield s
    s.close()


def sender(sock: ucx.UcxDataSocket, hwm: int = 100) -> ucx.UcxDataSender:
    out = ucx.UcxDataSender([ucx.endpoint("127.0.0.1", sock.port)], hwm)
    _SENDERS.append(out)
    return out


def live(sock: ucx.UcxDataSocket) -> int:
    return sum(not c.dead for c in sock.conns)


def stranger(sock: ucx.UcxDataSocket) -> ucx.UcxDataSender:
    """A sender that, unlike a trainer, does not connect again once its connection is closed."""
    out = sender(sock)
    out.reconnect = False
    return out


def raw(out: ucx.UcxDataSender, data: bytes):
    """Bytes on the connection as they are, bypassing the framing (what a stranger may send)."""
    ch = out.chans[0]
    assert ch is not None and ch.ep is not None
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    return buf, ch.ep.stream_send(_array(buf))


def test_messages_arrive_whole_in_order_and_zero_copy_from_the_sender(sock):
    out = sender(sock)
    big = np.arange(200_000, dtype=np.float32)
    trackers = [out.send(0, [b"h%d" % i, big.data, b"", b"tail"], True) for i in range(3)]
    got: list = []
    pump_until(sock, lambda: got.extend(read_all(sock)) or len(got) == 3, "three messages")
    assert [m[0] for m in got] == [b"h0", b"h1", b"h2"]
    for m in got:
        assert np.array_equal(np.frombuffer(m[1], np.float32), big) and m[2:] == [b"", b"tail"]
    deadline = time.monotonic() + 30
    while not all(t.done for t in trackers) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert all(t.done for t in trackers)
    out.close()


@pytest.mark.parametrize(
    "junk, what",
    [
        (b"GET / HTTP/1.1\r\n\r\n", "not our preamble"),
        (ucx.PREAMBLE.pack(ucx.MAGIC, 9, 10), "more frames than a sender makes"),
        (ucx.PREAMBLE.pack(ucx.MAGIC, 1, (1 << 20) + 1), "a frame over the limit"),
        (ucx.PREAMBLE.pack(ucx.MAGIC, 0, 0), "no frames"),
        (ucx.PREAMBLE.pack(ucx.MAGIC, 2, 10) + struct.pack("<QQ", 4, 5) + bytes(10), "sizes that do not add up"),
        (ucx.PREAMBLE.pack(ucx.MAGIC, 1, 10) + struct.pack("<Q", 10 << 20) + bytes(10), "a size over the limit"),
    ],
)
def test_a_stream_that_is_not_ours_is_closed_and_counted_and_others_go_on(sock, junk, what):
    """On a connection whose probe opened the door (without keys, its shape does)."""
    stranger, honest = sender(sock), sender(sock)
    pump_until(sock, lambda: stranger.poll() or stranger.chans[0].ready, "the stranger's probe answered")
    keep = raw(stranger, junk)
    pump_until(sock, lambda: sock.rejected["ucx_bad_preamble"] == 1, f"a refused stream ({what})")
    honest.send(0, [b"header", b"part"], False)
    got: list = []
    pump_until(sock, lambda: got.extend(read_all(sock)) or got, "the honest sender's message")
    assert got == [[b"header", b"part"]]
    stranger.close()  # first: UCX may still hold the raw bytes until its connection is closed
    honest.close()
    del keep


def test_a_connection_that_outruns_its_queue_is_closed(sock):
    out = sender(sock)
    for i in range(sock.rcvhwm + 1):  # never read: one more than the queue holds
        out.send(0, [b"m%d" % i], False)
    pump_until(sock, lambda: sock.rejected["ucx_overflow"] == 1, "the overflow")
    assert not sock.pending()  # what it queued is dropped with it
    out.close()


def test_a_sender_writes_nothing_before_the_worker_says_ready(sock):
    out = sender(sock)
    out.send(0, [b"early", b"part"], False)  # the worker's end has not run yet
    ch = out.chans[0]
    assert ch is not None and not ch.ready and len(ch.out) == 1 and ch.out[0].ep is None  # held here
    got: list = []
    pump_until(sock, lambda: got.extend(read_all(sock)) or got, "the held message")
    assert got == [[b"early", b"part"]] and ch.ready
    out.close()


def test_a_new_connection_is_tried_both_ways_before_it_carries_data(sock):
    out = sender(sock)
    out.send(0, [b"data"], False)
    ch = out.chans[0]
    assert ch is not None
    got: list = []
    pump_until(sock, lambda: ch.expect == ucx.ACK, "the worker's READY, and the probe sent")
    assert not ch.ready and ch.out[0].ep is None  # still held while the probe is out
    pump_until(sock, lambda: got.extend(read_all(sock)) or got, "the held message")
    assert got == [[b"data"]] and ch.ready  # the probe was answered, never handed on
    assert not sock.rejected
    out.close()


def unacknowledged(monkeypatch) -> None:
    """Workers read messages whole from now on but acknowledge none (until monkeypatch.undo)."""
    from shadow.transport import ucx_socket

    monkeypatch.setattr(ucx_socket.UcxDataSocket, "_acknowledge", lambda self, conn: None)


def test_a_connection_lost_while_its_worker_lives_is_made_again_and_loses_nothing(monkeypatch):
    sock = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=16, rejected=collections.Counter())
    try:
        _lost_and_made_again(sock, monkeypatch)
    finally:
        sock.close()


def _lost_and_made_again(sock: ucx.UcxDataSocket, monkeypatch) -> None:
    out = sender(sock)
    payload = np.arange(1000, dtype=np.float32)
    unacknowledged(monkeypatch)
    trackers = [out.send(0, [b"m%d" % i, payload.data], True) for i in range(3)]
    pump_until(sock, lambda: sum(len(c.queue) for c in sock.conns) == 3, "three messages whole at the worker")
    ch = out.chans[0]
    assert ch is not None and len(ch.out) == 3 and not any(t.done for t in trackers)  # kept until acknowledged
    monkeypatch.undo()
    assert sever(out, 0)  # the connection closes under the trainer; the worker lives
    trackers.append(out.send(0, [b"m3", payload.data], True))
    got: list = []
    pump_until(
        sock,
        lambda: got.extend(read_all(sock)) or (len(got) == 7 and all(t.done for t in trackers)),
        "the old connection's messages, the three sent again and a new one, all acknowledged",
    )
    # what the old connection brought is read first, then what was sent again (the worker's
    # receiver drops the second copies by sequence number), then the rest
    assert [m[0] for m in got] == [b"m0", b"m1", b"m2", b"m0", b"m1", b"m2", b"m3"]
    assert all(np.array_equal(np.frombuffer(m[1], np.float32), payload) for m in got)
    assert ch.resent == 3 and ch.broken is None and not ch.out and not sock.rejected
    out.close()


def test_a_connection_naming_a_channel_seen_before_takes_its_place_behind_its_queue(sock, monkeypatch):
    """The worker has not seen the old connection fail: the new one's probe, with the same
    token, closes it, and what it queued whole is still read first."""
    first = stranger(sock)  # it would otherwise connect again, with the same token, in turn
    unacknowledged(monkeypatch)
    first.send(0, [b"m0"], False)
    first.send(0, [b"m1"], False)
    pump_until(sock, lambda: sum(len(c.queue) for c in sock.conns) == 2, "two messages whole at the worker")
    monkeypatch.undo()
    second = sender(sock)
    ch1, ch2 = first.chans[0], second.chans[0]
    assert ch1 is not None and ch2 is not None and not ch2.ready  # its probe has not gone yet
    ch2.token = ch1.token
    second.send(0, [b"m2"], False)
    got: list = []
    pump_until(sock, lambda: got.extend(read_all(sock)) or len(got) == 3, "both connections' messages")
    assert [m[0] for m in got] == [b"m0", b"m1", b"m2"]
    pump_until(sock, lambda: ch1.broken is not None, "the old connection closed by the worker")
    assert live(sock) == 1 and not sock.rejected
    first.close()
    second.close()


def test_a_connection_lost_again_and_again_with_nothing_acknowledged_breaks_the_channel(sock, monkeypatch):
    out = sender(sock)
    unacknowledged(monkeypatch)
    out.send(0, [b"never acknowledged"], False)
    ch = out.chans[0]
    assert ch is not None
    for lost in range(ucx.RECONNECTS + 1):
        pump_until(sock, lambda: ch.ready, f"connection {lost + 1} ready")
        assert sever(out, 0)
        out.poll()
    assert ch.broken is not None and "in a row lost with nothing acknowledged" in ch.broken
    assert ch.dropped == 1 and not ch.out
    out.close()


def test_a_probe_that_never_gets_its_ack_makes_the_connection_again(sock, monkeypatch):
    from shadow.transport import ucx_socket

    monkeypatch.setattr(ucx_send, "ACK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ucx_socket, "ACK", b"NOPE")  # a worker whose answers to the probe go wrong
    out = sender(sock)
    out.send(0, [b"data"], False)
    ch = out.chans[0]
    assert ch is not None
    pump_until(sock, lambda: ch.broken is not None, "the channel given up")
    assert f"after {ucx.CONNECT_ATTEMPTS} attempts" in ch.broken and "ACK of its probe" in ch.broken
    assert not read_all(sock) and ch.dropped == 1  # the data message never went out
    out.close()


def test_a_reset_drops_what_was_queued_and_listens_on_a_new_port(sock, monkeypatch):
    monkeypatch.setattr(ucx_send, "READY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ucx_send, "ACK_TIMEOUT_S", 0.5)
    before = sender(sock)
    before.send(0, [b"old", b"part"], False)
    pump_until(sock, sock.pending, "a message queued before the reset")
    old_port, worker = sock.port, sock.worker
    assert sock.reset() != old_port and sock.worker is worker  # the same UCX worker, a new listener
    assert not sock.pending() and not read_all(sock)  # nothing from before is read after it
    stale = ucx.UcxDataSender([ucx.endpoint("127.0.0.1", old_port)], 8)  # a trainer that missed the reset
    _SENDERS.append(stale)
    stale.send(0, [b"stale"], False)
    after = sender(sock)
    after.send(0, [b"new", b"part"], False)
    got: list = []
    ch = stale.chans[0]
    assert ch is not None
    pump_until(
        sock, lambda: got.extend(read_all(sock)) or (got and ch.broken is not None), "new message, stale given up"
    )
    assert got == [[b"new", b"part"]] and f"after {ucx.CONNECT_ATTEMPTS} attempts" in ch.broken
    for out in (before, stale, after):
        out.close()


def test_trainers_connecting_at_once_all_get_through(sock):
    outs = [sender(sock) for _ in range(6)]  # six ranks reaching a fresh worker together
    for i, out in enumerate(outs):
        out.send(0, [b"rank%d" % i, b"part"], False)
    seen: list = []

    def taken() -> bool:
        seen.extend(read_all(sock))
        return len(seen) == len(outs)

    pump_until(sock, taken, "one message from each of six trainers")
    assert sorted(m[0] for m in seen) == [b"rank%d" % i for i in range(6)]
    for out in outs:
        out.close()


def test_connections_that_prove_nothing_cannot_crowd_out_a_trainer():
    """At its cap, the worker closes the oldest connection no checked message has come
    from, never one that has sent one; only when every one has is a new one refused."""
    sock = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=4, rejected=collections.Counter(), max_connections=3)
    try:
        strangers = []
        for i in range(3):  # connections that never send what a key holder sends
            strangers.append(stranger(sock))
            strangers[-1].send(0, [b"stranger%d" % i], False)  # connected and read: never vouched for
            pump_until(sock, lambda i=i: live(sock) == i + 1 and sock.pending(), f"stranger {i} connected")
            assert [m[0] for m in read_all(sock)] == [b"stranger%d" % i]
        trainer = sender(sock)
        trainer.send(0, [b"trainer", b"part"], False)
        pump_until(sock, sock.pending, "the trainer's message, at the cap")
        assert sock.rejected["ucx_evicted"] == 1 and not sock.rejected["ucx_too_many_connections"]
        assert sock.recv_first() == b"trainer" and bytes(sock.recv_next()) == b"part"
        sock.vouch()  # the receiver's checks passed: this connection is proven
        for i, out in enumerate(strangers):
            out.send(0, [b"again%d" % i], False)
        got: list = []
        pump_until(sock, lambda: got.extend(read_all(sock)) or len(got) == 2, "the two strangers still held")
        assert sorted(m[0] for m in got) == [b"again1", b"again2"]  # the oldest one made room
        for i in range(4):  # more strangers than the cap: each takes an unproven one's place
            strangers.append(stranger(sock))
            strangers[-1].send(0, [b"late%d" % i], False)
            got = []  # each in turn, so that none is taken out before its handshake is done
            pump_until(sock, lambda i=i, got=got: got.extend(read_all(sock)) or [b"late%d" % i] in got, f"late {i}")
        assert sock.rejected["ucx_evicted"] == 5
        trainer.send(0, [b"trainer again"], False)
        got: list = []
        pump_until(sock, lambda: got.extend(read_all(sock)) or [b"trainer again"] in got, "the proven trainer")
        assert live(sock) == 3 and not sock.rejected["ucx_too_many_connections"]
        for c in sock.conns:  # every connection proven: a new one is refused
            c.proven = True
        refused = sender(sock)
        refused.send(0, [b"refused"], False)
        pump_until(sock, lambda: sock.rejected["ucx_too_many_connections"] >= 1, "a connection over the cap")
        assert live(sock) == 3
        for out in [*strangers, trainer, refused]:
            out.close()
    finally:
        sock.close()


def test_a_listener_that_never_says_ready_is_given_up_without_blocking_the_sender(monkeypatch):
    monkeypatch.setattr(ucx_send, "READY_TIMEOUT_S", 0.3)
    silent = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=100)  # never progressed: it says nothing
    out = sender(silent, hwm=4)
    payload = np.ones(1024, np.float32)
    t0 = time.monotonic()
    trackers = [out.send(0, [b"h", payload.data], True) for _ in range(12)]  # 3x the high-water mark
    assert all(t.done for t in trackers)  # the four held ones are given up, the rest dropped
    ch = out.chans[0]
    assert ch is not None and ch.broken is not None and f"after {ucx.CONNECT_ATTEMPTS} attempts" in ch.broken
    assert ch.dropped == 12 and not ch.out
    assert time.monotonic() - t0 < 30
    out.close()
    silent.close()


def test_a_listener_that_answers_something_else_gets_nothing(monkeypatch):
    from shadow.transport import ucx_socket

    monkeypatch.setattr(ucx_socket, "READY", b"HTTP")  # not a shadow worker
    other = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=100)
    try:
        out = sender(other)
        out.send(0, [b"gradients"], False)
        ch = out.chans[0]
        assert ch is not None
        pump_until(other, lambda: ch.broken is not None, "the channel given up")
        assert "something other than a shadow worker's READY" in ch.broken and ch.dropped == 1
        other.pump()
        assert not other.pending() and not other.rejected  # not a byte of the message reached it
        out.close()
    finally:
        other.close()


def test_a_vanished_worker_never_blocks_the_sender():
    s = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=100)
    out = sender(s, hwm=2)
    out.send(0, [b"first"], False)
    pump_until(s, lambda: s.pending(), "the first message")
    s.close()  # the worker's end goes away with nothing read
    payload = np.ones(1 << 16, np.float32)
    t0 = time.monotonic()
    trackers = [out.send(0, [b"h", payload.data], True) for _ in range(20)]  # 10x the high-water mark
    deadline = time.monotonic() + 60
    while not all(t.done for t in trackers) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(t.done for t in trackers), "sends to a closed worker still hold their buffers"
    assert time.monotonic() - t0 < 60
    ch = out.chans[0]
    assert ch is not None and ch.broken is not None and ch.dropped > 0
    out.close()


def test_a_worker_back_at_a_new_endpoint_is_reached_after_open(sock):
    gone = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=100)
    out = sender(gone)
    gone.close()
    out.open(0, ucx.endpoint("127.0.0.1", sock.port))  # the coordinator's replica_in / a re-registration
    out.send(0, [b"again"], False)
    got: list = []
    pump_until(sock, lambda: got.extend(read_all(sock)) or got, "a message on the new channel")
    assert got == [[b"again"]]
    out.close()


def test_channels_take_each_worker_over_the_transport_its_endpoint_names(sock):
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ch = Channels(ctx, [f"tcp://127.0.0.1:{port}", ucx.endpoint("127.0.0.1", sock.port)], hwm=10, curve=[False, False])
    _SENDERS.append(ch)
    try:
        ch.send(0, [b"to zmq"], False)
        ch.send(1, [b"to ucx"], False)
        assert pull.poll(30_000) and pull.recv_multipart() == [b"to zmq"]
        got: list = []
        pump_until(sock, lambda: got.extend(read_all(sock)) or got, "the UCX worker's message")
        assert got == [[b"to ucx"]]
        # a worker that comes back over the other transport
        ch.open(1, f"tcp://127.0.0.1:{port}", False)
        ch.send(1, [b"now zmq"], False)
        assert pull.poll(30_000) and pull.recv_multipart() == [b"now zmq"]
        with pytest.raises(ValueError, match="CURVE"):
            ch.open(0, ucx.endpoint("127.0.0.1", sock.port), True)
    finally:
        ch.close()
        pull.close(linger=0)


def test_endpoints_are_parsed_strictly():
    assert ucx.parse("ucx://10.0.0.5:4000") == ("10.0.0.5", 4000)
    for bad in ("tcp://10.0.0.5:4000", "ucx://10.0.0.5", "ucx://:4000", "ucx://h:99999"):
        with pytest.raises(ValueError, match="not a UCX data endpoint"):
            ucx.parse(bad)


def test_settings_name_the_transport_and_refuse_curve_over_ucx(tmp_path):
    with pytest.raises(ValueError, match="transport.data='rdma' is not one of"):
        TransportConfig(data="rdma")
    key = tmp_path / "server.key_secret"
    keyed = SecurityConfig(server_key=str(key), allow_workers=str(tmp_path), data="curve")
    with pytest.raises(ValueError, match="cannot go with security.data=curve"):
        ClusterConfig(transport=TransportConfig(data="ucx"), security=keyed)
    with pytest.raises(ValueError, match="cannot go with security.data=curve"):
        WorkerConfig(transport=TransportConfig(data="ucx"), security=keyed)
    ClusterConfig(transport=TransportConfig(data="ucx"))  # in mac mode, or keyless: fine


def test_a_missing_ucx_names_the_extra_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ucxx(name, *a, **kw):
        if name.startswith("ucxx"):
            raise ImportError("No module named 'ucxx'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ucxx)
    with pytest.raises(Exception, match=r"shadow-checkpoint\[ucx\]"):
        ucx.lib()
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert not ucx.available()


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_from_strangers_never_stop_the_worker_s_channel(sock, seed):
    """Random bytes, and random preambles with random tables after them, on several
    connections at once: each is refused or its messages handed on whole as frames (never
    more frames than the preamble said), and an honest sender beside them gets through."""
    rng = np.random.default_rng(seed)
    strangers, keep = [sender(sock) for _ in range(3)], []
    for out in strangers:
        for _ in range(4):
            if rng.random() < 0.5:
                junk = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
            else:
                n = int(rng.integers(0, 12))
                sizes = [int(x) for x in rng.integers(0, 40, n)]
                total = sum(sizes) + int(rng.integers(-2, 3)) * int(rng.random() < 0.3)
                junk = ucx.PREAMBLE.pack(ucx.MAGIC, n, max(total, 0)) + b"".join(struct.pack("<Q", x) for x in sizes)
                junk += bytes(max(total, 0))
            keep.append(raw(out, junk))
    honest = sender(sock)
    honest.send(0, [b"honest", b"part"], False)
    got: list = []

    def honest_arrived() -> bool:
        got.extend(read_all(sock))
        return [b"honest", b"part"] in got

    pump_until(sock, honest_arrived, "the honest sender's message among strangers")
    assert all(1 <= len(m) <= 11 for m in got)
    for out in [*strangers, honest]:
        out.close()  # first: UCX may still hold the raw bytes until its connection is closed
    del keep


SENDER_SCRIPT = """
import sys, time, numpy as np
from shadow.transport import ucx
out = ucx.UcxDataSender([sys.argv[1]], 100)
big = np.ones(1 << 18, np.float32)
for i in range(1_000_000):
    out.send(0, [b"dying", big.data], False)
    if i == 3:
        print("sent", flush=True)
    time.sleep(0.001)
"""


def test_a_trainer_killed_mid_stream_leaves_the_channel_serving_others():
    import subprocess
    import sys

    sock = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=1_000_000)

    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER_SCRIPT, ucx.endpoint("127.0.0.1", sock.port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
        pump_until(sock, lambda: len(sock.conns) == 1 and sock.pending(), "the dying sender's first messages")
        proc.kill()
        proc.wait(30)

        def gone() -> bool:
            read_all(sock)  # what arrived whole is read; the half message dies with its sender
            return not sock.conns

        pump_until(sock, gone, "the killed sender's connection closed")
        out = sender(sock)
        out.send(0, [b"after"], False)
        got: list = []
        pump_until(sock, lambda: got.extend(read_all(sock)) or got, "a message after the kill")
        assert got == [[b"after"]]
        out.close()
    finally:
        proc.kill()
        sock.close()


def _door(user: bytes, password: bytes) -> str:
    """A worker's check of a connection's door (as DataPath.door): rank 0 with its password."""
    if user != b"rank 0":
        return "user"
    return "" if password == b"p" * 64 else "key"


def test_a_stranger_announcing_a_large_message_is_dropped_before_the_worker_allocates():
    """Issue 53, item 2: a stranger announced a 2 GiB message and sent 1.5 GiB of it, and
    the worker received it into a buffer of that size (334 -> 1,823 MB). A connection's
    first message must be a probe of a probe's size, and nothing else is read before it
    proves the door: this one is dropped at its preamble and the worker allocates nothing
    for it. The stranger lives in this process, so what is measured is what the worker's
    side allocates (numpy's buffers, traced), not the process's RSS, which UCX's send
    buffers for the stranger's 64 MiB also move."""
    import tracemalloc

    sock = ucx.UcxDataSocket(limit=1 << 30, max_frames=8, rcvhwm=4, rejected=collections.Counter(), door=_door)
    try:
        head = ucx.PREAMBLE.pack(ucx.MAGIC, 2, 2 << 30) + struct.pack("<QQ", 1 << 30, 1 << 30)
        bufs = [np.frombuffer(head, np.uint8).copy(), np.ones(64 << 20, np.uint8)]
        out = stranger(sock)
        ch = out.chans[0]
        assert ch is not None and ch.ep is not None
        tracemalloc.start()
        try:
            keep = [ch.ep.stream_send(_array(b)) for b in bufs]
            pump_until(sock, lambda: sock.rejected["ucx_door"] == 1, "the stranger dropped at its first message")
            for _ in range(50):  # whatever else it sent has had time to arrive
                sock.pump()
                sock.wait(0.02)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"the worker allocated up to {peak >> 20} MiB for a stranger"
        assert live(sock) == 0
        out.close()
        del keep
    finally:
        sock.close()


def test_a_connection_proves_its_rank_s_key_in_its_probe_before_anything_is_read():
    """With keys, the probe carries the rank's door credential: the right one passes and
    the messages after it arrive; a wrong key, or none, closes the connection unread."""
    from shadow.security import Door

    sock = ucx.UcxDataSocket(limit=1 << 20, max_frames=8, rcvhwm=4, rejected=collections.Counter(), door=_door)
    try:
        ep = ucx.endpoint("127.0.0.1", sock.port)
        wrong = ucx.UcxDataSender([ep], 100, [Door(b"rank 0", b"q" * 64)])
        none = ucx.UcxDataSender([ep], 100)
        for out in (wrong, none):
            out.reconnect = False
            _SENDERS.append(out)
            out.send(0, [b"not let in"], False)
        pump_until(
            sock,
            lambda: sock.rejected["ucx_door_key"] >= 1 and sock.rejected["ucx_door_user"] >= 1,
            "the wrong key and the missing one refused",
        )
        right = ucx.UcxDataSender([ep], 100, [Door(b"rank 0", b"p" * 64)])
        _SENDERS.append(right)
        right.send(0, [b"header", b"part"], False)
        got: list = []
        pump_until(sock, lambda: got.extend(read_all(sock)) or got, "the rank's message")
        assert got == [[b"header", b"part"]]
        for out in (wrong, none, right):
            out.close()
    finally:
        sock.close()
