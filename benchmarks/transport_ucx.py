"""The UCX data path against ZeroMQ, per connection, for ``bench_transport``.

One trainer (this process) and one worker (a "spawn" process), each transport on its
production classes: the trainer's ``ZmqDataSender`` (PUSH, tcp) and ``UcxDataSender``
(UCX, error handling on, ``UCX_TLS=tcp`` unless the environment sets it),
the worker's PULL socket from ``SocketFactory`` and ``UcxDataSocket``, both read through
the worker's own ``FrameReceiver`` (header, run table, each part checked where it lies:
``runs_kept``), with checksums (no keys) or GMACs (``security.data=mac``). Messages are
framed like ``Sender._send_payload`` from a float32 staging ring, sent zero-copy, a ring
slot reused once its tracker is done. Measured in interleaved rounds; GB/s of payload from
the first send to the receiver's report that the last message checked out.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import zmq

from shadow.config.tuning import Tuning
from shadow.transport import Context, FrameReceiver, SocketFactory, ZmqDataSender, data_limit, ucx
from shadow.wire import frames as F
from shadow.wire import tags

TUNING = Tuning.load()
JOB, EPOCH, LAYOUT = 0x5EED, 1, 0xABC
RING_BYTES = 128 << 20
KINDS = ("zmq", "ucx")
SECS = ("plain", "mac")


def _receiver(conn, data_key: bytes, total: int) -> None:
    """The worker: both channels bound, then ``{"op": "run", ...}`` commands until ``exit``."""
    ctx = zmq.Context()
    pull = SocketFactory(ctx).pull(data_limit(TUNING), TUNING.data_rcvhwm_messages, curve=False)
    zport = pull.bind_to_random_port("tcp://127.0.0.1")
    usock = ucx.UcxDataSocket(data_limit(TUNING), TUNING.max_runs + 1, TUNING.data_rcvhwm_messages)
    conn.send_bytes(
        json.dumps({"zmq": f"tcp://127.0.0.1:{zport}", "ucx": ucx.endpoint("127.0.0.1", usock.port)}).encode()
    )
    rx = {"zmq": FrameReceiver(pull, TUNING), "ucx": FrameReceiver(usock, TUNING)}
    keyed = (tags.DataKey(tags.rank_key(data_key, 0)),)
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            if cmd["op"] == "exit":
                return
            kind, n = cmd["kind"], cmd["n"]
            ctxt = Context(JOB, EPOCH, LAYOUT, 1, 0, total, keys=keyed if cmd["sec"] == "mac" else ())
            got, nbytes, errors = 0, 0, 0
            deadline = time.monotonic() + 300
            while got < n and time.monotonic() < deadline:
                if kind == "zmq":
                    pull.poll(50)
                else:
                    if not usock.pump():
                        usock.wait(0.05)
                        usock.pump()
                while got < n:
                    try:
                        h = rx[kind].header(ctxt)
                    except zmq.Again:
                        break
                    try:
                        rx[kind].check_runs(h, ctxt)
                        elems, _ = rx[kind].runs_kept(h, 0)
                        nbytes += elems * 4
                    except F.FrameError:
                        errors += 1
                        rx[kind].discard_rest()
                    got += 1
            conn.send_bytes(json.dumps({"got": got, "bytes": nbytes, "errors": errors}).encode())
    finally:
        pull.close(linger=0)
        usock.close()
        ctx.term()


class _Trainer:
    def __init__(self, eps: dict, data_key: bytes, sizes: list[int]) -> None:
        self.ctx = zmq.Context()
        self.out = {"zmq": ZmqDataSender(self.ctx, [eps["zmq"]], TUNING.sndhwm_messages, curve=[False])}
        self.out["ucx"] = ucx.UcxDataSender([eps["ucx"]], TUNING.sndhwm_messages)
        self.tags = {"plain": tags.PLAIN, "mac": tags.DataKey(tags.rank_key(data_key, 0))}
        self.per = sum(sizes)
        self.slots = max(2, RING_BYTES // (4 * self.per))
        self.ring = np.random.default_rng(0).standard_normal(self.slots * self.per, dtype=np.float32)
        offs, o = [], 0
        for k in sizes:
            offs.append((o, k))
            o += k
        self.offs = offs
        self.seq = {k: 0 for k in KINDS}
        self.iteration = 1

    def send(self, kind: str, sec: str, n: int) -> None:
        tagger, out = self.tags[sec], self.out[kind]
        trackers: list = [None] * self.slots
        for i in range(n):
            s = i % self.slots
            t = trackers[s]
            while t is not None and not t.done:  # the ring slot is still read by the transport
                out.poll()  # a connection still in its handshake moves on (as the sender thread does)
                time.sleep(0.0001)
            base = s * self.per
            views = [self.ring[base + o : base + o + k] for o, k in self.offs]
            nonce = tagger.nonce()
            table = [
                (o, k, tagger.tag(nonce, j, v)) for j, ((o, k), v) in enumerate(zip(self.offs, views, strict=True), 1)
            ]
            hdr = F.Header(
                F.Kind.GRAD, F.Field.GRAD, JOB, EPOCH, 0, 1, LAYOUT, self.iteration, self.seq[kind], tuple(table), nonce
            ).pack(tagger)
            self.seq[kind] += 1
            trackers[s] = out.send(0, [hdr] + [memoryview(v) for v in views], True)
        self.iteration += 1

    def close(self) -> None:
        for out in self.out.values():
            out.close()
        self.ctx.term()


def _measure(conn, trainer: _Trainer, kind: str, sec: str, n: int) -> float:
    conn.send_bytes(json.dumps({"op": "run", "kind": kind, "sec": sec, "n": n}).encode())
    t0 = time.perf_counter()
    trainer.send(kind, sec, n)
    deadline = time.monotonic() + 400
    while not conn.poll(0.001):  # what is queued behind a handshake goes once it completes
        trainer.out[kind].poll()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver did not finish {kind} {sec} ({n} messages)")
    r = json.loads(conn.recv_bytes())
    t1 = time.perf_counter()
    if r["errors"] or r["got"] != n or r["bytes"] != n * trainer.per * 4:
        raise RuntimeError(f"{kind} {sec}: the receiver took {r} of {n} messages")
    return n * trainer.per * 4 / 1e9 / (t1 - t0)


def measure(shapes: dict[str, list[int]], rounds: int, target_s: float) -> dict:
    """Per shape, GB/s of each transport x (no keys, mac), and UCX / ZeroMQ ratios."""
    if not ucx.available():
        return {"available": False, "why": f"UCX for Python is not installed: {ucx.INSTALL}", "rows": []}
    # TCP against TCP unless told otherwise: on one host UCX would pick shared memory
    os.environ.setdefault("UCX_TLS", "tcp")  # the receiver process inherits it
    data_key = tags.new_key()
    mpc = mp.get_context("spawn")
    rows = []
    for shape, sizes in shapes.items():
        parent, child = mpc.Pipe()
        proc = mpc.Process(target=_receiver, args=(child, data_key, sum(sizes)), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(120):
            raise RuntimeError("the UCX receiver did not start")
        trainer = _Trainer(json.loads(parent.recv_bytes()), data_key, sizes)
        try:
            cells = [(k, s) for k in KINDS for s in SECS]
            warm = {c: _measure(parent, trainer, *c, max(8, (64 << 20) // (4 * trainer.per))) for c in cells}
            counts = {c: max(8, round(target_s * warm[c] * 1e9 / (4 * trainer.per))) for c in cells}
            per: dict = {c: [] for c in cells}
            for r in range(rounds):
                for c in cells[r % len(cells) :] + cells[: r % len(cells)]:
                    per[c].append(_measure(parent, trainer, *c, counts[c]))
        finally:
            trainer.close()
            parent.send_bytes(b'{"op": "exit"}')
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        row = {"shape": shape, "bytes_per_msg": 4 * sum(sizes), "rounds": rounds}
        for (k, s), v in per.items():
            row[f"{k}_{s}_GBps"] = statistics.median(v)
            row[f"{k}_{s}_GBps_rounds"] = v
        row["ucx_vs_zmq"] = row["ucx_plain_GBps"] / row["zmq_plain_GBps"]
        row["ucx_mac_vs_zmq_mac"] = row["ucx_mac_GBps"] / row["zmq_mac_GBps"]
        rows.append(row)
        print(
            f"  ucx/zmq {shape}: zmq {row['zmq_plain_GBps']:.2f}  ucx {row['ucx_plain_GBps']:.2f}  "
            f"zmq mac {row['zmq_mac_GBps']:.2f}  ucx mac {row['ucx_mac_GBps']:.2f} GB/s",
            flush=True,
        )
    version = ".".join(map(str, ucx.lib().get_ucx_version()))
    return {"available": True, "ucx_version": version, "ucx_tls": os.environ["UCX_TLS"], "rows": rows}
