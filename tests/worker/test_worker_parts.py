"""The worker's parts one by one, in this process and without services: the control routes,
:class:`Apply` against a recording outbox, :class:`FetchServer`'s caps, :class:`PeerCopy`'s
failures and :class:`DataPath`'s policy around the receiver (``shadow/worker/``)."""

from __future__ import annotations

import contextlib
import itertools
import time

import numpy as np
import pytest
import zmq

from shadow.core.layout import Layout
from shadow.transport import FrameReceiver, SocketFactory
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.worker.address import Binding
from shadow.worker.apply import Apply
from shadow.worker.assignment import Assignment
from shadow.worker.data import DataPath
from shadow.worker.fetches import FetchServer, Reply
from shadow.worker.outbox import RecordingOutbox
from shadow.worker.peer import PeerCopy
from shadow.worker.server import ROUTES, Worker
from shadow.worker.state import WorkerState

LAYOUT = Layout.build([("w", (8,), 0, True), ("b", (4,), 0, True)], 1)
OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 16, "tail_width": 8}
BASE = 5
LOCAL = Binding("127.0.0.1", "127.0.0.1")
_ids = itertools.count()


@contextlib.contextmanager
def tuned(state: WorkerState, **changes):
    """The worker's knobs changed for a block (its parts read them from the state)."""
    saved = state.tuning
    state.tuning = saved.replace(**changes)
    try:
        yield
    finally:
        state.tuning = saved


def configure(epoch: int = 2, **kw) -> dict:
    msg = {
        "epoch": epoch,
        "job": "j",
        "job_id": 7,
        "layout": LAYOUT.to_dict(),
        "start": 0,
        "stop": LAYOUT.total,
        "world": 1,
        "optim": OPTIM,
        "iteration": BASE,
        "persist": {},
        "shard": 0,
        "shards": 1,
        "peer": None,
    }
    msg.update(kw)
    return msg


def ctrl(kind: str, **fields) -> dict:
    """A control message as the worker gets it: encoded and decoded, checked against its schema."""
    return M.decode(M.encode(kind, **fields))


def worker() -> tuple[Worker, RecordingOutbox]:
    """A worker that opened nothing, its messages to the coordinator recorded."""
    w = Worker("tcp://127.0.0.1:1")
    out = RecordingOutbox()
    w.outbox.to_coord = out.to_coord  # every part holds this one outbox
    return w, out


def bootstrapped(s: Assignment) -> None:
    """Put a complete STATE iteration (the base) in ``s``'s inbox, as a bootstrap would."""
    slot = s.inbox.slot(s.base, F.Kind.STATE)
    n = len(LAYOUT.params)
    slot.commits[0] = {"sent": 0, "steps": [3.0] * n, "has_state": [True] * n}
    slot.field_elems = {int(f): s.state.size for f in s.state.fields()}


def skipped_step(s: Assignment, iteration: int) -> None:
    """A complete GRAD iteration whose step was skipped (no kernel runs, nothing to receive)."""
    slot = s.inbox.slot(iteration, F.Kind.GRAD)
    slot.commits[0] = {"sent": 0, "skipped": list(range(len(LAYOUT.params))), "skip_step": True}


# -- the routes ------------------------------------------------------------------------------
def test_the_routes_cover_exactly_the_coordinators_messages_to_a_worker():
    assert set(ROUTES) == {"registered", "reset", "reregister", "configure", "apply", "upload", "forget", "error"}
    assert all(kind in M.SCHEMAS for kind in ROUTES)


def test_a_message_with_no_route_is_counted_and_changes_nothing():
    w, out = worker()
    w.dispatch(ctrl("alive", epoch=1))
    w.dispatch(ctrl("status"))
    assert w.state.rejected == {"ctrl_unexpected": 2} and out.sent == []
    assert w.state.assignment is None and not w.state.stopping


