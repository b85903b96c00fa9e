"""The data path's two seams in one process, over each transport: ZmqDataSender ->
FrameReceiver over inproc sockets, and UcxDataSender -> FrameReceiver over a UCX
connection on loopback (TCP). Every message is checked part by part; a bad one raises
FrameError with its reason, and the next message still starts on a frame boundary."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest
import zmq

from shadow.transport import Context, FrameReceiver, ZmqDataSender, ucx
from shadow.transport.receive import ZmqFrames
from shadow.wire import frames as F
from shadow.wire import tags

CTX = Context(job=0x5EED, epoch=3, layout=0xABC, world=1, lo=100, hi=1100, fields=frozenset({F.Field.PARAM}))
_ids = itertools.count()


NEEDS_UCX = pytest.mark.skipif(not ucx.available(), reason=f"UCX for Python is not installed: {ucx.INSTALL}")


@pytest.fixture(params=["zmq", pytest.param("ucx", marks=NEEDS_UCX)])
def pair(request):
    """A DataSender with one channel and the FrameReceiver on its other end."""
    if request.param == "ucx":
        sock = ucx.UcxDataSocket(limit=1 << 20, max_frames=64, rcvhwm=100)
        out = ucx.UcxDataSender([ucx.endpoint("127.0.0.1", sock.port)], hwm=100)
        ch = out.chans[0]
        deadline = time.monotonic() + 30
        while ch is not None and not ch.ready and time.monotonic() < deadline:  # the worker's READY
            sock.pump()
            out.poll()
            sock.wait(0.01)
        assert ch is not None and ch.ready, f"no READY from the worker's end ({ch and ch.broken})"
        yield out, FrameReceiver(sock)
        out.close()
        sock.close()
        return
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    ep = f"inproc://rx-{next(_ids)}"
    pull.bind(ep)
    out = ZmqDataSender(ctx, [ep], hwm=100)
    yield out, FrameReceiver(pull)
    out.close()
    pull.close(linger=0)


def arrived(rx: FrameReceiver, timeout: float = 30) -> bool:
    """Wait, as the worker's loop does, until a message can be read (or ``timeout``)."""
    if isinstance(rx.src, ZmqFrames):
        return bool(rx.src.sock.poll(int(timeout * 1000)))
    sock = rx.src
    assert isinstance(sock, ucx.UcxDataSocket)
    deadline = time.monotonic() + timeout
    while not sock.pump():
        if time.monotonic() > deadline:
            return False
        sock.wait(0.05)
    return True


