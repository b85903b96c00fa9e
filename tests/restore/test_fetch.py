"""Restore from memory against fake workers: shards arrive in chunks, in parallel, straight
into place; a chunk that fails its checksum or is short is refused with a clear error."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from shadow import security
from shadow.config.tuning import Tuning
from shadow.core.errors import ShadowError
from shadow.core.layout import Layout
from shadow.core.optimizers import state_fields
from shadow.restore.memory import fetch_memory
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire import tags
from shadow.wire.frames import Field

pytestmark = pytest.mark.usefixtures("keyless")  # in-process services built without a guard

OPTIM = {"kind": "adam", "amsgrad_any": False}


class AnswerOnce(threading.Thread):
    """Runs ``answer(ident, raw)`` on the first message ``sock`` receives. It polls, so that
    ``join`` (which tells it to stop first) ends it even if no message came: a socket is
    closed only once its thread has let go of it (closing it under a blocked ``recv`` can
    hang ``ctx.term()``)."""

    def __init__(self, sock, answer) -> None:
        super().__init__(daemon=True)
        self.sock, self.answer, self.stopping = sock, answer, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.sock.poll(50, zmq.POLLIN):
                self.answer(*self.sock.recv_multipart())
                return

    def join(self, timeout=None) -> None:
        self.stopping.set()
        super().join(timeout)
        assert not self.is_alive(), "a fake worker's thread did not stop"


def fake_worker(ctx, lo, hi, values, chunk, damage=None, multipart=False):
    """A serve socket answering one fetch, each part its own message (a worker's framing) or
    one multipart message (an older worker's); ``damage(chunks, sums)`` alters the reply."""
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def run(ident, raw):
        msg = M.decode(raw)
        chunks = []
        for f in state_fields(OPTIM):
            b = values[f][lo:hi].view(np.uint8)
            chunks += [b[i : i + chunk].tobytes() for i in range(0, len(b), chunk)]
        sums = [F.checksum(c) for c in chunks]
        if damage:
            damage(chunks, sums)
        head = M.encode(
            "fetch_reply",
            epoch=msg["epoch"],
            iteration=msg["iteration"],
            start=lo,
            stop=hi,
            arrays=[int(f) for f in state_fields(OPTIM)],
            steps=[[0, 5.0]] if lo == 0 else [],
            has_state=[0] if lo == 0 else [],
            commits=[[0 if lo == 0 else 1, b"blob"]],
            replay=None,
            chunk=chunk,
            sums=sums,
        )
        if multipart:
            sock.send_multipart([ident, head] + chunks)
        else:
            for part in [head] + chunks:
                sock.send_multipart([ident, part])

    t = AnswerOnce(sock, run)
    return sock, t, f"tcp://127.0.0.1:{port}"


# parameters of several sizes (one empty), so that chunks and shards straddle them
SHAPES = [("a", (7,)), ("empty", (0,)), ("b", (123, 45)), ("c", (1,)), ("d", (50_000 - 7 - 123 * 45 - 1,))]
LAYOUT = Layout.build([(name, shape, 0, True) for name, shape in SHAPES], 1)


def memory_info(workers: list, layout: Layout) -> dict:
    """A coordinator's memory info for iteration 7 of epoch 1 held by ``workers``."""
    return {
        "job": "j",
        "epoch": 1,
        "iteration": 7,
        "layout": layout.to_dict(),
        "layout_hash": layout.hash,
        "optim": OPTIM,
        "world": 2,
        "workers": workers,
    }


CHUNK = 4096 * 4  # several chunks per field
SHARDS = [(0, 20_480), (20_480, LAYOUT.total)]


def state_values(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f: rng.standard_normal(LAYOUT.total).astype(np.float32) for f in state_fields(OPTIM)}


def run_fetch(damage=None, multipart=False, sink=None, layout=LAYOUT):
    chunk, values = CHUNK, state_values(0)
    ctx = zmq.Context()
    socks = []
    try:
        workers = []
        for i, (lo, hi) in enumerate(SHARDS):
            sock, t, ep = fake_worker(ctx, lo, hi, values, chunk, damage if i == 1 else None, multipart)
            socks.append((sock, t))
            workers.append({"id": i, "serve": ep, "start": lo, "stop": hi})
        snap = fetch_memory(memory_info(workers, layout), "tcp://test", tuning=Tuning(fetch_timeout_s=10.0), sink=sink)
        return snap, values
    finally:
        for sock, t in socks:
            t.join(5)
            sock.close(0)
        ctx.term()


@pytest.mark.parametrize("multipart", [False, True])
def test_chunked_parallel_fetch_lands_every_byte(multipart):
    snap, values = run_fetch(multipart=multipart)
    for f, want in values.items():
        assert np.array_equal(snap.arrays[f], want)
    assert snap.steps[0] == 5.0 and snap.has_state[0] and sorted(snap.blobs) == [0, 1]


def model_params(layout=LAYOUT):
    import torch

    from trainer_hooks.restorer.sink import ModelParams

    params = [torch.full(spec.shape, -1.0) for spec in layout.params]
    return params, ModelParams.of(layout, params)


def test_parameters_land_straight_in_the_model_and_the_moments_in_flat_arrays():
    params, sink = model_params()
    snap, values = run_fetch(sink=sink)
    assert Field.PARAM not in snap.arrays and snap.placed == tuple(params)
    got = np.concatenate([p.numpy().reshape(-1) for p in params])
    assert np.array_equal(got, values[Field.PARAM])
    for f in (Field.EXP_AVG, Field.EXP_AVG_SQ):
        assert np.array_equal(snap.arrays[f], values[f])


def test_a_sink_of_another_layout_is_left_alone():
    other = Layout.build([("w", (50_000,), 0, True)], 1)
    params, sink = model_params(other)
    snap, values = run_fetch(sink=sink)
    assert snap.placed == () and np.array_equal(snap.arrays[Field.PARAM], values[Field.PARAM])
    assert all(bool((p == -1.0).all()) for p in params)


@pytest.mark.parametrize("seed", range(3))
def test_scattered_chunks_of_any_size_and_order_fill_every_parameter(seed):
    params, sink = model_params()
    rng = np.random.default_rng(seed)
    flat = rng.standard_normal(LAYOUT.total).astype(np.float32).view(np.uint8)
    cuts = np.unique(np.concatenate([[0, len(flat)], rng.integers(0, len(flat), 40)]))
    pieces = list(zip(cuts[:-1], cuts[1:], strict=True))
    rng.shuffle(pieces)
    for a, b in pieces:
        buf = sink.staging(int(b - a))
        np.frombuffer(buf, dtype=np.uint8)[:] = flat[a:b]
        sink.put(int(a), buf)
    assert np.array_equal(np.concatenate([p.numpy().reshape(-1) for p in params]), flat.view(np.float32))
    with pytest.raises(ValueError, match="run past"):
        sink.put(len(flat) - 4, memoryview(bytes(8)))


def test_corrupt_chunk_is_refused():
    def flip(chunks, sums):
        b = bytearray(chunks[2])
        b[100] ^= 1
        chunks[2] = bytes(b)

    with pytest.raises(ShadowError, match="fail their checksum"):
        run_fetch(flip)


def test_short_chunk_is_refused():
    def cut(chunks, sums):
        chunks[1] = chunks[1][:-4]

    with pytest.raises(ShadowError, match="chunk"):
        run_fetch(cut)


def test_worker_holds_apply_only_while_a_shard_is_in_flight():
    """Shards are sent zero-copy from the live arrays; the next apply waits for zmq to be
    done with them, but a client that reads nothing (frozen) costs SERVE_STALL_S once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from shadow.transport import SocketFactory
    from shadow.worker.address import Binding
    from shadow.worker.fetches import FetchServer, Reply
    from shadow.worker.state import WorkerState

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = (
        "import time, zmq\n"
        "d = zmq.Context().socket(zmq.DEALER)\n"
        f"d.connect('tcp://127.0.0.1:{port}')\n"
        "d.send(b'hello')\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", client])
    try:
        assert router.poll(30_000)
        ident, _ = router.recv_multipart()
        os.kill(proc.pid, signal.SIGSTOP)  # frozen: its I/O thread stops reading
        w = FetchServer(WorkerState(), SocketFactory(ctx), Binding("127.0.0.1", "127.0.0.1"))
        w.sock = router
        big = np.ones(256 << 20, dtype=np.uint8)  # far more than the socket buffers hold
        w.replies[ident] = Reply(
            "frozen", None, [router.send_multipart([ident, memoryview(big)], copy=False, track=True)], time.monotonic()
        )
        t0 = time.monotonic()
        w.state.tuning = w.state.tuning.replace(serve_stall_s=0.5)
        w.wait_for_readers()
        assert 0.3 < time.monotonic() - t0 < 3.0 and w.replies[ident].dropped and w.state.rejected["serve_dropped"] == 1
        # a shard that went out completely costs no wait
        local = ctx.socket(zmq.DEALER)
        local.connect(f"tcp://127.0.0.1:{port}")
        local.send(b"hello")
        me, _ = router.recv_multipart()
        tracker = router.send_multipart([me, memoryview(big[: 1 << 20])], copy=False, track=True)
        assert local.poll(10_000) and len(local.recv_multipart()) == 1
        w.replies[me] = Reply("local", None, [tracker], time.monotonic())
        t0 = time.monotonic()
        w.wait_for_readers()
        assert time.monotonic() - t0 < 1.0 and tracker.done and me not in w.replies
        local.close(0)
    finally:
        proc.kill()
        proc.wait()
        router.close(0)
        ctx.term()


# -- mac mode: the worker's own reply code, under a ticket's key ------------------------


class _Capture:
    """Stands in for a serve socket: keeps the parts FetchServer._send_state sends."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def send(self, data, flags=0, copy=True, track=False):
        if flags & zmq.SNDMORE:  # the client's identity
            return None
        self.parts.append(bytes(data))
        return SimpleNamespace(done=True)


def _server(keys: dict):
    """A FetchServer in mac mode whose current (and retired) configuration has these serve keys."""
    from shadow.transport import SocketFactory
    from shadow.worker.address import Binding
    from shadow.worker.fetches import FetchServer
    from shadow.worker.state import WorkerState

    state = WorkerState()
    state.assignment = SimpleNamespace(serve_key=keys.get("current"), epoch=1)
    state.retired = SimpleNamespace(serve_key=keys["retired"], epoch=0) if "retired" in keys else None
    return FetchServer(state, SocketFactory(zmq.Context.instance(), keys=None), Binding("127.0.0.1", "127.0.0.1"), True)


def _held(values, lo, hi, msg: dict, extras: dict) -> SimpleNamespace:
    """What a worker's FetchServer sends from: the session holding shard ``[lo, hi)`` of
    ``values`` at the fetch's epoch and iteration, with ``extras`` chunks."""
    shard = SimpleNamespace(
        fields=lambda: state_fields(OPTIM),
        array=lambda f: values[f][lo:hi],
        in_range=np.array([lo == 0] + [False] * (len(SHAPES) - 1)),
        steps=np.array([5.0] + [0.0] * (len(SHAPES) - 1)),
        has_state=np.array([True] * len(SHAPES)),
        start=lo,
        stop=hi,
    )
    session = SimpleNamespace(state=shard, extras=extras, epoch=msg["epoch"], applied=msg["iteration"], commit=None)
    session.blobs = {0 if lo == 0 else 1: b"blob"}
    return session


def served_worker(ctx, lo, hi, values, chunk, serve_key, damage=None, sign_with=None):
    """A serve socket answering one fetch with the worker's own reply code (FetchServer), after
    checking the fetch's ticket; ``damage(parts)`` alters the parts on the way; ``sign_with``:
    tag the reply under another key than the ticket's."""
    sock = ctx.socket(zmq.ROUTER)
    security.doorkeeper(ctx).door(sock, lambda user, password: "")  # a reader with a ticket comes through a door
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    server = _server({"current": serve_key})
    seen: dict = {}

    def run(ident, raw):
        msg = M.decode(raw)
        key = seen["key"] = server.ticket_key(msg)
        session = _held(values, lo, hi, msg, {7: b"extra bytes"})
        server.sock = _Capture()
        server.state.tuning = server.state.tuning.replace(fetch_chunk_bytes=chunk)
        if key is None:
            sock.send_multipart([ident, M.encode("error", code="busy", message="busy: no valid ticket")])
            return
        server._send_state(ident, session, "test", sign_with or key)
        parts = server.sock.parts
        if damage:
            damage(parts)
        for part in parts:
            sock.send_multipart([ident, part])

    t = AnswerOnce(sock, run)
    return sock, t, f"tcp://127.0.0.1:{port}", seen


def run_keyed_fetch(damage=None, sign_with=None, ticket_for=None):
    """Two workers in mac mode; the second's reply passes through ``damage``. ``ticket_for``:
    the serve key the reader's ticket is made for (default: the worker's own)."""
    chunk, values = CHUNK, state_values(1)
    ctx = zmq.Context()
    socks = []
    try:
        workers = []
        for i, (lo, hi) in enumerate(SHARDS):
            serve_key = tags.serve_key(tags.new_key())
            sock, t, ep, seen = served_worker(
                ctx, lo, hi, values, chunk, serve_key, damage if i == 1 else None, sign_with if i == 1 else None
            )
            socks.append((sock, t, seen))
            ticket = tags.new_ticket()
            key = tags.ticket_key(ticket_for if ticket_for is not None and i == 1 else serve_key, ticket)
            workers.append({"id": i, "serve": ep, "start": lo, "stop": hi, "ticket": ticket, "key": key})
        tuning = Tuning(fetch_timeout_s=10.0, fetch_chunk_bytes=chunk)
        snap = fetch_memory(memory_info(workers, LAYOUT), "tcp://test", tuning=tuning)
        for (_, _, seen), w in zip(socks, workers, strict=True):
            assert seen["key"] == w["key"]  # the worker derived the reader's key from its ticket
        return snap, values
    finally:
        for sock, t, _ in socks:
            t.join(5)
            sock.close(0)
        ctx.term()


def test_mac_mode_fetch_lands_every_byte():
    snap, values = run_keyed_fetch()
    for f, want in values.items():
        assert np.array_equal(snap.arrays[f], want)
    assert snap.steps[0] == 5.0 and sorted(snap.blobs) == [0, 1] and snap.extras == {7: b"extra bytes"}


def _flip_chunk(parts):
    b = bytearray(parts[3])
    b[100] ^= 1
    parts[3] = bytes(b)


def _swap_chunks(parts):  # two chunks trade places, each still with its own tag
    parts[2], parts[3] = parts[3], parts[2]


def _alter_head(parts):  # a checksum in the head changed, the head's tag left as it was
    outer = M.decode(parts[0])
    inner = M.decode(outer["head"])
    inner["sums"][0] = bytes(16)
    del inner["t"], inner["v"]
    outer["head"] = M.encode("fetch_reply", **inner)
    parts[0] = M.encode("fetch_reply_mac", salt=outer["salt"], tag=outer["tag"], head=outer["head"])


def _alter_extra(parts):
    parts[-1] = b"other bytes"


def _unkeyed_head(parts):  # the MAC'd head swapped for the plain reply inside it
    parts[0] = M.decode(parts[0])["head"]


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_flip_chunk, "fail their MAC"),
        (_swap_chunks, "fail their MAC"),
        (_alter_head, "head fails its MAC"),
        (_alter_extra, "damaged extras chunk"),
        (_unkeyed_head, "without a MAC"),
    ],
    ids=["flipped-bit", "swapped-chunks", "altered-head", "altered-extras", "plain-reply"],
)
def test_mac_mode_refuses_an_altered_reply(damage, match):
    with pytest.raises(ShadowError, match=match):
        run_keyed_fetch(damage)


