"""The worker side of the transport benchmark (run in its own process): it receives
gradient messages the way a shadow worker does -- header and context checks, payloads into
a target buffer or kept zero-copy, xxh3 on every run -- and reports what it cost."""

from __future__ import annotations

import json
import resource
import time

import numpy as np
import zmq

from shadow import knobs
from shadow.wire import frames as F

JOB, EPOCH, LAYOUT = 0x5EED, 7, 0xC0FFEE  # the header's context fields (checked by the receiver)
RECV_TIMEOUT_S = 30.0
MIB = 1 << 20
RING_BYTES = 64 * MIB  # staging ring / gradient buffer, per side


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
class Rejected(ValueError):
    """A context check of the mirrored worker path failed (the worker raises F.FrameError)."""


def take_grad_message(
    sock, raw: bytes, target, lo: int, hi: int, max_runs: int, seq: int, zero_copy: bool, keep: list
) -> int:
    """MIRRORS shadow.worker.data.DataMixin._take_frame + _take_payload for a GRAD frame
    (keep in step with it): unpack and check the header, check its context (job, epoch,
    layout, world, sequence), range-check every run, then receive each payload part and
    verify its xxh3. ``zero_copy``: ``recv(copy=False)``, view the frame as float32 and
    checksum it there (the views are kept in ``keep``, as the worker keeps them in the
    inbox slot for the replay kernel); otherwise ``recv_into`` the part's place in
    ``target`` and checksum it there. Returns the payload bytes taken."""
    h = F.unpack_header(raw, max_runs)
    if h.epoch != EPOCH or h.job != JOB:
        raise Rejected(f"wrong_epoch: {h.job:#x}/{h.epoch}")
    if h.layout != LAYOUT:
        raise Rejected(f"wrong_layout: {h.layout:#x}")
    if h.world != 1:
        raise Rejected(f"bad_rank: world {h.world}")
    if h.iteration < 1:
        raise Rejected(f"old_iteration: {h.iteration}")
    if h.seq != seq:
        raise Rejected(f"gap: seq {h.seq}, expected {seq}")
    if h.kind != F.Kind.GRAD or h.field != F.Field.GRAD:
        raise Rejected(f"bad_kind: {h.kind}/{h.field}")
    for dst, nelem, _ in h.runs:
        if nelem == 0 or dst < lo or dst + nelem > hi:
            raise Rejected(f"out_of_range: [{dst}, {dst + nelem})")
    total = 0
    for dst, nelem, csum in h.runs:
        if not sock.getsockopt(zmq.RCVMORE):
            raise Rejected("truncated_payload: fewer payload frames than runs")
        if zero_copy:  # as the worker's _recv_part: the frame, viewed as float32, kept for the kernel
            frame = sock.recv(copy=False)
            got = len(frame)
            if got != nelem * 4:
                raise Rejected(f"truncated_payload: {got} bytes, run says {nelem * 4}")
            buf = np.frombuffer(frame.buffer, dtype=np.float32)
            keep.append((dst - lo, buf))
        else:
            buf = target[dst - lo : dst - lo + nelem]
            got = sock.recv_into(buf)
        if got != nelem * 4:
            raise Rejected(f"truncated_payload: {got} bytes, run says {nelem * 4}")
        if F.checksum(buf) != csum:
            raise Rejected(f"bad_checksum: payload at flat {dst} (+{nelem})")
        total += got
    if sock.getsockopt(zmq.RCVMORE):
        raise Rejected("extra_payload: more payload frames than runs")
    return total


def _discard_rest(sock) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv()


def receiver_main(conn) -> None:
    """The worker side: a PULL socket, driven by JSON commands on ``conn``."""
    ctx = zmq.Context()
    sock = None
    target = np.zeros(0, np.float32)
    nparts = 0
    max_runs = knobs.get_int("MAX_RUNS")
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            op = cmd["op"]
            if op == "bind":
                sock = ctx.socket(zmq.PULL)  # as server.py _open_data
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                if cmd["transport"] == "tcp":
                    ep = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                else:
                    ep = f"ipc://{cmd['path']}"
                    sock.bind(ep)
                conn.send_bytes(json.dumps({"endpoint": ep}).encode())
            elif op == "shape":
                slots, per, offs = layout(cmd["sizes"])
                target = np.empty(slots * per, np.float32)  # the worker's gradient buffer
                target.fill(0.0)  # fault the pages in
                nparts = len(offs)
                conn.send_bytes(b'{"ok": true}')
            elif op == "run":
                conn.send_bytes(json.dumps(_receive(sock, cmd, target, nparts, max_runs)).encode())
            elif op == "unbind":
                sock.close(linger=0)
                sock = None
                conn.send_bytes(b'{"ok": true}')
            elif op == "exit":
                break
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()


def _receive(sock, cmd: dict, target, nparts: int, max_runs: int) -> dict:
    """Take ``cmd['n']`` messages of one variant; the loop is the worker's: poll, then
    drain up to 256 messages with NOBLOCK header receives."""

    variant, n, seq = cmd["variant"], cmd["n"], cmd["seq0"]
    zero_copy = variant == "shadow_zc"
    lo, hi = 0, target.shape[0]
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
            if variant == "bare":
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
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
            keep: list = []
            try:
                nbytes += take_grad_message(sock, raw, target, lo, hi, max_runs, seq, zero_copy, keep)
            except ValueError as exc:  # F.FrameError and Rejected
                errors += 1
                first_error = first_error or str(exc)
                _discard_rest(sock)
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
