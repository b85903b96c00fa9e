"""Replay scaling: AdamW replay throughput against the number of numba threads in one
worker and against the number of worker processes, and the shadow cluster's CPU-seconds
per training iteration per billion parameters (the figure to size a cluster with).

    python benchmarks/bench_scaling.py [--params 50e6] [--repeat 5] [--quick] [--json PATH]

* threads: one process, the whole range, ``numba.set_num_threads(t)`` for t = 1..cores;
* workers: w processes started together, each replaying its 1/w of the parameters on one
  thread (as w single-thread workers on one host would), for w = 1..cores; the figure is
  the slowest worker's median step (the cut waits for every worker);
* CPU-seconds per iteration per B params: replay only (threads x seconds / params), and
  the whole worker path (receive, checksum, apply) from ``--apply-json`` when that file
  exists (default ``docs/bench/apply.json``: what ``benchmarks/bench_apply.py`` measured
  with process CPU time).

Extrapolation (printed): the cores a shadow cluster needs to keep up with a model of P
parameters at an iteration time T is ``cpu_s_per_B * P / T``; it assumes throughput per
core stays what it is here (each worker's memory bandwidth is its own: true across hosts,
optimistic within a host whose memory bandwidth the cores share).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from benchlib import Goal, pyplot, save

ROOT = Path(__file__).resolve().parents[1]

# figures only: scaling has no goal of its own, it sizes a cluster
GOALS = [
    Goal("replay speedup, {key} threads", "threads.*.speedup", None, unit="x"),
    Goal("replay speedup, {key} workers", "workers.*.speedup", None, unit="x"),
    Goal("replay CPU-s per iteration per B params", "sizing.replay_cpu_s_per_iter_per_Bparams", None),
    Goal("worker path CPU-s per iteration per B params", "sizing.worker_path_cpu_s_per_iter_per_Bparams", None),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--quick"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--params", "2e6", "--repeat", "1"]


def _setup(nparams: int):
    import numpy as np
    from bench_replay import shapes

    from shadow.config.tuning import Tuning
    from shadow.core.optimizers import AdamGroup
    from shadow.kernels.replay import ReplayPlan, segments_for_range, warm_up

    sizes = shapes(nparams)
    total = sum(sizes)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    warm_up()
    plan = ReplayPlan(
        segments_for_range(offsets, sizes, [0] * len(sizes), 0, total, "fused", 16, 8),
        "fused",
        Tuning.load().kernel_chunk_elements,
        "adam",
    )
    rng = np.random.default_rng(0)
    p = rng.standard_normal(total, dtype=np.float32)
    g = rng.standard_normal(total, dtype=np.float32) * np.float32(1e-2)
    m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
    group = AdamGroup(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, decoupled=True
    )
    steps = np.zeros(len(sizes))

    def step():
        steps[:] += 1
        plan.prepare([group], steps, set(), None)
        plan.apply(p, m, v, np.zeros(0, np.float32), g)

    return total, step


def _timed(step, repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(nparams: int, repeat: int, barrier, out) -> None:
    import numba

    numba.set_num_threads(1)
    _, step = _setup(nparams)
    step()
    barrier.wait()
    out.put(_timed(step, repeat))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="20M params, 3 repeats")
    ap.add_argument("--apply-json", default=str(ROOT / "docs" / "bench" / "apply.json"))
    ap.add_argument("--json", default="")
    return ap


def run(args) -> dict:
    """Threads 1..cores, then workers 1..cores, and the sizing table, printed; the JSON
    document (``threads`` and ``workers`` keyed by the count)."""
    if args.quick:
        args.params, args.repeat = min(args.params, 20e6), min(args.repeat, 3)
    cores = os.cpu_count() or 1
    import numba
    from benchlib import machine_info

    total, step = _setup(int(args.params))
    threads = {}
    for t in range(1, cores + 1):
        numba.set_num_threads(t)
        threads[t] = _timed(step, args.repeat)
    del step
    workers = {}
    ctx = mp.get_context("spawn")
    for w in range(1, cores + 1):
        barrier, out = ctx.Barrier(w), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(int(args.params) // w, args.repeat, barrier, out)) for _ in range(w)]
        for p in procs:
            p.start()
        res = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        workers[w] = max(res)
    res = {
        "params": total,
        "repeat": args.repeat,
        "machine": machine_info(),
        "threads": {
            t: {
                "s_per_step": s,
                "Mparams_per_s": total / s / 1e6,
                "cpu_s_per_iter_per_Bparams": t * s / total * 1e9,
                "speedup": threads[1] / s,
            }
            for t, s in threads.items()
        },
        "workers": {
            w: {
                "s_per_step": s,
                "Mparams_per_s": total / s / 1e6,
                "cpu_s_per_iter_per_Bparams": w * s / total * 1e9,
                "speedup": workers[1] / s,
            }
            for w, s in workers.items()
        },
    }
    print(f"AdamW replay of {total / 1e6:.1f}M params, median of {args.repeat} steps, {cores} cores")
    print("| scaling over | n | s/step | Mparams/s | speedup | CPU-s / iteration / B params |")
    print("|---|---|---|---|---|---|")
    for kind in ("threads", "workers"):
        for n, r in res[kind].items():
            print(
                f"| {kind} | {n} | {r['s_per_step']:.4f} | {r['Mparams_per_s']:.0f} | {r['speedup']:.2f}x | "
                f"{r['cpu_s_per_iter_per_Bparams']:.2f} |"
            )
    replay_cpu = res["threads"][1]["cpu_s_per_iter_per_Bparams"]
    apply_json = Path(args.apply_json)
    path_cpu = None
    if apply_json.exists():
        path_cpu = json.loads(apply_json.read_text())["paths"]["after"]["cpu_s_per_iter_per_Bparams"]
    res["sizing"] = {
        "replay_cpu_s_per_iter_per_Bparams": replay_cpu,
        "worker_path_cpu_s_per_iter_per_Bparams": path_cpu,
    }
    per_b = path_cpu or replay_cpu
    print(
        f"CPU-s per iteration per B params: replay {replay_cpu:.2f}"
        + (f", whole worker path (receive + checksum + apply, bench_apply) {path_cpu:.2f}" if path_cpu else "")
    )
    print("cores a shadow cluster needs (extrapolated from the figure above):")
    print("| params | iteration 1 s | 5 s | 10 s |")
    print("|---|---|---|---|")
    res["sizing"]["cores"] = {}
    for b in (1, 7, 70, 405):
        row = [per_b * b / t for t in (1, 5, 10)]
        res["sizing"]["cores"][f"{b}B"] = row
        print(f"| {b}B | {row[0]:.1f} | {row[1]:.1f} | {row[2]:.1f} |")
    return res


def plot(results: dict, path) -> bool:
    """Replay throughput against threads (one worker) and workers (one thread each)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for kind in ("threads", "workers"):
        pts = sorted((int(n), r["Mparams_per_s"]) for n, r in results[kind].items())
        ax.plot([n for n, _ in pts], [v for _, v in pts], "o-", label=kind)
    ax.set_xlabel("threads (one worker) / workers (one thread each)")
    ax.set_ylabel("M params / s")
    ax.set_title("Replay scaling on this machine")
    ax.legend()
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
