"""The worker side of the transport benchmark (run in its own process): gradient messages
taken by the worker's own :class:`shadow.transport.FrameReceiver` on a socket from the
worker's :class:`shadow.transport.SocketFactory` -- header and context checks, run table,
payloads into a target buffer or kept zero-copy, the tag of every part (xxh3 without keys,
the rank's GMAC with them) -- and what it cost. Two sockets: one in clear (no keys, and a
keyed cluster's ``security.data=mac``) and one CURVE server with a guard admitting the
trainer key (``security.data=curve``)."""

from __future__ import annotations

import json
import resource
import time

import numpy as np
import zmq

from shadow import security
from shadow.config.tuning import Tuning
from shadow.transport import Context, FrameReceiver, SocketFactory, data_limit
from shadow.wire import frames as F
from shadow.wire import tags

TUNING = Tuning.load()  # the knobs, as the services would read them here

JOB, EPOCH, LAYOUT = 0x5EED, 7, 0xC0FFEE  # the header's context fields (checked by the receiver)
RECV_TIMEOUT_S = 30.0
MIB = 1 << 20
RING_BYTES = 64 * MIB  # staging ring / gradient buffer, per side
#: variant -> (security: plain, mac or curve; how the message is taken: bare, into or zc)
VARIANTS = {
    "bare": ("plain", "bare"),
    "shadow_into": ("plain", "into"),
    "shadow_zc": ("plain", "zc"),
    "mac_into": ("mac", "into"),
    "mac_zc": ("mac", "zc"),
    "curve_bare": ("curve", "bare"),
    "curve_zc": ("curve", "zc"),
}


def layout(sizes: list[int]) -> tuple[int, int, list[tuple[int, int]]]:
    """(slots, slot elements, [(offset in slot, nelem)]) for messages of ``sizes``."""
    per = sum(sizes)
    slots = max(4, RING_BYTES // (4 * per))
    offs, o = [], 0
    for n in sizes:
        offs.append((o, n))
        o += n
    return slots, per, offs


def _minflt() -> int:
    """Minor page faults of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- receiver (the worker) ----------------------------------------------------------------------
def take_grad_message(rx: FrameReceiver, ctx: Context, target, seq: int, zero_copy: bool, keep: list) -> int:
    """One GRAD message through the worker's own receiver, in the order
    ``shadow.worker.data.DataPath.take`` calls it: header and context, run table,
    the sequence number (here every message arrives in order), then the parts.
    ``zero_copy``: :meth:`FrameReceiver.runs_kept` (the worker's GRAD path: the frames are
    kept in ``keep``, as the worker keeps them in the inbox slot for the replay kernel);
    otherwise :meth:`FrameReceiver.runs_into` at each run's place in ``target`` (the
    worker's STATE path). Returns the payload bytes taken."""
    h = rx.header(ctx)
    rx.check_runs(h, ctx)
    if h.seq != seq:
        raise F.FrameError("gap", f"seq {h.seq}, expected {seq}")
    if zero_copy:
        total, parts = rx.runs_kept(h, ctx.lo)
        keep.extend(parts)
    else:
        total = rx.runs_into(h, target, ctx.lo)
    return 4 * total


def receiver_main(conn) -> None:
    """The worker side: a PULL socket in clear and a CURVE one, driven by JSON commands on
    ``conn``."""
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}
    guard = None
    keys: tuple = ()
    target = np.zeros(0, np.float32)
    nparts = 0
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            op = cmd["op"]
            if op == "bind":  # as the worker's DataPath.open, in clear and with CURVE
                if guard is None:
                    guard = security.Guard(cmd["server_key"], {"trainer": cmd["allow_trainers"]})
                keys = tags.for_ranks(bytes.fromhex(cmd["data_key"]), 1)
                eps = {}
                for name, curve in (("plain", False), ("curve", True)):
                    sock = SocketFactory(ctx, guard=guard).pull(
                        data_limit(TUNING), TUNING.data_rcvhwm_messages, curve=curve
                    )
                    if cmd["transport"] == "tcp":
                        ep = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                    else:
                        ep = f"ipc://{cmd['path']}-{name}"
                        sock.bind(ep)
                    socks[name], eps[name] = sock, ep
                conn.send_bytes(json.dumps({"endpoints": eps}).encode())
            elif op == "shape":
                slots, per, offs = layout(cmd["sizes"])
                target = np.empty(slots * per, np.float32)  # the worker's gradient buffer
                target.fill(0.0)  # fault the pages in
                nparts = len(offs)
                conn.send_bytes(b'{"ok": true}')
            elif op == "run":
                sec = VARIANTS[cmd["variant"]][0]
                sock = socks["curve" if sec == "curve" else "plain"]
                got = _receive(sock, cmd, target, nparts, keys if sec != "plain" else ())
                conn.send_bytes(json.dumps(got).encode())
            elif op == "unbind":
                for sock in socks.values():
                    sock.close(linger=0)
                socks.clear()
                conn.send_bytes(b'{"ok": true}')
            elif op == "exit":
                break
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        if guard is not None:
            guard.stop()
        ctx.term()


def _receive(sock, cmd: dict, target, nparts: int, keys: tuple) -> dict:
    """Take ``cmd['n']`` messages of one variant; the loop is the worker's: poll, then
    drain up to 256 messages with NOBLOCK header receives. ``keys``: the ranks' tags (a
    keyed variant)."""

    variant, n, seq = cmd["variant"], cmd["n"], cmd["seq0"]
    take = VARIANTS[variant][1]
    zero_copy = take == "zc"
    ctx = Context(JOB, EPOCH, LAYOUT, 1, 0, target.shape[0], keys=keys)
    rx = FrameReceiver(sock, TUNING)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    got = errors = 0
    nbytes = 0
    first_error = ""
    f0, c0, t0 = _minflt(), time.process_time(), time.perf_counter()
    last = time.monotonic()
    while got < n:
        if not poller.poll(timeout=50):
            if time.monotonic() - last > RECV_TIMEOUT_S:
                return {"error": f"timeout after {got} of {n} messages"}
            continue
        last = time.monotonic()
        for _ in range(256):
            if got >= n:
                break
            if take == "bare":
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                got += 1
                if len(parts) != nparts:
                    errors += 1
                    first_error = first_error or f"{len(parts)} parts, expected {nparts}"
                nbytes += sum(p.buffer.nbytes for p in parts)
                continue
            keep: list = []
            try:
                nbytes += take_grad_message(rx, ctx, target, seq, zero_copy, keep)
            except zmq.Again:
                break
            except F.FrameError as exc:
                errors += 1
                first_error = first_error or str(exc)
                rx.discard_rest()
            got += 1
            seq += 1
            del keep  # the worker would hand these to the replay, then drop them
    return {
        "n": got,
        "bytes": nbytes,
        "errors": errors,
        "first_error": first_error,
        "recv_cpu_s": time.process_time() - c0,
        "recv_wall_s": time.perf_counter() - t0,
        "recv_minflt": _minflt() - f0,
    }