def test_registered_configure_apply_and_shutdown_through_the_routes():
    w, out = worker()
    w.dispatch(ctrl("registered", worker_id=4, awaiting_copy=True))
    assert w.state.worker_id == 4 and w.state.awaiting_copy
    w.dispatch(ctrl("configure", **configure()))
    s = w.state.assignment
    assert s is not None and s.epoch == 2 and s.base == BASE and w.state.configures == 1
    assert out.kinds() == ["configured"] and out.last("configured") == {"epoch": 2}
    assert not w.state.awaiting_copy  # configured without a peer: the frames may flow
    bootstrapped(s)
    w.dispatch(ctrl("apply", epoch=2, iteration=BASE, persist=False))
    assert s.applied == BASE and out.kinds() == ["configured"]
    w.dispatch(ctrl("upload", epoch=2, iteration=BASE, bytes=1, checksum="x"))  # no persister: ignored
    w.dispatch(ctrl("error", code="busy", message="another process asked for this slot"))
    assert not w.state.stopping and w.state.rejected == {"coordinator_busy": 1}


def test_a_configure_that_cannot_be_carried_out_reports_stale_and_keeps_the_old_epoch():
    w, out = worker()
    w.dispatch(ctrl("configure", **configure()))
    old = w.state.assignment
    w.dispatch(ctrl("configure", **configure(epoch=3, stop=LAYOUT.total + 1)))
    assert w.state.assignment is old and w.state.configures == 1
    assert out.kinds() == ["configured", "stale"]
    assert out.last("stale")["epoch"] == 3 and "configure failed: range [0, 13)" in out.last("stale")["reason"]


def test_a_new_epoch_retires_an_applied_one_until_its_base_is_applied():
    w, out = worker()
    w.dispatch(ctrl("configure", **configure()))
    first = w.state.assignment
    bootstrapped(first)
    w.dispatch(ctrl("apply", epoch=2, iteration=BASE, persist=False))
    w.dispatch(ctrl("configure", **configure(epoch=3)))
    assert w.state.retired is first and w.state.assignment is not first
    bootstrapped(w.state.assignment)
    w.dispatch(ctrl("apply", epoch=3, iteration=BASE, persist=False))
    assert w.state.retired is None and w.state.configures == 2


def test_reset_drops_the_assignment_and_registers_with_a_fresh_data_socket():
    w, out = worker()
    try:
        first = w.data.open()
        w.fetches.open()
        w.dispatch(ctrl("configure", **configure()))
        w.fetches.pending.append((b"client", {"epoch": 2, "iteration": 9}, time.monotonic() + 60))
        rx = w.data.rx
        w.dispatch(ctrl("reset", reason="damaged"))
        assert w.state.assignment is None and w.fetches.pending == []
        assert out.kinds() == ["configured", "register"]
        reg = out.last("register")
        assert reg["data"] == w.data.endpoint != first and reg["serve"] == w.fetches.endpoint
        assert w.data.rx is rx and rx.src.sock is w.data.sock  # the counters outlive the socket
    finally:
        w._close()


# -- Apply -----------------------------------------------------------------------------------
def apply_part() -> tuple[Apply, WorkerState, RecordingOutbox]:
    state, out = WorkerState(worker_id=1), RecordingOutbox()
    state.assignment = Assignment(configure())
    return Apply(state, out, FetchServer(state, SocketFactory(), LOCAL)), state, out


def test_apply_of_an_iteration_not_prepared_here_makes_the_assignment_stale_once():
    apply, state, out = apply_part()
    apply.through(1, BASE)  # another epoch's cut: not this assignment's
    assert out.sent == []
    apply.through(2, BASE)
    assert out.kinds() == ["stale"]
    assert out.last("stale") == {"epoch": 2, "reason": f"asked to apply iteration {BASE} that is not prepared here"}
    assert state.assignment.stale and state.assignment.applied == -1
    apply.through(2, BASE)
    assert out.kinds() == ["stale"]  # said once; the coordinator resyncs


