"""Doors (issue 53): a socket in clear that admits only peers proving a key at ZeroMQ's
handshake (PLAIN, checked by the guard's ZAP handler), and each worker socket's check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from shadow import security
from shadow.transport.receive import Context
from shadow.wire import tags
from shadow.worker.data import DataPath
from shadow.worker.fetches import FetchServer
from shadow.worker.files import FileServer


@pytest.fixture
def door_pull():
    """A PULL socket behind a door admitting ``rank 0`` with password ``p`` * 64."""
    ctx = zmq.Context()
    guard = security.Guard(None)

    def check(user: bytes, password: bytes) -> str:
        if user == b"boom":
            raise RuntimeError("a check that fails")
        if user != b"rank 0":
            return "user"
        return "" if password == b"p" * 64 else "key"

    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    guard.door(pull, check)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, guard, pull, f"tcp://127.0.0.1:{port}"
    pull.close(linger=0)
    guard.stop()
    ctx.destroy(linger=0)


def _push(ctx: zmq.Context, endpoint: str, door: security.Door | None) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    if door is not None:
        door.apply(s)
    s.connect(endpoint)
    return s


def _wait(guard: security.Guard, reason: str, n: int = 1) -> None:
    import time

    deadline = time.monotonic() + 30
    while guard.refused.get(reason, 0) < n:
        assert time.monotonic() < deadline, f"no {reason} refusal: {guard.refused}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "door, reason",
    [
        (None, "handshake_mechanism"),  # a peer in clear, as any ZeroMQ peer without keys
        (security.Door(b"rank 0", b"q" * 64), "door_key"),
        (security.Door(b"rank 1", b"p" * 64), "door_user"),
        (security.Door(b"boom", b"x"), "door_failed"),
    ],
)
def test_a_peer_that_does_not_prove_the_key_gets_no_message_through(door_pull, door, reason):
    ctx, guard, pull, endpoint = door_pull
    s = _push(ctx, endpoint, door)
    try:
        _wait(guard, reason)
        try:
            s.send(b"never", zmq.NOBLOCK)
        except zmq.Again:  # no connection takes it: it stays with the sender
            pass
        assert not pull.poll(500)
        assert guard.accepted == 0
    finally:
        s.close(linger=0)


def test_the_right_credential_passes_and_its_messages_arrive(door_pull):
    ctx, guard, pull, endpoint = door_pull
    s = _push(ctx, endpoint, security.Door(b"rank 0", b"p" * 64))
    try:
        s.send(b"through the door")
        assert pull.poll(10_000) and pull.recv() == b"through the door"
        assert guard.accepted == 1 and not guard.refused
    finally:
        s.close(linger=0)


def test_a_guard_of_doors_only_makes_no_curve_socket():
    guard = security.Guard(None)
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="no server key"):
            guard.server(s)
    finally:
        s.close(linger=0)
        ctx.destroy(linger=0)


def test_the_data_socket_admits_each_rank_with_its_key_of_the_current_configuration():
    key = tags.new_key()
    ctx = Context(1, 1, 7, 2, 0, 10, frozenset(), tags.for_ranks(key, 2))
    data = DataPath.__new__(DataPath)
    data.state = SimpleNamespace(assignment=None)
    r1 = tags.door(tags.rank_key(key, 1))
    assert data.door(b"rank 1", r1) == "unconfigured"  # no configuration: no rank has a key yet
    data.state.assignment = SimpleNamespace(context=ctx)
    assert data.door(b"rank 1", r1) == ""
    assert data.door(b"rank 0", r1) == "key"  # rank 1's key as rank 0
    assert data.door(b"rank 2", r1) == "user"  # no such rank in a world of 2
    assert data.door(b"rank -1", r1) == "user"
    assert data.door(b"rank 01", r1) == "user"  # one spelling per rank
    assert data.door(b"\xff", r1) == "user"
    other = tags.door(tags.rank_key(tags.new_key(), 1))  # another configuration's
    assert data.door(b"rank 1", other) == "key"


def test_the_serve_socket_admits_the_holder_of_a_ticket_of_its_current_or_retired_configuration():
    current, retired = tags.serve_key(tags.new_key()), tags.serve_key(tags.new_key())
    srv = FetchServer.__new__(FetchServer)
    srv.state = SimpleNamespace(
        assignment=SimpleNamespace(serve_key=current), retired=SimpleNamespace(serve_key=retired)
    )
    ticket = tags.new_ticket()
    for serve in (current, retired):
        assert srv.door(tags.ticket_user(ticket), tags.door(tags.ticket_key(serve, ticket))) == ""
    stranger = tags.serve_key(tags.new_key())
    assert srv.door(tags.ticket_user(ticket), tags.door(tags.ticket_key(stranger, ticket))) == "key"
    assert srv.door(b"rank 0", b"x") == "user"
    assert srv.door(b"zz" * 16, b"x") == "user"  # not hex
    door = security.ticket_door(ticket, tags.ticket_key(current, ticket))
    assert srv.door(door.user, door.password) == ""


def test_the_files_socket_admits_the_holder_of_a_ticket_of_this_worker():
    srv = FileServer.__new__(FileServer)
    srv.key = tags.new_key()
    ticket = tags.new_ticket()
    door = security.ticket_door(ticket, tags.ticket_key(srv.key, ticket))
    assert srv.door(door.user, door.password) == ""
    other = security.ticket_door(ticket, tags.ticket_key(tags.new_key(), ticket))  # the worker's previous process
    assert srv.door(other.user, other.password) == "key"
    srv.key = None  # a worker without keys has no door
    assert srv.door(door.user, door.password) == "user"


def test_a_door_password_reveals_nothing_a_frame_or_fetch_is_checked_with():
    key = tags.new_key()
    pw = tags.door(key)
    assert len(pw) == 64 and key.hex().encode() != pw and key not in bytes.fromhex(pw.decode())


def test_a_door_holds_at_most_its_cap_of_connections_whatever_the_credential():
    """``cap``: a peer with the right credential is refused once the socket holds that many
    connections (``door_crowded``), and admitted again once one has gone."""
    import time

    ctx = zmq.Context()
    guard = security.Guard(None)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    guard.door(pull, lambda user, password: "", cap=lambda: 3)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    right = security.Door(b"rank 0", b"p" * 64)
    pushes: list[zmq.Socket] = []
    try:
        admitted = 0
        for _ in range(6):
            s = _push(ctx, endpoint, right)
            pushes.append(s)
            deadline = time.monotonic() + 30
            while guard.accepted == admitted and not guard.refused.get("door_crowded"):
                assert time.monotonic() < deadline, "the door neither admitted nor refused a peer"
                time.sleep(0.01)
            if guard.refused.get("door_crowded"):
                break
            admitted = guard.accepted
        assert guard.refused.get("door_crowded"), "six connections, none refused"
        assert 3 <= admitted <= 4, admitted  # the one refused may count itself or not yet
        crowded = pushes.pop()
        crowded.close(linger=0)
        while len(pushes) > 2:  # admitted ones go until there is room for a newcomer
            pushes.pop(0).close(linger=0)
        deadline = time.monotonic() + 30
        while guard.connections(pull.zap_domain) > 2:
            assert time.monotonic() < deadline, "the closed connections were never counted out"
            time.sleep(0.01)
        s = _push(ctx, endpoint, right)
        pushes.append(s)
        s.send(b"room again")
        assert pull.poll(10_000) and pull.recv() == b"room again"
    finally:
        for s in pushes:
            s.close(linger=0)
        pull.close(linger=0)
        guard.stop()
        ctx.destroy(linger=0)


def test_a_peer_arriving_before_the_worker_is_configured_waits_at_the_door_and_gets_in():
    """A trainer may reach a replacement's data socket before its configuration does: the
    handshake is held (``security.TEMPORARY``) instead of refused, which would make the
    peer's ZeroMQ give up on the connection for good, and admitted once the check passes."""
    import time

    ctx = zmq.Context()
    guard = security.Guard(None)
    ready = {"configured": False}
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    guard.door(pull, lambda user, password: "" if ready["configured"] else "unconfigured")
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    s = _push(ctx, endpoint, security.Door(b"rank 0", b"p" * 64))
    try:
        time.sleep(0.5)
        assert guard.accepted == 0 and not guard.refused  # held, neither admitted nor refused
        ready["configured"] = True
        s.send(b"configured now")
        assert pull.poll(10_000) and pull.recv() == b"configured now"
        assert guard.accepted == 1 and not guard.refused
    finally:
        s.close(linger=0)
        pull.close(linger=0)
        guard.stop()
        ctx.destroy(linger=0)


