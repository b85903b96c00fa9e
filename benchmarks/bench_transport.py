"""Data-plane throughput: the shadow's gradient framing and validation over ZeroMQ against
a bare pyzmq PUSH/PULL of the same part sizes, in the same run, over tcp and ipc.

    python benchmarks/bench_transport.py [--quick] [--rounds 3] [--seconds 1.0] [--json PATH]

A sender process (the trainer) and a receiver process (one worker), started with
multiprocessing "spawn", on the production sockets: the trainer's channel is a
``shadow.transport.ZmqDataSender`` (PUSH, SNDHWM = Tuning.sndhwm_messages), the worker's a PULL
socket from ``shadow.transport.SocketFactory`` with the data path's RCVHWM and message
size limit, bound to a free port on 127.0.0.1 or to ``ipc://<tmpdir>/x``. The control
channel between the two is a local pipe carrying JSON; only the measured messages go over
ZeroMQ.

Variants, measured in interleaved rounds (the figure is the median round):

* bare: the same parts, ``send_multipart(copy=False)`` / ``recv_multipart(copy=False)``,
  no header, no checksums;
* shadow recv_into: the sender frames each message like ``Sender._send_payload`` (xxh3
  of every part, ``F.Header(...).pack()`` run table, parts as memoryviews of a float32
  staging ring, sent zero-copy through the DataSender, a ring slot is reused only once its
  tracker is done); the receiver runs the worker's own ``shadow.transport.FrameReceiver``
  (header, context, run table, sequence, each part's size and xxh3) and takes the parts
  with ``runs_into``: each lands at its destination in a preallocated buffer (the path
  of the worker's STATE messages);
* shadow zero-copy: as above, with ``runs_kept``: each part stays in its frame and is
  checked there (the worker's path for GRAD messages, the one the replay kernel reads);
* keyed, ``security.data=mac``: the same two paths on the same socket in clear, each part
  and the header tagged with the rank's GMAC (``shadow.wire.tags.DataKey``) instead of xxh3;
* keyed, ``security.data=curve``: bare pyzmq and the shadow's zero-copy path (GMACs too) on
  a CURVE socket: the trainer's key, the receiver's server pair and ZAP guard
  (``shadow.security.Guard``), as a keyed cluster's data socket before ``mac`` existed.

Messages: ``gpt-bucket`` is one 25 MB DDP bucket of a GPT-2-small block in DDP's reverse
parameter order (10 runs: three 2-9 MB matrices, a 7 MB one, KB-sized biases and norms),
plus single-run messages of 64 KiB, 1 MiB and 16 MiB, and 256 runs of 4 KiB (per-run
overhead). Destinations advance through a >= 64 MiB buffer on both sides, so
small messages are not served from a hot cache. GB/s counts payload bytes (1e9) from the
sender's first send to the receiver's report that the last message is validated. The run
also measures, in-process, the speed per part size of xxh3, memcpy and the MACs a keyed
data path could use (GMAC, Poly1305, HMAC-SHA256, keyed BLAKE2b, and keyed BLAKE3 where the
``blake3`` package is installed), and each side's CPU seconds and minor page faults per GB
(all threads, zmq's I/O thread included); and a worker's files socket (a restore reading
the node-local tier through a worker), in process, without keys, ``mac`` and ``curve``.
It then measures the UCX data path (``transport.data=ucx``) against ZeroMQ per connection,
both over TCP on loopback, the shadow's zero-copy path with checksums and with MACs
(``transport_ucx``; skipped with ``--no-ucx`` or where UCX for Python is not installed).
Goals: shadow >= 0.8x bare; keyed (mac) >= 0.8x plain, both zero-copy and on the files
socket; UCX >= 0.9x ZeroMQ on a 25 MB bucket.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import transport_ucx
import zmq
from benchlib import Goal, bars, machine_info, pyplot, save
from transport_receiver import (
    EPOCH,
    JOB,
    LAYOUT,
    RECV_TIMEOUT_S,
    RING_BYTES,
    VARIANTS,
    _minflt,
    layout,
    receiver_main,
)

from shadow import security
from shadow.config.tuning import Tuning
from shadow.transport import ZmqDataSender
from shadow.wire import frames as F
from shadow.wire import tags

TUNING = Tuning.load()  # the knobs, as the services would read them here

ROOT = Path(__file__).resolve().parents[1]

KIB, MIB = 1 << 10, 1 << 20
GOALS = [
    Goal("{transport} {shape}: shadow (zero-copy) / bare pyzmq", "rows.*.zc_vs_bare", 0.8, ">=", "x"),
    Goal(
        "{transport} {shape}: keyed mac / no keys (zero-copy)",
        "rows.*.mac_vs_plain",
        0.8,
        ">=",
        "x",
        where={"shape": "gpt-bucket"},
    ),
    Goal("{transport} {shape}: keyed curve / no keys (zero-copy)", "rows.*.curve_vs_plain", None),
    Goal("files socket: keyed mac / no keys", "files.mac_vs_plain", 0.8, ">=", "x"),
    Goal("files socket: keyed curve / no keys", "files.curve_vs_plain", None),
    Goal(
        "ucx {shape}: UCX / ZeroMQ over tcp (zero-copy)",
        "ucx.rows.*.ucx_vs_zmq",
        0.9,
        ">=",
        "x",
        where={"shape": "gpt-bucket"},
    ),
    Goal(
        "ucx {shape}: UCX / ZeroMQ over tcp (zero-copy)", "ucx.rows.*.ucx_vs_zmq", None, where={"shape": "!gpt-bucket"}
    ),
    Goal("ucx {shape}: UCX mac / ZeroMQ mac over tcp", "ucx.rows.*.ucx_mac_vs_zmq_mac", None),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK: list[str] = []
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--quick", "--rounds", "1", "--seconds", "0.05"]


def gpt_bucket(cap_bytes: int = 25 * MIB, d: int = 768) -> list[int]:
    """Elements per run of one DDP bucket: a GPT-2 block's parameters in reverse order,
    filled until the bucket reaches ``cap_bytes`` (DDP closes a bucket once it is full)."""
    block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]  # ln_1 .. mlp.c_proj
    out, total = [], 0
    for n in reversed(block):
        out.append(n)
        total += 4 * n
        if total >= cap_bytes:
            break
    return out


def message_shapes() -> dict[str, list[int]]:
    return {
        "gpt-bucket": gpt_bucket(),
        "64KiB x1": [64 * KIB // 4],
        "1MiB x1": [MIB // 4],
        "16MiB x1": [16 * MIB // 4],
        "4KiB x256": [4 * KIB // 4] * 256,
    }


# -- sender (the trainer) -------------------------------------------------------------------
class Sender:
    """The trainer side: one PUSH socket per transport, a float32 staging ring per shape."""

    def __init__(self, ctx, endpoints: dict[str, str], keys: security.ClientKeys, data_key: bytes) -> None:
        security.set_client(keys)  # the trainer's key, for its CURVE channel
        # as Sender.open_data: channel 0 in clear (no keys, or mac), channel 1 CURVE
        self.out = ZmqDataSender(
            ctx, [endpoints["plain"], endpoints["curve"]], TUNING.sndhwm_messages, curve=[False, True]
        )
        self.keyed = tags.DataKey(tags.rank_key(data_key, 0))
        self.seq = 0
        self.iteration = 1

    def use_shape(self, sizes: list[int]) -> None:

        self.slots, self.per, self.offs = layout(sizes)
        rng = np.random.default_rng(0)
        self.ring = rng.standard_normal(self.slots * self.per, dtype=np.float32)
        self.msg_bytes = 4 * self.per

    def send(self, variant: str, n: int) -> None:
        sec, take = VARIANTS[variant]
        channel = 1 if sec == "curve" else 0
        tagger = tags.PLAIN if sec == "plain" else self.keyed
        sock, ring, per, offs, slots = self.out.socks[channel], self.ring, self.per, self.offs, self.slots
        if take == "bare":  # the same socket, unframed
            for i in range(n):
                base = (i % slots) * per
                sock.send_multipart([memoryview(ring[base + o : base + o + k]) for o, k in offs], copy=False)
            return
        trackers = [None] * slots
        for i in range(n):
            s = i % slots
            t = trackers[s]
            if t is not None and not t.done:  # the ring slot is still owned by zmq
                t.wait()
            base = s * per
            # as Sender._send_payload: views of the ring, each tagged, header with the run table
            runs = [(base + o, base + o, k) for o, k in offs]  # (src, dst, n)
            views = [ring[src : src + k] for src, _, k in runs]
            nonce = tagger.nonce()
            table = [(dst, k, tagger.tag(nonce, j, views[j - 1])) for j, (_, dst, k) in enumerate(runs, 1)]
            hdr = F.Header(
                F.Kind.GRAD, F.Field.GRAD, JOB, EPOCH, 0, 1, LAYOUT, self.iteration, self.seq, tuple(table), nonce
            ).pack(tagger)
            self.seq += 1
            trackers[s] = self.out.send(channel, [hdr] + [memoryview(v) for v in views], track=True)
        self.iteration += 1

    def close(self) -> None:
        self.out.close()
        security.set_client(None)


# -- orchestration -------------------------------------------------------------------------
def _ask(conn, msg: dict, timeout: float = 120.0) -> dict:
    conn.send_bytes(json.dumps(msg).encode())
    if not conn.poll(timeout):
        raise RuntimeError(f"receiver did not answer {msg['op']!r} within {timeout:.0f} s")
    reply = json.loads(conn.recv_bytes())
    if "error" in reply:
        raise RuntimeError(f"receiver: {reply['error']}")
    return reply


def measure(conn, sender: Sender, variant: str, n: int) -> dict:
    seq0 = sender.seq
    conn.send_bytes(json.dumps({"op": "run", "variant": variant, "n": n, "seq0": seq0}).encode())
    f0, c0, t0 = _minflt(), time.process_time(), time.perf_counter()
    sender.send(variant, n)
    if not conn.poll(RECV_TIMEOUT_S + 60):
        raise RuntimeError(f"receiver did not finish {variant} ({n} messages)")
    t1, c1, f1 = time.perf_counter(), time.process_time(), _minflt()
    r = json.loads(conn.recv_bytes())
    if "error" in r:
        raise RuntimeError(f"receiver ({variant}): {r['error']}")
    if r["errors"]:
        raise RuntimeError(f"receiver rejected {r['errors']} {variant} messages, first: {r['first_error']}")
    payload = n * sender.msg_bytes
    if r["bytes"] != payload:
        raise RuntimeError(f"receiver got {r['bytes']} payload bytes, sent {payload}")
    gb = payload / 1e9
    return {
        "GBps": gb / (t1 - t0),
        "s": t1 - t0,
        "send_cpu_s_per_GB": (c1 - c0) / gb,
        "recv_cpu_s_per_GB": r["recv_cpu_s"] / gb,
        "send_minflt_per_GB": (f1 - f0) / gb,
        "recv_minflt_per_GB": r["recv_minflt"] / gb,
    }


def _candidates() -> dict:
    """What a part's check could cost, each a function of a float32 view: the checksum of a
    wire without keys, a memcpy, and the MACs weighed for a keyed one (one thread each)."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives import poly1305

    key = bytes(range(32))
    gmac = tags.DataKey(key)
    nonce = gmac.nonce()
    out = {
        "xxh3": F.checksum,
        "gmac": lambda v: gmac.tag(nonce, 1, v),
        "poly1305": lambda v: poly1305.Poly1305.generate_tag(key, v.data.cast("B")),
        "hmac_sha256": lambda v: hmac.digest(key, v.data.cast("B"), "sha256"),
        "blake2b": lambda v: hashlib.blake2b(v.data.cast("B"), key=key, digest_size=16).digest(),
    }
    try:
        import blake3  # not a dependency: measured where it is installed

        out["blake3"] = lambda v: blake3.blake3(v.data.cast("B"), key=key).digest(16)
    except ImportError:
        pass
    return out