def test_apply_installs_the_base_then_replays_up_to_the_cut():
    apply, state, out = apply_part()
    s = state.assignment
    bootstrapped(s)
    skipped_step(s, BASE + 1)
    apply.through(2, BASE + 1, persist=True)  # no local tier here: nothing to snapshot
    assert s.applied == BASE + 1 and s.inbox.slots == {} and out.sent == []
    assert list(s.state.steps) == [3.0] * len(LAYOUT.params) and state.replayed == 1
    apply.through(2, BASE + 2)
    assert out.last("stale")["reason"] == f"asked to apply iteration {BASE + 2} that is not prepared here"


# -- FetchServer ------------------------------------------------------------------------------
class Tracker:
    done = False


def test_a_client_has_one_fetch_at_a_time_and_a_worker_at_most_its_cap():
    srv = FetchServer(WorkerState(), SocketFactory(), LOCAL)
    assert srv.refuse(b"a") is None
    srv.pending.append((b"a", {"epoch": 1, "iteration": 3}, time.monotonic() + 60))
    reason, text = srv.refuse(b"a")
    assert reason == "serve_busy" and "its previous fetch is still waiting" in text
    srv.replies[b"b"] = Reply("b", None, [Tracker()], time.monotonic())
    reason, text = srv.refuse(b"b")
    assert reason == "serve_busy" and "still being sent" in text
    srv.replies[b"b"].dropped = True
    assert "dropped unread" in srv.refuse(b"b")[1]
    with tuned(srv.state, serve_max_fetches=3):
        # one waiting, one dropped unread that zmq still holds (row 5, issue 38: it counts)
        assert srv.refuse(b"c") is None
        srv.replies[b"d"] = Reply("d", None, [Tracker()], time.monotonic())
        reason, text = srv.refuse(b"c")
    assert reason == "serve_full" and "serving 3 fetches" in text and "SERVE_MAX_FETCHES" in text
    srv.replies.clear()  # zmq let go of them (their clients left): room again
    with tuned(srv.state, serve_max_fetches=3):
        assert srv.refuse(b"c") is None


@pytest.fixture
def served():
    """A FetchServer on an inproc ROUTER, a client DEALER, and the worker's state."""
    ctx = zmq.Context.instance()
    state = WorkerState()
    srv = FetchServer(state, SocketFactory(ctx), LOCAL)
    srv.sock = ctx.socket(zmq.ROUTER)
    ep = f"inproc://serve-{next(_ids)}"
    srv.sock.bind(ep)
    client = ctx.socket(zmq.DEALER)
    client.connect(ep)
    yield srv, state, client
    client.close(linger=0)
    srv.close()


def exchange(srv: FetchServer, client, raw: bytes) -> list[bytes]:
    client.send(raw)
    assert srv.sock.poll(2000)
    srv.on_message(srv.sock)
    return client.recv_multipart() if client.poll(50) else []


def test_the_serve_socket_refuses_with_a_code_and_counts(served):
    srv, state, client = served
    err = M.decode(exchange(srv, client, M.encode("status"))[0])
    assert err["t"] == "error" and err["code"] == "malformed" and state.rejected["serve_unexpected"] == 1
    err = M.decode(exchange(srv, client, M.encode("fetch", epoch=2, iteration=BASE))[0])
    assert err["code"] == "wrong_epoch" and "not 2" in err["message"]  # nothing configured
    with tuned(state, serve_max_fetches=1):
        srv.pending.append((b"other", {"epoch": 2, "iteration": BASE}, time.monotonic() + 60))
        err = M.decode(exchange(srv, client, M.encode("fetch", epoch=2, iteration=BASE))[0])
    assert err["code"] == "busy" and state.rejected["serve_full"] == 1