def test_a_door_built_without_a_guard_is_checked_by_the_guard_already_on_its_context(tmp_path):
    """A context has one ZAP handler: a part built without a guard on a context whose CURVE
    guard is running (a benchmark holding a keyed and a mac server side by side) puts its
    door on that guard, and a socket whose setup fails is closed (the context still ends)."""
    from shadow.transport import SocketFactory

    security.generate(tmp_path, "server")
    ctx = zmq.Context()
    guard = security.Guard(tmp_path / "server.key_secret", {})
    guard.start(ctx)
    assert security.doorkeeper(ctx) is guard

    def check(user: bytes, password: bytes) -> str:
        return "" if (user, password) == (b"rank 0", b"p" * 64) else "key"

    pull = SocketFactory(ctx).pull(1 << 20, 10, curve=False, door=check)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    s = _push(ctx, f"tcp://127.0.0.1:{port}", security.Door(b"rank 0", b"p" * 64))
    try:
        s.send(b"through")
        assert pull.poll(10_000) and pull.recv() == b"through"
        assert guard.accepted == 1
    finally:
        s.close(linger=0)
        pull.close(linger=0)
    guard.stop()
    ctx.destroy(linger=0)

    ctx = zmq.Context()  # a ZAP handler that is not a guard: the door cannot be checked
    zap = ctx.socket(zmq.ROUTER)
    zap.bind(security.ZAP_ENDPOINT)
    with pytest.raises(RuntimeError, match="one Guard per zmq.Context"):
        SocketFactory(ctx).pull(1 << 20, 10, curve=False, door=check)
    zap.close(linger=0)
    ctx.term()  # returns: the failed socket was closed
