"""Which UCX API the data path should move to: stream (what ``transport.data=ucx`` uses)
against active messages, on bare UCX for Python, one connection, one process to another.

    python benchmarks/ucx_protocols.py [--rounds 5] [--sizes 1,28] [--count-mib 800]

A design study for the "tag-matched rendezvous" step in docs/ucx.md, not a measurement of
the shadow's data path (that is ``bench_transport``'s UCX table). Both ends run UCX's own
progress thread; error handling is on; ``UCX_TLS=tcp`` and 1 MiB TCP segments unless the
environment sets them, as the data path does. Per message:

* stream: a 16-byte preamble and the body, received as the worker does, into a fresh
  buffer per message: the preamble first, then the body, sized from it;
* am: the body as one active message. UCX allocates the receive buffer per message, and
  above its rendezvous threshold it pulls the bytes only once the receiver takes them.

Each (API, size) runs in its own pair of processes; the pairs alternate, and each prints
the median of its rounds after a first one that warms up, in GB/s of payload, timed at the receiver.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import numpy as np

MIB = 1 << 20
APIS = ("stream", "am")
SLOTS = 64
IN_FLIGHT = 32


def _env() -> None:
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "1M")
    os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "1M")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _worker():
    from ucxx._lib import libucxx as L

    F = L.Feature
    ctx = L.UCXContext(feature_flags=(F.STREAM, F.AM, F.WAKEUP))
    worker = L.UCXWorker(ctx, enable_delayed_submission=False, enable_python_future=False)
    worker.start_progress_thread(True)
    return L, ctx, worker


def _wait(req, deadline: float) -> None:
    while not req.completed:
        if time.monotonic() > deadline:
            raise TimeoutError("a UCX request did not complete in 120 s")
        time.sleep(0.00002)
    req.check_error()


def _receiver(api: str, size: int, n: int, rounds: int, q, done) -> None:
    _env()
    from ucxx._lib.arr import Array

    L, ctx, worker = _worker()
    eps: list = []
    box: list = []
    listener = L.UCXListener.create(
        worker, 0, lambda req, *_: eps.append(L.UCXEndpoint.create_from_conn_request(box[0], req, True))
    )
    box.append(listener)
    q.put(listener.port)
    while not eps:
        time.sleep(0.001)
    ep = eps[0]
    try:
        for _ in range(rounds):
            deadline = time.monotonic() + 120
            t0, got = time.perf_counter(), 0
            for _ in range(n):
                if api == "stream":
                    pre = np.empty(16, np.uint8)
                    _wait(ep.stream_recv(Array(pre)), deadline)
                    body = np.empty(int(pre.view(np.uint64)[1]), np.uint8)
                    _wait(ep.stream_recv(Array(body)), deadline)
                    got += body.nbytes
                else:
                    req = ep.am_recv()
                    _wait(req, deadline)
                    got += memoryview(req.recv_buffer).nbytes
            q.put((time.perf_counter() - t0, got))
        done.get(timeout=60)  # the sender is done with the connection
    except Exception as exc:  # reported by the sender
        q.put((0.0, f"{type(exc).__name__}: {exc}"))
        q.close()
        q.join_thread()  # before os._exit, which would drop what the queue's thread holds
    finally:
        worker.stop_progress_thread()
        os._exit(0)  # UCX for Python's destructors are not safe to run at exit


def _sender(api: str, size: int, n: int, rounds: int) -> list[float]:
    from ucxx._lib.arr import Array

    spawn = mp.get_context("spawn")
    q, done = spawn.Queue(), spawn.Queue()  # the receiver's reports; the sender's "done"
    proc = spawn.Process(target=_receiver, args=(api, size, n, rounds + 1, q, done), daemon=True)
    proc.start()
    port = q.get(timeout=120)
    L, ctx, worker = _worker()
    ep = L.UCXEndpoint.create(worker, "127.0.0.1", port, True)
    ring = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(SLOTS)]
    pre = np.zeros(2, np.uint64)
    pre[1] = size
    pre = pre.view(np.uint8)
    out = []
    try:
        for _ in range(rounds + 1):  # the first round warms up (the connection's set-up) and is dropped
            deadline = time.monotonic() + 120
            inflight: list[list] = []
            for i in range(n):
                if len(inflight) >= IN_FLIGHT:  # a ring slot is reused once its send is done
                    for req in inflight.pop(0):
                        _wait(req, deadline)
                body = Array(ring[i % SLOTS])
                if api == "stream":
                    inflight.append([ep.stream_send(Array(pre)), ep.stream_send(body)])
                else:
                    inflight.append([ep.am_send(body)])
            for reqs in inflight:
                for req in reqs:
                    _wait(req, deadline)
            while True:  # the receiver's result, or its death
                try:
                    dt, got = q.get(timeout=1)
                    break
                except queue.Empty:
                    if not proc.is_alive():
                        raise RuntimeError(f"{api}: the receiver died (exit code {proc.exitcode})") from None
                    if time.monotonic() > deadline + 60:
                        raise RuntimeError(f"{api}: the receiver reported nothing in 180 s") from None
            if isinstance(got, str):
                raise RuntimeError(f"{api}: the receiver failed: {got}")
            if got != n * size:
                raise RuntimeError(f"{api}: the receiver took {got} of {n * size} bytes")
            out.append(got / dt / 1e9)
        done.put("done")
        proc.join(30)
        out = out[1:]
    finally:
        if proc.is_alive():
            proc.kill()
        worker.stop_progress_thread()
    return out


def _one(api: str, size: int, n: int, rounds: int, conn) -> None:
    _env()
    try:
        conn.send(("ok", _sender(api, size, n, rounds)))
    except Exception as exc:  # reported by the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    conn.close()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="1,28", help="message sizes in MiB, comma-separated")
    ap.add_argument("--count-mib", type=int, default=800, help="MiB sent per round")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of processes per (API, size), alternating")
    args = ap.parse_args(argv)
    try:
        import ucxx  # noqa: F401
    except ImportError:
        print("UCX for Python is not installed: pip install 'shadow-checkpoint[ucx]'", file=sys.stderr)
        return 2
    spawn = mp.get_context("spawn")
    for mib in (int(s) for s in args.sizes.split(",")):
        size, n = mib * MIB, max(8, args.count_mib // mib)
        for rep in range(args.repeats):
            for api in APIS:
                parent, child = spawn.Pipe()
                proc = spawn.Process(target=_one, args=(api, size, n, args.rounds, child))
                proc.start()
                child.close()
                if not parent.poll(600):
                    proc.kill()
                    print(f"{mib:>3} MiB {api:6s}: no result in 600 s", flush=True)
                    continue
                status, value = parent.recv()
                proc.join(30)
                if status != "ok":
                    print(f"{mib:>3} MiB {api:6s}: {value}", flush=True)
                    continue
                rounds = " ".join(f"{v:.2f}" for v in value)
                print(
                    f"{mib:>3} MiB {api:6s} run {rep + 1}: median {statistics.median(value):.2f} GB/s "
                    f"(rounds {rounds}; {n} messages each)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