def until_done(tracker, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not tracker.done and time.monotonic() < deadline:
        time.sleep(0.001)
    return tracker.done


def header(kind=F.Kind.GRAD, field=F.Field.GRAD, runs=(), **kw) -> bytes:
    base = dict(job=CTX.job, epoch=CTX.epoch, rank=0, world=1, layout=CTX.layout, iteration=1, seq=0)
    base.update(kw)
    return F.Header(kind=kind, field=field, runs=tuple(runs), **base).pack()


def message(parts: dict[int, np.ndarray], kind=F.Kind.GRAD, field=F.Field.GRAD, **kw) -> list:
    runs = [(dst, len(v), F.checksum(v)) for dst, v in parts.items()]
    return [header(kind, field, runs, **kw), *[v.tobytes() for v in parts.values()]]


def take(rx: FrameReceiver, ctx=CTX) -> F.Header:
    """A header, after waiting for the message as the worker does."""
    assert arrived(rx), "no message arrived"
    return rx.header(ctx)


def reason(fn) -> str:
    with pytest.raises(F.FrameError) as exc:
        fn()
    return exc.value.reason


def test_gradient_parts_are_kept_zero_copy_and_checked(pair):
    out, rx = pair
    a, b = np.arange(7, dtype=np.float32), np.full(3, 2.5, dtype=np.float32)
    assert out.send(0, message({100: a, 500: b}), track=False) is None
    h = take(rx)
    rx.check_runs(h, CTX)
    total, parts = rx.runs_kept(h, CTX.lo)
    assert total == 10 and [d for d, _ in parts] == [0, 400]
    assert np.array_equal(parts[0][1], a) and np.array_equal(parts[1][1], b)
    assert rx.frames_in == 1 and rx.bytes_in == 40


def test_state_parts_land_in_place(pair):
    out, rx = pair
    target = np.zeros(CTX.hi - CTX.lo, dtype=np.float32)
    v = np.linspace(0, 1, 9, dtype=np.float32)
    tracker = out.send(0, message({1000: v}, F.Kind.STATE, F.Field.PARAM), track=True)
    h = take(rx)
    rx.check_runs(h, CTX)
    assert rx.runs_into(h, target, CTX.lo) == 9
    assert np.array_equal(target[900:909], v) and not target[:900].any() and not target[909:].any()
    assert until_done(tracker)


@pytest.mark.parametrize(
    "frames, why",
    [
        (lambda m: m[:-1], "truncated_payload"),  # a part left off
        (lambda m: [*m, b"x"], "extra_payload"),  # one part too many
        (lambda m: [m[0], m[1][:-4], m[2]], "truncated_payload"),  # a short part
        (lambda m: [m[0], m[1][:-4] + b"\0\0\0\1", m[2]], "bad_checksum"),  # a changed byte
    ],
)
def test_a_damaged_message_is_rejected_and_the_next_one_is_read_whole(pair, frames, why):
    out, rx = pair
    good = message({100: np.ones(4, np.float32), 200: np.ones(2, np.float32)})
    out.send(0, frames(good), track=False)
    out.send(0, good, track=False)
    h = take(rx)
    assert reason(lambda: rx.runs_kept(h, CTX.lo)) == why
    rx.discard_rest()
    h = take(rx)
    assert rx.runs_kept(h, CTX.lo)[0] == 6


@pytest.mark.parametrize(
    "kw, runs, why",
    [
        (dict(epoch=2), [], "wrong_epoch"),
        (dict(job=1), [], "wrong_epoch"),
        (dict(layout=1), [], "wrong_layout"),
        (dict(world=2), [], "bad_rank"),
    ],
)
def test_a_header_for_another_context_is_rejected(pair, kw, runs, why):
    out, rx = pair
    out.send(0, [header(runs=runs, **kw)], track=False)
    assert arrived(rx)
    assert reason(lambda: rx.header(CTX)) == why


def test_nothing_is_taken_before_a_context_exists(pair):
    out, rx = pair
    out.send(0, [header()], track=False)
    assert arrived(rx)
    assert reason(lambda: rx.header(None)) == "not_configured"


@pytest.mark.parametrize(
    "kind, field, runs, why",
    [
        (F.Kind.GRAD, F.Field.GRAD, [(99, 2, 0)], "out_of_range"),
        (F.Kind.GRAD, F.Field.GRAD, [(1099, 2, 0)], "out_of_range"),
        (F.Kind.GRAD, F.Field.GRAD, [(100, 0, 0)], "out_of_range"),
        (F.Kind.GRAD, F.Field.PARAM, [(100, 1, 0)], "bad_kind"),
        (F.Kind.STATE, F.Field.GRAD, [(100, 1, 0)], "bad_kind"),
        (F.Kind.STATE, F.Field.EXP_AVG, [(100, 1, 0)], "bad_kind"),  # not a field of this optimizer
        (F.Kind.COMMIT, F.Field.GRAD, [(0, 4, 0), (4, 4, 0)], "bad_commit"),
        (F.Kind.EXTRA, F.Field.GRAD, [(7, 0, 0)], "bad_extra"),
    ],
)
def test_run_tables_are_checked_against_the_context(kind, field, runs, why):
    h = F.Header(kind, field, CTX.job, CTX.epoch, 0, 1, CTX.layout, 1, 0, tuple(runs))
    assert reason(lambda: FrameReceiver(None).check_runs(h, CTX)) == why


def test_a_part_larger_than_a_sender_makes_is_rejected(monkeypatch):
    monkeypatch.setattr(F, "MAX_PART_BYTES", 64)
    h = F.Header(F.Kind.GRAD, F.Field.GRAD, CTX.job, CTX.epoch, 0, 1, CTX.layout, 1, 0, ((100, 17, 0),))
    assert reason(lambda: FrameReceiver(None).check_runs(h, CTX)) == "too_large"


def test_commit_bodies_and_extra_chunks(pair):
    out, rx = pair
    body = b"commit record"
    out.send(0, [header(F.Kind.COMMIT, runs=[(0, len(body), F.checksum(body))]), body], track=False)
    h = take(rx)
    rx.check_runs(h, CTX)
    assert rx.body(h) == body
    chunks = {5: b"abc", 9: b"defgh"}
    table = [(k, len(v), F.checksum(v)) for k, v in chunks.items()]
    out.send(0, [header(F.Kind.EXTRA, runs=table), *chunks.values()], track=False)
    h = take(rx)
    rx.check_runs(h, CTX)
    assert {k: bytes(v) for k, v in rx.chunks(h)} == chunks
    out.send(0, [header(F.Kind.COMMIT, runs=[(0, len(body), F.checksum(body))]), body, body], track=False)
    assert reason(lambda: rx.body(take(rx))) == "extra_payload"


def test_a_dropped_channel_refuses_to_send_until_opened_again(pair):
    out, rx = pair
    out.drop(0)
    with pytest.raises(ValueError, match="no channel to shadow worker 0"):
        out.send(0, [header()], track=False)


WORKER_KEY = tags.new_key()
KEYED = dataclasses.replace(CTX, world=2, keys=tags.for_ranks(WORKER_KEY, 2))


def keyed_message(parts: dict[int, np.ndarray], rank: int = 1, key: bytes | None = None, **kw) -> list:
    """What rank ``rank`` sends: every part under its MAC key for this worker (``key``: another)."""
    t = tags.DataKey(key if key is not None else tags.rank_key(WORKER_KEY, rank))
    nonce = t.nonce()
    runs = [(dst, len(v), t.tag(nonce, i, v)) for i, (dst, v) in enumerate(parts.items(), 1)]
    base = dict(job=CTX.job, epoch=CTX.epoch, rank=rank, world=2, layout=CTX.layout, iteration=1, seq=0)
    base.update(kw)
    h = F.Header(kind=F.Kind.GRAD, field=F.Field.GRAD, runs=tuple(runs), nonce=nonce, **base)
    return [h.pack(t), *[v.tobytes() for v in parts.values()]]


def test_a_keyed_receiver_takes_each_rank_s_frames_under_that_rank_s_key(pair):
    out, rx = pair
    a = np.arange(5, dtype=np.float32)
    for rank in (0, 1):
        out.send(0, keyed_message({100: a}, rank=rank), track=False)
        h = take(rx, KEYED)
        assert h.rank == rank
        assert np.array_equal(rx.runs_kept(h, CTX.lo)[1][0][1], a)


@pytest.mark.parametrize(
    "forge, why",
    [
        # a payload byte changed on the way: the header checks out, the part does not
        (lambda: (lambda m: [m[0], m[1][:-1] + b"\x01"])(keyed_message({100: np.ones(4, np.float32)})), "bad_mac"),
        # rank 0 (or anyone with rank 0's key) sending as rank 1
        (lambda: keyed_message({100: np.ones(4, np.float32)}, rank=1, key=tags.rank_key(WORKER_KEY, 0)), "bad_mac"),
        # the right rank's key of an earlier configuration of this worker
        (lambda: keyed_message({100: np.ones(4, np.float32)}, key=tags.rank_key(tags.new_key(), 1)), "bad_mac"),
        # a sender without keys: plain checksums
        (lambda: message({100: np.ones(4, np.float32)}, rank=1, world=2), "bad_mac"),
    ],
)
def test_a_keyed_receiver_refuses_what_its_keys_did_not_tag(pair, forge, why):
    out, rx = pair
    out.send(0, forge(), track=False)
    out.send(0, keyed_message({100: np.full(4, 3.0, np.float32)}), track=False)

    def read():
        h = take(rx, KEYED)
        rx.check_runs(h, KEYED)
        return rx.runs_kept(h, CTX.lo)

    assert reason(read) == why
    rx.discard_rest()
    assert np.array_equal(read()[1][0][1], np.full(4, 3.0, np.float32))  # the next message is read whole


@NEEDS_UCX
@pytest.mark.parametrize("pair", ["ucx"], indirect=True)
def test_only_a_message_that_checks_out_proves_its_ucx_connection(pair):
    """A UCX worker keeps proven connections when it is full of connections: a header
    under the wrong key, or for another epoch, proves nothing; one under the rank's key does."""
    out, rx = pair
    sock = rx.src
    assert isinstance(sock, ucx.UcxDataSocket)
    a = np.ones(4, np.float32)
    out.send(0, keyed_message({100: a}, rank=1, key=tags.rank_key(WORKER_KEY, 0)), track=False)
    out.send(0, keyed_message({100: a}, epoch=CTX.epoch + 1), track=False)
    out.send(0, keyed_message({100: a}), track=False)
    for why in ("bad_mac", "wrong_epoch"):
        assert reason(lambda: take(rx, KEYED)) == why
        rx.discard_rest()
        assert not sock.conns[0].proven
    h = take(rx, KEYED)
    assert h.rank == 1 and sock.conns[0].proven