def test_mac_mode_refuses_a_reply_under_another_key():
    with pytest.raises(ShadowError, match="head fails its MAC"):
        run_keyed_fetch(sign_with=tags.ticket_key(tags.serve_key(tags.new_key()), tags.new_ticket()))


def test_mac_mode_fetch_with_a_ticket_of_another_worker_is_refused():
    from shadow.restore.memory import MovedOn

    with pytest.raises(MovedOn, match="no valid ticket"):
        run_keyed_fetch(ticket_for=tags.serve_key(tags.new_key()))


def test_a_worker_takes_tickets_of_its_current_and_retired_configurations_only():
    current, retired = tags.serve_key(tags.new_key()), tags.serve_key(tags.new_key())
    server = _server({"current": current, "retired": retired})

    def fetch(serve_key, epoch=1, iteration=7, mac_for=(1, 7), ticket=None):
        ticket = ticket if ticket is not None else tags.new_ticket()
        key = tags.ticket_key(serve_key, ticket)
        return {"epoch": epoch, "iteration": iteration, "ticket": ticket, "mac": tags.fetch_mac(key, *mac_for)}, key

    msg, key = fetch(current)
    assert server.ticket_key(msg) == key
    msg, key = fetch(retired, epoch=0, mac_for=(0, 7))
    assert server.ticket_key(msg) == key
    # a ticket reads the epoch of the configuration it is of: the current one's, not the retired job's
    assert server.ticket_key(fetch(current, epoch=0, mac_for=(0, 7))[0]) is None
    assert server.ticket_key(fetch(tags.serve_key(tags.new_key()))[0]) is None  # another worker's, or forged
    assert server.ticket_key(fetch(current, iteration=8)[0]) is None  # the MAC covers what is asked for
    assert server.ticket_key(fetch(current, ticket=b"short")[0]) is None
    assert server.ticket_key({"epoch": 1, "iteration": 7}) is None  # no ticket at all
    server.state.retired = None
    assert server.ticket_key(fetch(retired, epoch=0, mac_for=(0, 7))[0]) is None