def local_costs(quick: bool) -> dict:
    """In-process GB/s by part size of a memcpy (np.copyto), xxh3_64 (F.checksum) and each
    MAC a keyed data path could use (:func:`_candidates`), walking a 64 MiB buffer."""
    out = {}
    span = RING_BYTES // 4
    src = np.random.default_rng(1).standard_normal(span, dtype=np.float32)
    dst = np.empty_like(src)
    dst.fill(0.0)
    budget = 0.1 if quick else 0.25
    cands = _candidates()
    for name, nbytes in (("64KiB", 64 * KIB), ("1MiB", MIB), ("16MiB", 16 * MIB)):
        k = nbytes // 4
        slots = span // k
        res = {}
        for what in ("memcpy", *cands):
            reps, t = 0, 0.0
            t0 = time.perf_counter()
            while t < budget:  # walk the 64 MiB buffer, as the ring does
                s = (reps % slots) * k
                if what == "memcpy":
                    np.copyto(dst[s : s + k], src[s : s + k])
                else:
                    cands[what](src[s : s + k])
                reps += 1
                t = time.perf_counter() - t0
            res[what + "_GBps"] = reps * nbytes / t / 1e9
        out[name] = res
    return out


def files_socket(keydir: Path, tmp: str, quick: bool, rounds: int) -> dict:
    """GB/s of one shard file read through a worker's files socket (``FileServer``, on its
    own thread in this process; the client is ``shadow.restore.files_client.read_file``):
    without keys, in ``mac`` mode (in clear, a ticket, a GMAC per chunk) and in ``curve``
    mode (a CURVE server admitting a client key), in interleaved rounds, each round in a
    seeded random order; the file sits in the page cache."""
    import random

    from shadow.restore.files_client import read_file
    from shadow.transport import SocketFactory
    from shadow.worker.address import Binding
    from shadow.worker.files import FileServer

    nbytes = (64 if quick else 192) * MIB
    job = "bench"
    root = os.path.join(tmp, "files")
    d = os.path.join(root, job, "iteration-0000000001")
    os.makedirs(d)
    name = "shard-00000-of-00001.safetensors"
    with open(os.path.join(d, name), "wb") as f:
        f.write(np.random.default_rng(2).bytes(nbytes))
    security.generate(keydir / "clients", "client")
    reader = security.client_keys(keydir / "server.key", keydir / "clients" / "client.key_secret")
    ctx = zmq.Context()
    guard = security.Guard(keydir / "server.key_secret", {"client": keydir / "clients"})
    guard.start(ctx)
    binding = Binding("127.0.0.1", "127.0.0.1")
    servers = {
        "plain": FileServer(SocketFactory(ctx), binding, root),
        "mac": FileServer(SocketFactory(ctx), binding, root, keyed=True),
        "curve": FileServer(SocketFactory(ctx, guard=guard), binding, root),
    }
    tuning = TUNING.replace(fetch_timeout_s=60.0)
    shard = {"file": name, "bytes": nbytes}
    times: dict[str, list[float]] = {v: [] for v in servers}
    try:
        for srv in servers.values():
            srv.open()

        def once(v: str) -> float:
            srv, auth = servers[v], None
            if srv.key is not None:  # what the coordinator hands a reader (WorkerRec.files_ticket)
                ticket = tags.files_ticket(srv.key)
                auth = (ticket, tags.ticket_key(srv.key, ticket))
            if v == "curve":
                security.set_client(reader)
            try:
                t0 = time.perf_counter()
                data = read_file(srv.endpoint, job, "iteration-0000000001", shard, tuning, auth)
                dt = time.perf_counter() - t0
            finally:
                security.set_client(None)
            assert len(data) == nbytes
            return dt

        order = random.Random(7)
        for v in servers:  # warm-up: connections, the page cache
            once(v)
        for _ in range(rounds):
            names = list(servers)
            order.shuffle(names)
            for v in names:
                times[v].append(once(v))
    finally:
        for srv in servers.values():
            srv.close()
        guard.stop()
        ctx.term()
    out: dict = {"bytes": nbytes, "rounds": rounds}
    for v, ts in times.items():
        out[v + "_GBps"] = nbytes / statistics.median(ts) / 1e9
        out[v + "_s_rounds"] = ts
    out["mac_vs_plain"] = out["mac_GBps"] / out["plain_GBps"]
    out["curve_vs_plain"] = out["curve_GBps"] / out["plain_GBps"]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short measurements (whole run < 60 s)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds per cell (default 3)")
    ap.add_argument(
        "--seconds", type=float, default=0.0, help="target seconds per measurement (default 1.0, --quick 0.25)"
    )
    ap.add_argument("--transports", default="tcp,ipc")
    ap.add_argument("--no-ucx", action="store_true", help="leave out the UCX data path's rows")
    ap.add_argument("--json", default="")
    return ap