def test_a_fetch_waits_for_its_iteration_then_gets_the_shard(served):
    srv, state, client = served
    state.assignment = s = Assignment(configure())
    assert exchange(srv, client, M.encode("fetch", epoch=2, iteration=BASE)) == []
    assert len(srv.pending) == 1
    bootstrapped(s)
    Apply(state, RecordingOutbox(), srv).through(2, BASE)  # answers the waiting fetch
    assert client.poll(2000)
    head = M.decode(client.recv())  # each part a message of its own
    assert not client.getsockopt(zmq.RCVMORE)
    assert head["t"] == "fetch_reply" and head["iteration"] == BASE and srv.pending == []
    for _ in head["sums"]:
        assert client.poll(2000) and len(client.recv()) <= head["chunk"]
    assert not client.poll(50)  # nothing follows


def test_a_fetch_not_answered_in_time_gets_a_timeout(served):
    srv, state, client = served
    state.assignment = Assignment(configure())
    exchange(srv, client, M.encode("fetch", epoch=2, iteration=BASE + 3))
    srv.expire(time.monotonic() + state.tuning.fetch_timeout_s + 1)
    assert client.poll(2000)
    err = M.decode(client.recv_multipart()[0])
    assert err["code"] == "timeout" and srv.pending == []


# -- PeerCopy ---------------------------------------------------------------------------------
def test_a_peer_copy_that_is_late_or_malformed_makes_the_assignment_stale():
    ctx = zmq.Context.instance()
    state, out = WorkerState(worker_id=2), RecordingOutbox()
    state.assignment = Assignment(configure())
    peer = PeerCopy(state, out, SocketFactory(ctx, keys=None))
    ep = f"inproc://peer-{next(_ids)}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(ep)
    try:
        peer.start({"id": 3, "serve": ep})
        assert router.poll(2000)
        ident, raw = router.recv_multipart()
        assert M.decode(raw) == {"t": "fetch", "v": M.VERSION, "epoch": 2, "iteration": BASE}
        peer.check_deadline(time.monotonic())
        assert peer.sock is not None and out.sent == []  # not late yet
        router.send_multipart([ident, M.encode("error", code="busy", message="busy")])
        assert peer.sock.poll(2000)
        peer.on_reply()
        assert peer.sock is None and out.kinds() == ["stale"]
        assert out.last("stale")["reason"].startswith("copy from peer worker 3 failed")

        state.assignment = Assignment(configure(epoch=3))
        peer.start({"id": 3, "serve": ep})
        peer.check_deadline(time.monotonic() + state.tuning.fetch_timeout_s + 1)
        assert peer.sock is None
        assert out.last("stale")["reason"].startswith(f"peer worker 3 sent nothing of iteration {BASE} for")
    finally:
        peer.cancel()
        router.close(linger=0)


# -- DataPath ---------------------------------------------------------------------------------
def data_path() -> tuple[WorkerState, RecordingOutbox, DataPath, zmq.Socket]:
    """A worker's data path on an inproc PULL socket, and a PUSH socket connected to it."""
    ctx = zmq.Context.instance()
    state, out = WorkerState(), RecordingOutbox()
    data = DataPath(state, out, SocketFactory(ctx), LOCAL)
    ep = f"inproc://data-{next(_ids)}"
    data.sock = ctx.socket(zmq.PULL)
    data.sock.bind(ep)
    data.rx = FrameReceiver(data.sock)
    push = ctx.socket(zmq.PUSH)
    push.connect(ep)
    return state, out, data, push


