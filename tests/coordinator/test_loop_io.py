"""The coordinator's loop stays answering while a tier is slow: the tier I/O of a catalog
and of a commit runs on its storage lane; a step of the loop that does take long is logged
by name (and its stack while it runs); a read-only query asks again on a new connection."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from shadow.config import PersistConfig
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.server import Coordinator
from shadow.coordinator.watch import LoopWatch
from shadow.testing import free_port
from shadow.transport import client
from shadow.wire import messages as M
from shadow.wire.commit import UploadCopies
from tests.persist.test_persist_schedule import JOB, TIER, _report

SLOW_S = 3.0  # what the slow tier takes per call; every bound below is a fraction of it


@pytest.fixture
def keyless(monkeypatch):
    """Clients without keys (the coordinators here have no guard)."""
    monkeypatch.setenv("SHADOW_INSECURE", "1")


def _slow(monkeypatch, obj, name: str) -> list[float]:
    """``obj.name`` made to take SLOW_S longer the first time it is called; when it was called."""
    real, calls = getattr(obj, name), []

    def slow(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(SLOW_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, slow)
    return calls


def _send(address: str, kind: str, **fields) -> zmq.Socket:
    sock = client.dealer(zmq.Context.instance(), address)
    sock.send(M.encode(kind, **fields))
    return sock


def _recv(sock: zmq.Socket, timeout: float) -> dict | None:
    try:
        return M.decode(sock.recv()) if sock.poll(int(timeout * 1000)) else None
    finally:
        sock.close(linger=0)


def test_status_is_answered_while_a_slow_tier_is_listed_for_a_catalog(tmp_path, monkeypatch, keyless):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    coord = Coordinator(
        address, workers=1, persist=PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=str(tmp_path))})
    )
    listed = _slow(monkeypatch, coord.persist.tiers["local"].storage, "list")
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    try:
        client.ask(address, M.encode("status"), 10.0, ("status_reply",))  # up
        asked = _send(address, "catalog", tier="local", job="j")
        while not listed:  # the catalog is being listed, on the slow tier
            time.sleep(0.01)
        t0 = time.monotonic()
        client.ask(address, M.encode("status"), SLOW_S, ("status_reply",))
        info = client.ask(address, M.encode("restore_info", job="j"), SLOW_S, ("restore_info_reply",))
        waited = time.monotonic() - t0
        assert waited < SLOW_S / 2, f"status and restore_info waited {waited:.1f} s behind a slow tier listing"
        assert info["info"]["storage"][0]["tier"] == "local"
        reply = _recv(asked, 4 * SLOW_S)  # the catalog itself comes once the tier is listed
        assert reply is not None and reply["t"] == "catalog_reply" and reply["checkpoints"] == []
    finally:
        coord.stop()
        thread.join(timeout=10)
    assert not thread.is_alive()


def _two_tiers(tmp_path) -> tuple[str, Persistence]:
    """A local tier (every iteration) and a remote one copied from it (every iteration)."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    tiers = {"local": dict(TIER, every_n=1, dir=local), "remote": dict(TIER, every_n=1, url=remote)}
    return local, Persistence(PersistConfig.from_dict(tiers))


def test_a_commit_on_a_slow_tier_runs_on_the_lane_and_its_follow_ups_are_sent_after(tmp_path, monkeypatch):
    local, pers = _two_tiers(tmp_path)
    sent: list = []
    pers.emit = lambda job, follows: sent.extend(follows)
    pers.reset(0)
    written = _slow(monkeypatch, pers.tiers["local"].storage, "write_atomic")
    pers.lane.start()
    try:
        assert pers.local_due(1, None)
        t0 = time.monotonic()
        follow = pers.on_report(JOB, _report(local, "local", 1, 0), 2) + pers.on_report(
            JOB, _report(local, "local", 1, 1), 2
        )
        assert time.monotonic() - t0 < SLOW_S / 2  # the manifest is written on the lane, not here
        assert follow == [] and pers.tiers["local"].complete == {}
        pers.lane.flush()  # (as an attach does before it reads the tiers)
        assert written and pers.tiers["local"].complete == {"j": 1}
        assert [type(f) for f in sent] == [UploadCopies] and sent[0].iteration == 1  # sent once recorded
    finally:
        pers.lane.stop()


def test_without_a_started_lane_a_commit_returns_its_follow_ups_as_before(tmp_path):
    local, pers = _two_tiers(tmp_path)
    pers.reset(0)
    assert pers.local_due(1, None)
    pers.on_report(JOB, _report(local, "local", 1, 0), 2)
    follow = pers.on_report(JOB, _report(local, "local", 1, 1), 2)
    assert [type(f) for f in follow] == [UploadCopies] and pers.tiers["local"].complete == {"j": 1}


def test_a_slow_loop_step_is_logged_by_name_and_a_stalled_one_with_its_stack(caplog):
    watch = LoopWatch(slow_s=0.05, stall_s=0.3)
    caplog.set_level(logging.WARNING, logger="shadow.coordinator.watch")
    watch.start()
    try:
        watch.begin("a catalog message")
        time.sleep(0.01)
        watch.end()
        assert watch.slow == 0 and "coordinator loop" not in caplog.text
        watch.begin("a persisted message")
        time.sleep(0.8)  # past stall_s: the watch thread logs where the loop thread is
        assert watch.view()["running"][0] == "a persisted message"
        watch.end()
    finally:
        watch.stop()
    assert watch.slow == 1 and watch.view()["longest"] == "a persisted message"
    assert "a persisted message has run for" in caplog.text and "test_loop_io.py" in caplog.text  # the stack
    assert "a persisted message took 0.8 s" in caplog.text


def test_a_query_unanswered_on_one_connection_is_asked_again_on_another(keyless):
    """A reply lost (or a handshake stalled) on one connection costs a third of the wait."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    seen: list[bytes] = []
    stop = threading.Event()

    def serve():  # ignores the first request, answers the next; polls, so that ``stop`` ends it
        while len(seen) < 2 and not stop.is_set():
            if server.poll(50):
                ident, body = server.recv_multipart()
                seen.append(ident)
                if len(seen) == 2:
                    server.send_multipart([ident, M.encode("status_reply", status={"ok": True})])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        reply = client.ask(f"tcp://127.0.0.1:{port}", M.encode("status"), SLOW_S, ("status_reply",))
        took = time.monotonic() - t0
    finally:
        # the socket is closed only once its thread has let go of it (closing it under a blocked
        # poll or recv can hang the context's term)
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the server's thread did not stop"
        server.close(linger=0)
    assert reply["status"] == {"ok": True} and len(set(seen)) == 2  # two connections
    assert SLOW_S / client.ASK_TRIES * 0.9 <= took < SLOW_S