def run(args) -> dict:
    """Measure every transport x message shape, print the tables; the JSON document."""
    rounds = args.rounds or 3
    target_s = args.seconds or (0.25 if args.quick else 1.0)
    transports = [t for t in args.transports.split(",") if t]

    started = time.perf_counter()
    shapes = message_shapes()
    info = machine_info()
    costs = local_costs(args.quick)
    tmp = tempfile.mkdtemp(prefix="shadow-bench-transport-")
    keydir = Path(tmp) / "keys"  # a keyed cluster's: the server pair, a trainer's pair, its allow list
    security.generate(keydir, "server")
    security.generate(keydir / "trainers", "trainer")
    trainer_keys = security.client_keys(keydir / "server.key", keydir / "trainers" / "trainer.key_secret")
    data_key = tags.new_key()  # the coordinator's for this worker's configuration
    mpc = mp.get_context("spawn")
    parent, child = mpc.Pipe()
    proc = mpc.Process(target=receiver_main, args=(child,), name="bench-receiver", daemon=True)
    proc.start()
    child.close()
    ctx = zmq.Context()
    rows = []
    try:
        for transport in transports:
            eps = _ask(
                parent,
                {
                    "op": "bind",
                    "transport": transport,
                    "path": os.path.join(tmp, "x"),
                    "server_key": str(keydir / "server.key_secret"),
                    "allow_trainers": str(keydir / "trainers"),
                    "data_key": data_key.hex(),
                },
            )["endpoints"]
            sender = Sender(ctx, eps, trainer_keys, data_key)
            try:
                for shape, sizes in shapes.items():
                    sender.use_shape(sizes)
                    _ask(parent, {"op": "shape", "sizes": sizes})
                    # warm-up and calibration: every variant once, its message count from its own rate
                    n_warm = max(8, (2 * RING_BYTES) // sender.msg_bytes)
                    warm = {v: measure(parent, sender, v, n_warm) for v in VARIANTS}
                    counts = {v: max(8, round(target_s * warm[v]["GBps"] * 1e9 / sender.msg_bytes)) for v in VARIANTS}
                    names = list(VARIANTS)
                    per: dict[str, list[dict]] = {v: [] for v in VARIANTS}
                    for r in range(rounds):  # interleaved, rotating the order: drift hits all alike
                        order = names[r % len(names) :] + names[: r % len(names)]
                        for v in order:
                            per[v].append(measure(parent, sender, v, counts[v]))
                    row = {
                        "transport": transport,
                        "shape": shape,
                        "parts": len(sizes),
                        "bytes_per_msg": sender.msg_bytes,
                        "messages": counts,
                        "rounds": rounds,
                    }
                    for v in VARIANTS:
                        row[v + "_GBps"] = statistics.median(m["GBps"] for m in per[v])
                        row[v + "_GBps_rounds"] = [m["GBps"] for m in per[v]]
                        for k in ("send_cpu_s_per_GB", "recv_cpu_s_per_GB", "send_minflt_per_GB", "recv_minflt_per_GB"):
                            row[f"{v}_{k}"] = statistics.median(m[k] for m in per[v])
                    row["into_vs_bare"] = row["shadow_into_GBps"] / row["bare_GBps"]
                    row["zc_vs_bare"] = row["shadow_zc_GBps"] / row["bare_GBps"]
                    row["mac_vs_plain"] = row["mac_zc_GBps"] / row["shadow_zc_GBps"]
                    row["mac_into_vs_plain"] = row["mac_into_GBps"] / row["shadow_into_GBps"]
                    row["curve_vs_plain"] = row["curve_zc_GBps"] / row["shadow_zc_GBps"]
                    rows.append(row)
                    print(
                        f"  {transport} {shape}: bare {row['bare_GBps']:.2f}  into {row['shadow_into_GBps']:.2f}  "
                        f"zc {row['shadow_zc_GBps']:.2f}  mac zc {row['mac_zc_GBps']:.2f}  "
                        f"curve zc {row['curve_zc_GBps']:.2f} GB/s  ({rounds} rounds)",
                        flush=True,
                    )
            finally:
                sender.close()
                _ask(parent, {"op": "unbind"})
    finally:
        try:
            parent.send_bytes(b'{"op": "exit"}')
        except (BrokenPipeError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()
        ctx.term()
    files = files_socket(keydir, tmp, args.quick, max(rounds, 5))
    shutil.rmtree(tmp, ignore_errors=True)
    ucx_shapes = {k: shapes[k] for k in ("gpt-bucket", "1MiB x1")}
    ucx = (
        {"available": False, "why": "--no-ucx", "rows": []}
        if args.no_ucx
        else transport_ucx.measure(ucx_shapes, max(rounds, 5) if not args.quick else rounds, target_s)
    )
    elapsed = time.perf_counter() - started

    print(
        f"\nshadow framing + validation vs bare pyzmq, one sender -> one receiver process, "
        f"median of {rounds} rounds (~{target_s:g} s each); GB/s of payload per worker"
    )
    print(
        f"{info['cpu']}, {info['cores']} cores; Python {info['python']}, pyzmq {info['pyzmq']}, "
        f"libzmq {info['libzmq']}, xxhash {info['xxhash']}"
    )
    print(
        "| transport | shape | parts | MB/msg | bare GB/s | shadow recv_into GB/s | ratio | "
        "shadow zero-copy GB/s | ratio | goal >= 0.8x |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ok = (
            "yes"
            if min(r["into_vs_bare"], r["zc_vs_bare"]) >= 0.8
            else ("zc only" if r["zc_vs_bare"] >= 0.8 else ("into only" if r["into_vs_bare"] >= 0.8 else "no"))
        )
        print(
            f"| {r['transport']} | {r['shape']} | {r['parts']} | {r['bytes_per_msg'] / 1e6:.2f} | "
            f"{r['bare_GBps']:.2f} | {r['shadow_into_GBps']:.2f} | {r['into_vs_bare']:.2f}x | "
            f"{r['shadow_zc_GBps']:.2f} | {r['zc_vs_bare']:.2f}x | {ok} |"
        )
    print("\nwith keys: security.data=mac (in clear, GMAC per part) and curve (CURVE-encrypted too), GB/s")
    print(
        "| transport | shape | no keys zc | mac zc | ratio (goal >= 0.8x) | no keys into | mac into | ratio | "
        "curve bare | curve zc | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['transport']} | {r['shape']} | {r['shadow_zc_GBps']:.2f} | {r['mac_zc_GBps']:.2f} | "
            f"{r['mac_vs_plain']:.2f}x | {r['shadow_into_GBps']:.2f} | {r['mac_into_GBps']:.2f} | "
            f"{r['mac_into_vs_plain']:.2f}x | {r['curve_bare_GBps']:.2f} | {r['curve_zc_GBps']:.2f} | "
            f"{r['curve_vs_plain']:.2f}x |"
        )
    for title, fmt in (
        (
            "CPU seconds per GB of payload (whole process, zmq I/O thread included), sender / receiver",
            lambda r, v: f"{r[v + '_send_cpu_s_per_GB']:.3f} / {r[v + '_recv_cpu_s_per_GB']:.3f}",
        ),
        (
            "minor page faults per GB of payload (thousands), sender / receiver",
            lambda r, v: f"{r[v + '_send_minflt_per_GB'] / 1e3:.1f} / {r[v + '_recv_minflt_per_GB'] / 1e3:.1f}",
        ),
    ):
        print("\n" + title)
        print("| transport | shape | " + " | ".join(VARIANTS) + " |")
        print("|---|---|" + "---|" * len(VARIANTS))
        for r in rows:
            print(f"| {r['transport']} | {r['shape']} | " + " | ".join(fmt(r, v) for v in VARIANTS) + " |")
    print("\nin-process GB/s by part size, one thread, walking a 64 MiB buffer")
    what = [k.removesuffix("_GBps") for k in next(iter(costs.values()))]
    print("| part | " + " | ".join(what) + " |")
    print("|---|" + "---|" * len(what))
    for name, c in costs.items():
        print(f"| {name} | " + " | ".join(f"{c[w + '_GBps']:.2f}" for w in what) + " |")
    print(
        f"\na worker's files socket, one {files['bytes'] >> 20} MiB shard file (page cache) read by a restore "
        f"client in this process, median of {files['rounds']} rounds, GB/s"
    )
    print("| no keys | mac | ratio (goal >= 0.8x) | curve | ratio |")
    print("|---|---|---|---|---|")
    print(
        f"| {files['plain_GBps']:.2f} | {files['mac_GBps']:.2f} | {files['mac_vs_plain']:.2f}x | "
        f"{files['curve_GBps']:.2f} | {files['curve_vs_plain']:.2f}x |"
    )
    if ucx["rows"]:
        print(
            f"\nthe UCX data path (UCX {ucx['ucx_version']}, UCX_TLS={ucx['ucx_tls']}) against "
            "ZeroMQ tcp, one connection each, shadow zero-copy path, GB/s"
        )
        print("| shape | zmq | ucx | ratio (goal >= 0.9x) | zmq mac | ucx mac | ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in ucx["rows"]:
            print(
                f"| {r['shape']} | {r['zmq_plain_GBps']:.2f} | {r['ucx_plain_GBps']:.2f} | {r['ucx_vs_zmq']:.2f}x | "
                f"{r['zmq_mac_GBps']:.2f} | {r['ucx_mac_GBps']:.2f} | {r['ucx_mac_vs_zmq_mac']:.2f}x |"
            )
    else:
        print(f"\nthe UCX data path: not measured ({ucx['why']})")
    print(f"total {elapsed:.0f} s")
    return {
        "machine": info,
        "quick": args.quick,
        "rounds": rounds,
        "target_s": target_s,
        "socket_options": {
            "push": {"LINGER": 0, "SNDHWM": TUNING.sndhwm_messages},
            "pull": {"LINGER": 0, "RCVHWM": 0},
        },
        "ring_bytes": RING_BYTES,
        "shapes": shapes,
        "rows": rows,
        "local_costs": costs,
        "files": files,
        "ucx": ucx,
        "goal": "shadow >= 0.8x bare",
        "elapsed_s": elapsed,
    }


def plot(results: dict, path) -> bool:
    """GB/s of bare pyzmq and the shadow (zero-copy) per transport and message shape."""
    plt = pyplot()
    if plt is None:
        return False
    rows = results["rows"]
    if not rows:
        return bars(path, [], [], "Gradient transport", "GB/s")
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{r['transport']}\n{r['shape']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.3 for i in x], [r["bare_GBps"] for r in rows], 0.2, label="bare pyzmq")
    ax.bar([i - 0.1 for i in x], [r["shadow_zc_GBps"] for r in rows], 0.2, label="shadow, no keys")
    ax.bar([i + 0.1 for i in x], [r["mac_zc_GBps"] for r in rows], 0.2, label="shadow, keys: mac")
    ax.bar([i + 0.3 for i in x], [r["curve_zc_GBps"] for r in rows], 0.2, label="shadow, keys: curve")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("Gradient transport, one sender -> one worker")
    ax.legend(fontsize=8)
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
