"""Restore from memory against fake workers: shards arrive in chunks, in parallel, straight
into place; a chunk that fails its checksum or is short is refused with a clear error."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from shadow.errors import ShadowError
from shadow.layout import Layout
from shadow.restore.memory import fetch_memory
from shadow.tuning import Tuning
from shadow.wire import frames as F
from shadow.wire import messages as M
from shadow.wire.frames import Field

OPTIM = {"kind": "adam", "amsgrad_any": False}


def fake_worker(ctx, lo, hi, values, chunk, damage=None, multipart=False):
    """A serve socket answering one fetch, each part its own message (a worker's framing) or
    one multipart message (an older worker's); ``damage(chunks, sums)`` alters the reply."""
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def run():
        ident, raw = sock.recv_multipart()
        msg = M.decode(raw)
        chunks = []
        for f in F.state_fields(OPTIM):
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
            arrays=[int(f) for f in F.state_fields(OPTIM)],
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

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return sock, t, f"tcp://127.0.0.1:{port}"


# parameters of several sizes (one empty), so that chunks and shards straddle them
SHAPES = [("a", (7,)), ("empty", (0,)), ("b", (123, 45)), ("c", (1,)), ("d", (50_000 - 7 - 123 * 45 - 1,))]
LAYOUT = Layout.build([(name, shape, 0, True) for name, shape in SHAPES], 1)


def run_fetch(damage=None, multipart=False, sink=None, layout=LAYOUT):
    total, split, chunk = 50_000, 20_480, 4096 * 4  # several chunks per field
    rng = np.random.default_rng(0)
    values = {f: rng.standard_normal(total).astype(np.float32) for f in F.state_fields(OPTIM)}
    ctx = zmq.Context()
    socks = []
    try:
        workers = []
        for i, (lo, hi) in enumerate([(0, split), (split, total)]):
            sock, t, ep = fake_worker(ctx, lo, hi, values, chunk, damage if i == 1 else None, multipart)
            socks.append((sock, t))
            workers.append({"id": i, "serve": ep, "start": lo, "stop": hi})
        info = {
            "job": "j",
            "epoch": 1,
            "iteration": 7,
            "layout": layout.to_dict(),
            "layout_hash": layout.hash,
            "optim": OPTIM,
            "world": 2,
            "workers": workers,
        }
        snap = fetch_memory(info, "tcp://test", tuning=Tuning(fetch_timeout_s=10.0), sink=sink)
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

    from trainer_hooks._sink import ModelParams

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
    from shadow.worker.worker_state import WorkerState

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
