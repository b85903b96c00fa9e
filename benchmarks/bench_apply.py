"""The worker's per-iteration work before and after applying from the received frames
and folding the persistence snapshot into the apply pass.

    python benchmarks/bench_apply.py [--params 50e6] [--iters 6] [--threads 2] [--quick] [--json PATH]

A sender process streams one AdamW gradient of --params fp32 elements per iteration, as
DDP buckets of GPT-sized runs framed exactly like the trainer's sender (xxh3 per run,
``F.Header`` run table), over ipc to this process, which plays one worker holding the
whole range in two :class:`shadow.worker.shard.ShardState` copies:

* before: each run ``recv_into`` its place in a contiguous gradient buffer and checksummed
  there, then the replay kernel reads that buffer; a snapshot iteration then copies the
  fields into the persistence image (``np.copyto``, as ``ShardPersister.snapshot`` did);
* after (what the worker does now): each run is taken zero-copy (``recv(copy=False)``),
  checksummed on the frame, and the kernel reads the gradient from the frames where they
  lie (``ShardState.apply(parts)``); on a snapshot iteration the kernel also writes the new
  values into the image (``ShardState.apply(parts, snap=...)``);
* keyed: the after path on a keyed cluster (``security.data=mac``): the sender tags the
  header and every run with the rank's GMAC (``shadow.wire.tags``) instead of xxh3, and the
  receiver checks them under the keys of the worker's configuration.

Every iteration is sent three times, once for each path (the order rotating); the three
states must end bit-identical, and the folded snapshots must equal each other. Figures per
iteration (median): the worker's CPU seconds receiving (this process, zmq's I/O thread
included; waiting is not counted), the apply wall time, and the total CPU seconds per
iteration. Bytes moved per parameter count each pass over memory (the socket's write into
zmq's buffer included; fp32 AdamW without amsgrad).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Goal, pyplot, save

ROOT = Path(__file__).resolve().parents[1]

GOALS = [
    Goal("whole worker path / replay alone (CPU-s, same threads)", "whole_path_vs_replay_alone", 1.25, "<=", "x"),
    Goal("states bit-identical (before and after paths)", "bit_identical", True, "=="),
    Goal("folded snapshot identical to the copied one", "snapshot_identical", True, "=="),
    Goal(
        "worker CPU / iteration, {key} vs before",
        "paths.*.cpu_speedup_vs_before",
        None,
        unit="x",
        where={"key": "after*"},
    ),
    Goal("bytes moved / param, {key}", "paths.*.bytes_per_param", None),
    Goal("worker CPU-s / iteration / B params", "paths.after.cpu_s_per_iter_per_Bparams", None),
    Goal("worker CPU / iteration, keyed (mac) / no keys", "keyed_vs_plain_cpu", 1.2, "<=", "x"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--params", "20e6", "--iters", "5"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--params", "2e6", "--iters", "2", "--threads", "1"]

# bytes per parameter per iteration, by pass (see the module docstring)
PASSES = {
    "before": {"socket -> zmq buffer": 4, "recv_into copy": 8, "checksum": 4, "kernel": 28},
    "after": {"socket -> zmq buffer": 4, "checksum": 4, "kernel": 28},
    "before+snapshot": {
        "socket -> zmq buffer": 4,
        "recv_into copy": 8,
        "checksum": 4,
        "kernel": 28,
        "snapshot copy": 24,
    },
    "after+snapshot": {"socket -> zmq buffer": 4, "checksum": 4, "kernel + snapshot stores": 40},
    "keyed": {"socket -> zmq buffer": 4, "GMAC": 4, "kernel": 28},
    "keyed+snapshot": {"socket -> zmq buffer": 4, "GMAC": 4, "kernel + snapshot stores": 40},
}
PATHS = ("before", "after", "keyed")


def bucket_runs(sizes: list[int], cap: int = 25 << 20) -> list[list[tuple[int, int]]]:
    """DDP-like buckets: parameters in reverse order, a bucket closes at ``cap`` bytes;
    each run is ``(flat offset, nelem)``."""
    offsets, o = [], 0
    for n in sizes:
        offsets.append(o)
        o += n
    buckets, cur, nbytes = [], [], 0
    for off, n in reversed(list(zip(offsets, sizes, strict=True))):
        cur.append((off, n))
        nbytes += 4 * n
        if nbytes >= cap:
            buckets.append(cur)
            cur, nbytes = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def sender_main(endpoint: str, total: int, buckets, iters: int, conn, data_key: bytes) -> None:
    import numpy as np
    import zmq

    from shadow.wire import frames as F
    from shadow.wire import tags

    keyed = tags.DataKey(tags.rank_key(data_key, 0))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(endpoint)
    rng = np.random.default_rng(0)
    seq = 0
    for it in range(1, iters + 1):
        conn.recv()  # make the next gradient now (not while the receiver applies)
        grad = (rng.standard_normal(total, dtype=np.float32) * np.float32(1e-2)).astype(np.float32)
        conn.send(b"ready")
        for _ in range(len(PATHS)):  # once for each path
            tagger = keyed if conn.recv() == b"keyed" else tags.PLAIN  # the receiver is ready
            for runs in buckets:
                views = [grad[off : off + n] for off, n in runs]
                nonce = tagger.nonce()
                table = tuple((off, n, tagger.tag(nonce, j, views[j - 1])) for j, (off, n) in enumerate(runs, 1))
                h = F.Header(F.Kind.GRAD, F.Field.GRAD, 1, 1, 0, 1, 7, it, seq, table, nonce)
                seq += 1
                sock.send_multipart([h.pack(tagger)] + [memoryview(v) for v in views], copy=False)
    conn.recv()
    sock.close()
    ctx.term()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--iters", type=int, default=6, help="iterations per kind (plain, snapshot)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="10M params, 4 iterations per kind")
    ap.add_argument("--json", default="")
    return ap


def run(args) -> dict:
    """Both paths, plain and snapshot iterations, the table printed; the JSON document.
    Run it in a process of its own: it re-executes that process with malloc on huge pages
    (:func:`shadow.worker.malloc.reexec`) and sets NUMBA_NUM_THREADS before numba loads."""
    if args.quick:
        args.params, args.iters = min(args.params, 10e6), min(args.iters, 4)
    from shadow.worker import malloc

    malloc.reexec()  # receive as a worker does: malloc on huge pages (SHADOW_WORKER_HUGEPAGES=0: without)
    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import zmq
    from bench_replay import shapes
    from benchlib import machine_info

    from shadow.config import LocalTierConfig, PersistConfig
    from shadow.config.tuning import Tuning
    from shadow.core.layout import Layout
    from shadow.core.optimizers import AdamGroup
    from shadow.kernels.replay import warm_up
    from shadow.persist.writer import ShardPersister
    from shadow.transport import Context, FrameReceiver, SocketFactory, data_limit
    from shadow.wire import frames as F
    from shadow.wire import tags
    from shadow.worker.shard import ShardState

    sizes = shapes(int(args.params))
    total = sum(sizes)
    buckets = bucket_runs(sizes)
    layout = Layout.build([(f"p{i}", (n,), 0, True) for i, n in enumerate(sizes)], 1)
    optim = {"kind": "adam", "impl": "fused", "vec_width": 16, "tail_width": 8, "amsgrad_any": False}
    commit = {
        "skipped": [],
        "clip": None,
        "inv_scale": None,
        "grad_scale": None,
        "skip_step": False,
        "groups": [
            AdamGroup(
                lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, decoupled=True
            ).to_wire()
        ],
    }
    warm_up()
    tmp = tempfile.mkdtemp(prefix="shadow-bench-apply-")
    states, persisters, imgs = {}, {}, {}
    rng = np.random.default_rng(1)
    init = rng.standard_normal(total, dtype=np.float32)
    for path in PATHS:
        st = ShardState(layout, 0, total, optim)
        st.param[:] = init
        states[path] = st
        persisters[path] = ShardPersister(PersistConfig(LocalTierConfig(dir=tmp)), "bench", 0, 1, st)
    grad_buf = np.empty(total, dtype=np.float32)

    ctx = zmq.Context()
    tuning = Tuning.load()  # the knobs, as a worker would read them here
    pull = SocketFactory(ctx).pull(data_limit(tuning), tuning.data_rcvhwm_messages)  # the worker's data socket
    rx, rx_ctx = FrameReceiver(pull, tuning), Context(1, 1, 7, 1, 0, total)  # sender_main's job, epoch, layout, world
    data_key = tags.new_key()  # the worker's configuration's, on a keyed cluster
    keyed_ctx = Context(1, 1, 7, 1, 0, total, keys=tags.for_ranks(data_key, 1))
    endpoint = f"ipc://{tmp}/data"
    pull.bind(endpoint)
    parent, child = mp.get_context("spawn").Pipe()
    iters = 2 * args.iters
    proc = mp.get_context("spawn").Process(target=sender_main, args=(endpoint, total, buckets, iters, child, data_key))
    proc.start()

    def receive(path: str) -> tuple[list, float]:
        """One iteration's messages; returns the parts (after) and the CPU seconds."""
        parts = []
        parent.send(b"keyed" if path == "keyed" else b"plain")
        ctx_ = keyed_ctx if path == "keyed" else rx_ctx
        cpu = 0.0
        for _ in range(len(buckets)):
            pull.poll()  # waiting is not work
            c0 = time.process_time()
            # the worker's receiver: header, context, run table, each part's size and tag
            try:
                h = rx.header(ctx_)
                rx.check_runs(h, ctx_)
                if path == "before":
                    rx.runs_into(h, grad_buf, 0)
                else:
                    parts.extend(rx.runs_kept(h, 0)[1])
            except F.FrameError as exc:
                raise SystemExit(f"bench frame check failed: {exc}") from None
            cpu += time.process_time() - c0
        return sorted(parts, key=lambda p: p[0]), cpu

    def apply(path: str, parts: list, snapshot: bool) -> tuple[float, float]:
        st, per = states[path], persisters[path]
        img = per.begin(1, 1, 1, {}) if snapshot else None
        c0, t0 = time.process_time(), time.perf_counter()
        if path == "before":
            st.apply([(0, grad_buf)], commit)
            if img is not None:
                for f, view in per.field_views(img).items():
                    np.copyto(view, st.array(f), casting="no")
        else:
            st.apply(parts, commit, per.field_views(img) if img is not None else None)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if img is not None:
            imgs[path] = {f: v.copy() for f, v in per.field_views(img).items()}
            per.abandon(img)
        return wall, cpu

    rows: dict[str, dict[str, list]] = {}
    for it in range(1, iters + 1):
        parent.send(b"next")
        parent.recv()
        snapshot = it > args.iters
        order = PATHS[it % 3 :] + PATHS[: it % 3]
        for path in order:
            parts, recv_cpu = receive(path)
            wall, cpu = apply(path, parts, snapshot)
            del parts
            if it in (1, args.iters + 1):
                continue  # warm-up: first touch of the state and image pages
            r = rows.setdefault(
                path + ("+snapshot" if snapshot else ""), {"recv_cpu": [], "apply_s": [], "apply_cpu": []}
            )
            r["recv_cpu"].append(recv_cpu)
            r["apply_s"].append(wall)
            r["apply_cpu"].append(cpu)
    parent.send(b"done")
    proc.join(60)
    pull.close(0)
    ctx.term()
    same = all(
        np.array_equal(states["before"].array(f), states[p].array(f)) for p in PATHS for f in states["after"].fields()
    )
    snap_ok = all(np.array_equal(imgs[p][f], imgs["before"][f]) for p in PATHS for f in imgs["after"])
    out = {
        "params": total,
        "threads": args.threads,
        "iters_per_kind": args.iters,
        "buckets": len(buckets),
        "runs": sum(len(b) for b in buckets),
        "bit_identical": bool(same),
        "snapshot_identical": bool(snap_ok),
        "machine": machine_info(),
        "paths": {},
    }
    print(
        f"worker apply path, AdamW over {total / 1e6:.1f}M fp32 params, {len(buckets)} buckets "
        f"({out['runs']} runs), {args.threads} threads, "
        f"median of {len(next(iter(rows.values()))['apply_s'])} iterations"
    )
    print("| path | bytes/param | recv CPU s | apply s | CPU s / iteration | CPU s / iter / B params | speedup |")
    print("|---|---|---|---|---|---|---|")
    for path in ("before", "after", "keyed", "before+snapshot", "after+snapshot", "keyed+snapshot"):
        r = rows[path]
        med = {k: statistics.median(v) for k, v in r.items()}
        cpu = med["recv_cpu"] + med["apply_cpu"]
        base = rows[path.replace("after", "before").replace("keyed", "before")]
        base_cpu = statistics.median(base["recv_cpu"]) + statistics.median(base["apply_cpu"])
        out["paths"][path] = {
            **med,
            "cpu_s_per_iter": cpu,
            "cpu_s_per_iter_per_Bparams": cpu / total * 1e9,
            "bytes_per_param": sum(PASSES[path].values()),
            "passes": PASSES[path],
            "cpu_speedup_vs_before": base_cpu / cpu,
        }
        print(
            f"| {path} | {sum(PASSES[path].values())} | {med['recv_cpu']:.4f} | {med['apply_s']:.4f} | "
            f"{cpu:.4f} | {cpu / total * 1e9:.2f} | {base_cpu / cpu:.2f}x |"
        )
    # the goal of the worker path: receive + checksum + apply from the frames, against the
    # replay alone (the kernel over one contiguous gradient: the "before" path's apply)
    alone = statistics.median(rows["before"]["apply_cpu"])
    whole = out["paths"]["after"]["cpu_s_per_iter"]
    out["replay_alone_cpu_s_per_iter_per_Bparams"] = alone / total * 1e9
    out["whole_path_vs_replay_alone"] = whole / alone
    out["malloc_hugepages"] = malloc.TUNABLE in os.environ.get("GLIBC_TUNABLES", "")
    print(
        f"whole worker path (receive, checksum, apply from the frames): {whole / total * 1e9:.2f} CPU s / iter / "
        f"B params; the replay alone (contiguous gradient): {alone / total * 1e9:.2f}; ratio {whole / alone:.2f}x "
        f"(goal <= 1.25x); malloc on huge pages: {out['malloc_hugepages']}"
    )
    keyed = out["paths"]["keyed"]["cpu_s_per_iter"] / whole
    out["keyed_vs_plain_cpu"] = keyed
    out["keyed_vs_plain_recv_cpu"] = out["paths"]["keyed"]["recv_cpu"] / out["paths"]["after"]["recv_cpu"]
    print(
        f"keyed (security.data=mac: GMAC per run instead of xxh3): worker CPU per iteration {keyed:.2f}x "
        f"no keys' (goal <= 1.2x); receiving alone {out['keyed_vs_plain_recv_cpu']:.2f}x"
    )
    print(f"states bit-identical: {same}; folded snapshot identical to the copied one: {snap_ok}")
    return out


def plot(results: dict, path) -> bool:
    """Worker CPU-s per iteration per B params of each path, bytes per param on the bars."""
    plt = pyplot()
    if plt is None:
        return False
    p = results["paths"]
    names = ["before", "after", "before+snapshot", "after+snapshot"]
    fig, ax1 = plt.subplots(figsize=(6, 3.2))
    ax1.bar(
        names, [p[n]["cpu_s_per_iter_per_Bparams"] for n in names], color=["grey", "tab:green", "grey", "tab:green"]
    )
    for i, n in enumerate(names):
        ax1.text(
            i,
            p[n]["cpu_s_per_iter_per_Bparams"],
            f"{p[n]['bytes_per_param']} B/param",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_ylabel("worker CPU-s / iteration / B params")
    ax1.set_title("Apply from frames, snapshot in the apply pass")
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["bit_identical"] and out["snapshot_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