def test_the_data_path_refuses_before_configure_and_goes_stale_on_a_gap():
    state, out, data, push = data_path()

    def send(seq: int, values: np.ndarray) -> None:
        s = Assignment(configure())  # for the header's identity only
        runs = ((0, len(values), F.checksum(values)),)
        head = F.Header(F.Kind.STATE, F.Field.PARAM, 7, 2, 0, 1, s.layout_hash, BASE, seq, runs).pack()
        push.send_multipart([head, values.tobytes()])
        assert data.sock.poll(2000)
        data.on_message(data.sock)

    try:
        values = np.arange(LAYOUT.total, dtype=np.float32)
        send(0, values)
        assert state.rejected == {"not_configured": 1} and out.sent == [] and data.frames_in == 1
        state.assignment = Assignment(configure())
        send(0, values)
        assert np.array_equal(state.assignment.state.param, values) and data.bytes_in == values.nbytes
        send(2, values)  # sequence 1 never came
        assert state.rejected["gap"] == 1 and out.kinds() == ["stale"] and state.assignment.stale
        send(3, values)
        assert state.rejected["stale"] == 1 and out.kinds() == ["stale"]
    finally:
        push.close(linger=0)
        data.close()


def test_a_keyed_data_path_drops_what_the_ranks_keys_did_not_tag_and_stays_in_step():
    """A keyed worker (security.data=mac): a copy with a flipped bit that arrives before the
    real message, a replay, a frame under an earlier configuration's key, one under another
    rank's key and one with a plain checksum are each dropped and counted; none of them
    consumes a sequence number or lands a byte, and the real messages are all taken."""
    key, old_key = tags.new_key(), tags.new_key()
    state, out, data, push = data_path()
    state.assignment = s = Assignment(configure(world=2, data_key=key))
    half = LAYOUT.total // 2

    def frames(rank: int, seq: int, values: np.ndarray, tagger=None, flip: bool = False) -> list[bytes]:
        tagger = tagger or tags.DataKey(tags.rank_key(key, rank))
        nonce = tagger.nonce()
        runs = ((rank * half, len(values), tagger.tag(nonce, 1, values)),)
        head = F.Header(F.Kind.STATE, F.Field.PARAM, 7, 2, rank, 2, s.layout_hash, BASE, seq, runs, nonce).pack(tagger)
        payload = bytearray(values.tobytes())
        payload[5] ^= 0x10 if flip else 0
        return [head, bytes(payload)]

    def deliver(msg: list[bytes]) -> None:
        push.send_multipart(msg)
        assert data.sock.poll(2000)
        data.on_message(data.sock)

    try:
        mine = np.arange(half, dtype=np.float32) + 1
        good = frames(1, 0, mine)
        deliver(frames(1, 0, mine, flip=True))  # raced ahead of the real one
        deliver(frames(1, 0, mine, tagger=tags.DataKey(tags.rank_key(old_key, 1))))  # an earlier configuration's key
        deliver(frames(1, 0, mine, tagger=tags.DataKey(tags.rank_key(key, 0))))  # rank 0 posing as rank 1
        deliver(frames(1, 0, mine, tagger=tags.PLAIN))  # no key at all
        assert state.rejected == {"bad_mac": 4} and not s.stale and s.inbox.next_seq == [0, 0]
        assert not s.state.param.any()  # nothing landed
        deliver(good)
        deliver(good)  # replayed
        assert state.rejected == {"bad_mac": 4, "duplicate": 1} and s.inbox.next_seq == [0, 1]
        deliver(frames(0, 0, -mine))
        assert np.array_equal(s.state.param, np.concatenate([-mine, mine])) and not s.stale
        assert out.kinds() == []  # nothing went stale
    finally:
        push.close(linger=0)
        data.close()


def test_a_workers_slot_token_is_kept_privately_for_its_restart(tmp_path, monkeypatch):
    """The token a worker's first ``registered`` gave is kept 0600 in this user's private
    state directory, per coordinator and slot, for its restarted process; a link planted in
    its place is not read."""
    import os
    import stat as stat_mod

    from shadow.worker import slot

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    token = bytes(range(16))
    assert slot.load("tcp://127.0.0.1:5555", 0) is None
    slot.save("tcp://127.0.0.1:5555", 0, token)
    assert slot.load("tcp://127.0.0.1:5555", 0) == token
    assert slot.load("tcp://127.0.0.1:5556", 0) is None and slot.load("tcp://127.0.0.1:5555", 1) is None
    (path,) = (tmp_path / "state" / "shadow" / "slots").iterdir()
    assert stat_mod.S_IMODE(path.stat().st_mode) == 0o600
    assert stat_mod.S_IMODE((tmp_path / "state" / "shadow").stat().st_mode) == 0o700
    path.unlink()
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(b"p" * 16)
    os.symlink(elsewhere, path)
    assert slot.load("tcp://127.0.0.1:5555", 0) is None
    assert slot.load("tcp://127.0.0.1:5555", -1) is None  # no slot named: nothing to keep


