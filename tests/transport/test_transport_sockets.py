"""The socket factory (shadow/transport): every socket's options come from one place."""

from __future__ import annotations

import re
import time

import pytest
import zmq

from shadow import security as S
from shadow.config.tuning import DEFAULT
from shadow.transport import SocketFactory, data_limit, fetch_limit
from tests.conftest import ROOT


def test_each_socket_gets_linger_limits_and_water_marks():
    ctx = zmq.Context()
    f = SocketFactory(ctx, keys=None)
    made = [f.router(1 << 20), f.pull(data_limit(), 7), f.dealer(None, fetch_limit()), f.push(None, 5)]
    try:
        router, pull, dealer, push = made
        assert all(s.getsockopt(zmq.LINGER) == 0 for s in made)
        assert router.getsockopt(zmq.MAXMSGSIZE) == 1 << 20 and pull.getsockopt(zmq.MAXMSGSIZE) == data_limit()
        assert dealer.getsockopt(zmq.MAXMSGSIZE) == fetch_limit() >= DEFAULT.fetch_chunk_bytes
        assert push.getsockopt(zmq.MAXMSGSIZE) == -1  # it only sends
        assert pull.getsockopt(zmq.RCVHWM) == 7 and push.getsockopt(zmq.SNDHWM) == 5
        assert not any(s.getsockopt(zmq.CURVE_SERVER) for s in made)
    finally:
        for s in made:
            s.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("client", ["curve", "plain"])
def test_curve_on_both_sides_comes_from_the_factory(tmp_path, client):
    S.generate(tmp_path, "server")
    S.generate(tmp_path / "allow", "trainer")
    ctx = zmq.Context()
    guard = S.Guard(tmp_path / "server.key_secret", {"trainer": tmp_path / "allow"})
    server = SocketFactory(ctx, guard=guard).router(1 << 16)
    keys = S.client_keys(tmp_path / "server.key", tmp_path / "allow" / "trainer.key_secret")
    try:
        assert server.getsockopt(zmq.CURVE_SERVER) == 1
        port = server.bind_to_random_port("tcp://127.0.0.1")
        dealer = SocketFactory(ctx, keys=keys if client == "curve" else None).dealer(f"tcp://127.0.0.1:{port}", 1 << 16)
        dealer.send(b"ping")
        got = server.poll(3000 if client == "curve" else 1000)
        assert bool(got) == (client == "curve")  # a plain client never gets through the CURVE server
        if got:
            assert server.recv_multipart()[1] == b"ping"
        dealer.close(linger=0)
    finally:
        server.close(linger=0)
        guard.stop()
        ctx.term()


def test_no_other_module_sets_socket_options():
    """LINGER, MAXMSGSIZE and the high-water marks are set in shadow/transport only (the
    CURVE handshake's own ZAP socket in shadow/security aside)."""
    pattern = re.compile(r"setsockopt\(zmq\.(LINGER|MAXMSGSIZE|RCVHWM|SNDHWM|ROUTER_MANDATORY)")
    found = []
    for root in ("shadow", "trainer_hooks"):
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("shadow/transport/"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and not (rel.startswith("shadow/security/") and "zap" in line):
                    found.append(f"{rel}:{n}")
    assert not found, found


def test_send_if_connected_tells_a_live_peer_from_a_gone_one():
    """How the coordinator tells a live worker from a dead one before another process takes
    its slot: a send to a connected identity goes through, to a closed one it is refused."""
    from shadow.transport.sockets import send_if_connected

    ctx = zmq.Context()
    router = SocketFactory(ctx, keys=None).router(1 << 16)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = SocketFactory(ctx, keys=None).dealer(f"tcp://127.0.0.1:{port}", 1 << 16)
    try:
        dealer.send(b"hello")
        assert router.poll(2000)
        ident = router.recv_multipart()[0]
        assert send_if_connected(router, [ident, b"are you there"])
        assert dealer.poll(2000) and dealer.recv() == b"are you there"
        assert not send_if_connected(router, [b"nobody", b"x"])
        dealer.close(linger=0)
        deadline = time.monotonic() + 5
        while send_if_connected(router, [ident, b"x"]):
            assert time.monotonic() < deadline, "the closed connection still counts as connected"
            time.sleep(0.02)
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