def ranged_worker(ctx, lo, hi, values, chunk):
    """A serve socket answering one fetch with the worker's own reply code for the ranges it
    asks (FetchServer._send_state after check_ranges, as FetchServer.answer does)."""
    from shadow.transport import fetch

    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    server = _server({"current": None})
    seen: dict = {}

    def run(ident, raw):
        msg = M.decode(raw)
        seen["ranges"] = ranges = msg.get("ranges")
        if ranges is not None:
            ranges = fetch.check_ranges(ranges, lo, hi)
        session = _held(values, lo, hi, msg, {})
        server.sock = _Capture()
        server.state.tuning = server.state.tuning.replace(fetch_chunk_bytes=chunk)
        server._send_state(ident, session, "test", None, ranges)
        for part in server.sock.parts:
            sock.send_multipart([ident, part])

    t = AnswerOnce(sock, run)
    return sock, t, f"tcp://127.0.0.1:{port}", seen


def run_ranged_fetch(seed: int, ranges) -> tuple:
    """Two workers answering with their own reply code (:func:`ranged_worker`), fetched
    with ``ranges``; ``(snapshot, values, the ranges each worker was asked for, progress)``."""
    values, chunk = state_values(seed), 4096
    ctx = zmq.Context()
    socks, done = [], []
    try:
        workers = []
        for i, (lo, hi) in enumerate(SHARDS):
            sock, t, ep, seen = ranged_worker(ctx, lo, hi, values, chunk)
            socks.append((sock, t, seen))
            workers.append({"id": i, "serve": ep, "start": lo, "stop": hi})
        snap = fetch_memory(
            memory_info(workers, LAYOUT),
            "tcp://test",
            progress=lambda got, total: done.append((got, total)),
            tuning=Tuning(fetch_timeout_s=10.0, fetch_chunk_bytes=chunk),
            ranges=ranges,
        )
    finally:
        for sock, t, _ in socks:
            t.join(5)
            sock.close(0)
        ctx.term()
    return snap, values, [s["ranges"] for _, _, s in socks], done