def test_a_stranger_that_never_reads_gets_one_refusal_per_connection():
    """Issue 53, item 5: on a socket in clear (mac mode) every ticketless fetch was answered,
    and the serve socket queues without a limit (a reply's parts are never dropped): 60 s of
    such fetches from a peer that never reads grew a worker 188 -> 1,301 MB. A refusal to a
    request that proved nothing is answered once per connection; the rest are dropped and
    counted, so what such a peer makes the worker hold is one answer."""
    ctx = zmq.Context.instance()
    state = WorkerState()
    srv = FetchServer(state, SocketFactory(ctx), LOCAL, tickets=True)
    srv.sock = ctx.socket(zmq.ROUTER)
    ep = f"inproc://serve-{next(_ids)}"
    srv.sock.bind(ep)
    stranger, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    stranger.connect(ep)
    other.connect(ep)
    try:
        for _ in range(2000):
            stranger.send(M.encode("fetch", epoch=2, iteration=BASE))
            assert srv.sock.poll(2000)
            srv.on_message(srv.sock)
        stranger.send(b"not msgpack")
        assert srv.sock.poll(2000)
        srv.on_message(srv.sock)
        assert state.rejected["serve_bad_ticket"] == 2000 and state.rejected["serve_reply_dropped"] == 2000
        assert stranger.poll(2000)
        err = M.decode(stranger.recv())
        assert err["t"] == "error" and "no valid ticket" in err["message"]
        assert not stranger.poll(100)  # one answer, not 2001
        assert exchange(srv, other, M.encode("fetch", epoch=2, iteration=BASE))  # another connection is told
    finally:
        stranger.close(linger=0)
        other.close(linger=0)
        srv.close()


def test_a_raced_copy_with_a_frame_more_or_less_costs_nothing():
    """Issue 53, item 7: a copy of a genuine message with a payload frame removed or added,
    raced in by someone who sees the stream in clear, passed the header's MAC, failed as
    truncated_payload / extra_payload and made the worker stale (a resync per copy). It is
    dropped and counted like an altered copy: nothing of it was taken, it consumed no
    sequence number, and the genuine message that follows is taken."""
    key = tags.new_key()
    state, out, data, push = data_path()
    state.assignment = s = Assignment(configure(data_key=key))
    tagger = tags.DataKey(tags.rank_key(key, 0))
    values = np.arange(LAYOUT.total, dtype=np.float32) + 1
    nonce = tagger.nonce()
    runs = ((0, LAYOUT.total, tagger.tag(nonce, 1, values)),)
    head = F.Header(F.Kind.STATE, F.Field.PARAM, 7, 2, 0, 1, s.layout_hash, BASE, 0, runs, nonce).pack(tagger)

    def deliver(msg: list[bytes]) -> None:
        push.send_multipart(msg)
        assert data.sock.poll(2000)
        data.on_message(data.sock)

    try:
        deliver([head])  # its payload frame removed
        deliver([head, values.tobytes(), b"more"])  # a frame added
        assert state.rejected == {"truncated_payload": 1, "extra_payload": 1}
        assert not s.stale and out.kinds() == [] and s.inbox.next_seq == [0]
        assert not s.state.param.any()  # nothing landed
        deliver([head, values.tobytes()])  # the genuine message
        assert np.array_equal(s.state.param, values) and s.inbox.next_seq == [1] and not s.stale
    finally:
        push.close(linger=0)
        data.close()