def test_a_fetch_of_some_ranges_reads_those_only():
    """An FSDP2 rank's restore: the ranges straddle chunks and both shards; each worker is
    asked for its part of them only, and only those bytes arrive and land in place."""
    wanted = [(5, 9), (20_000, 21_000), (30_000, 30_001)]
    snap, values, asked, done = run_ranged_fetch(2, (LAYOUT.hash, wanted))
    assert asked == [[[5, 9], [20_000, 20_480]], [[20_480, 21_000], [30_000, 30_001]]]
    assert snap.ranges == tuple(wanted)
    for f, want in values.items():
        for a, b in wanted:
            assert np.array_equal(snap.arrays[f][a:b], want[a:b])
    nbytes = sum(b - a for a, b in wanted) * 4 * len(values)
    assert done[-1] == (nbytes, nbytes)  # nothing else was read
    assert snap.steps[0] == 5.0 and sorted(snap.blobs) == [0, 1]


def test_ranges_of_another_layout_fetch_everything():
    snap, values, asked, _ = run_ranged_fetch(3, (LAYOUT.hash ^ 1, [(0, 3)]))
    assert snap.ranges is None and asked == [None, None]
    for f, want in values.items():
        assert np.array_equal(snap.arrays[f], want)


def test_a_reply_that_ignores_the_ranges_is_refused():
    with pytest.raises(ShadowError, match="sent ranges None"):
        values, ctx = state_values(4), zmq.Context()
        socks = []
        try:
            workers = []
            for i, (lo, hi) in enumerate(SHARDS):  # fake workers send their whole shard
                sock, t, ep = fake_worker(ctx, lo, hi, values, CHUNK)
                socks.append((sock, t))
                workers.append({"id": i, "serve": ep, "start": lo, "stop": hi})
            fetch_memory(
                memory_info(workers, LAYOUT),
                "tcp://test",
                tuning=Tuning(fetch_timeout_s=10.0),
                ranges=(LAYOUT.hash, [(0, 3)]),
            )
        finally:
            for sock, t in socks:
                t.join(5)
                sock.close(0)
            ctx.term()


@pytest.mark.parametrize(
    "ranges, problem",
    [
        ("0-3", "a list"),
        ([[0, 3, 4]], "pair of integers"),
        ([[0, 3.0]], "pair of integers"),
        ([[3, 3]], "empty"),
        ([[4, 9], [0, 3]], "out of order"),
        ([[0, 5], [4, 9]], "overlapping"),
        ([[-1, 3]], "outside"),
        ([[0, 1 << 40]], "outside"),
        ([[i, i + 1] for i in range((1 << 16) + 1)], "at most"),
    ],
)
def test_a_worker_checks_the_ranges_it_is_asked_for(ranges, problem):
    from shadow.transport import fetch

    with pytest.raises(ValueError, match=problem):
        fetch.check_ranges(ranges, 0, 1 << 20)
    assert fetch.check_ranges([[0, 3], [3, 9]], 0, 9) == [[0, 3], [3, 9]]
