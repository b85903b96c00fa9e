"""Replay throughput: the shadow's numba AdamW against torch's fused AdamW on the same
data and the same number of threads, and both against this machine's copy bandwidth.

    python scripts/bench_replay.py [--params 50e6] [--threads 2] [--repeat 5] [--json PATH]

A GPT-like parameter list (a few large matrices, many small vectors) totalling --params
elements, fp32. Each variant runs --repeat optimizer steps after a warm-up; the figure is
the median step. Bytes moved per element per step for AdamW: read param, grad, exp_avg,
exp_avg_sq and write param, exp_avg, exp_avg_sq = 28 bytes. The bandwidth baselines run in
the same interleaved rounds on the same threads (numba prange): a *stream* with Adam's
exact traffic and almost no arithmetic (``p += g; m += g; v += g``: the machine's limit
for this access pattern, write-allocate included), and a plain copy (8 bytes/element,
which under-counts the write-allocate read, so copy GB/s is not a limit Adam can be held
to). Also checked: the two updates are bit-identical (torch.equal).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shapes(total: int) -> list[int]:
    """A GPT-ish mix: 80% in 4:1 matrices, the rest in embeddings and small vectors."""
    out, left = [], total
    big = max(1 << 20, total // 40)
    while left > big * 2:
        out.append(big)
        out.extend([1024 + 7, 3 * 1024 + 1])  # biases / layernorms (odd sizes: tails)
        left -= big + 1024 + 7 + 3 * 1024 + 1
    out.append(left)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    import numba
    import numpy as np
    import torch

    from shadow import knobs
    from shadow.kernels.plan import ReplayPlan, segments_for_range, warm_up

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    sizes = shapes(int(args.params))
    total = sum(sizes)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    # the shadow's flat copy of the same state
    flat_p = torch.cat([p.detach() for p in params]).numpy().copy()
    flat_g = torch.cat(grads).numpy()
    m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    segs = segments_for_range(offsets, sizes, [0] * len(sizes), 0, total, "fused", 16, 8)
    warm_up()
    plan = ReplayPlan(segs, "fused", knobs.get_int("KERNEL_CHUNK"), "adam")
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "maximize": False, "decoupled": True}
    steps = np.zeros(len(sizes))

    def torch_step():
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()

    def shadow_step():
        steps[:] += 1
        plan.prepare([group], steps, set(), None)
        plan.apply(flat_p, m, v, np.zeros(0, np.float32), flat_g)

    @numba.njit(parallel=True, cache=True)
    def par_copy(dst, src):
        n = src.shape[0]
        chunk = 1 << 16
        for c in numba.prange((n + chunk - 1) // chunk):
            lo = c * chunk
            hi = min(lo + chunk, n)
            dst[lo:hi] = src[lo:hi]

    dst = np.empty_like(flat_p)

    def copy_step():
        par_copy(dst, flat_p)

    @numba.njit(parallel=True, cache=True)
    def par_stream(p, m, v, gr):
        # Adam's memory traffic with almost no arithmetic: read 4 arrays, write 3 (28 B/elem)
        n = p.shape[0]
        chunk = 1 << 15
        for c in numba.prange((n + chunk - 1) // chunk):
            lo = c * chunk
            hi = min(lo + chunk, n)
            for i in range(lo, hi):
                x = gr[i]
                p[i] += x
                m[i] += x
                v[i] += x

    sp, sm, sv = flat_p.copy(), np.zeros_like(flat_p), np.zeros_like(flat_p)

    def stream_step():
        par_stream(sp, sm, sv, flat_g)

    fns = {"torch": torch_step, "shadow": shadow_step, "copy": copy_step, "stream": stream_step}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(args.repeat):  # interleaved rounds: drift on a noisy machine hits all three alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    t_torch, t_shadow, t_copy, t_stream = (statistics.median(times[k]) for k in ("torch", "shadow", "copy", "stream"))
    same = all(torch.equal(p.detach(), torch.from_numpy(flat_p[o:o + n]))
               for p, o, n in zip(params, offsets, sizes))
    adam_bytes = 28 * total
    rows = {
        "params": total, "threads": args.threads, "repeat": args.repeat,
        "torch_fused_s": t_torch, "shadow_s": t_shadow, "copy_s": t_copy, "stream_s": t_stream,
        "shadow_vs_torch": t_torch / t_shadow,
        "shadow_GBps": adam_bytes / t_shadow / 1e9, "torch_GBps": adam_bytes / t_torch / 1e9,
        "copy_GBps": 8 * total / t_copy / 1e9, "stream_GBps": adam_bytes / t_stream / 1e9,
        "bit_identical": bool(same), "machine": f"{os.cpu_count()} cores",
    }
    rows["shadow_vs_copy_bw"] = rows["shadow_GBps"] / rows["copy_GBps"]
    rows["shadow_vs_stream_bw"] = rows["shadow_GBps"] / rows["stream_GBps"]
    print(f"AdamW over {total / 1e6:.1f}M fp32 params, {args.threads} threads, median of {args.repeat} steps")
    print("| variant | s/step | GB/s moved | vs torch fused | vs Adam-traffic stream | goal |")
    print("|---|---|---|---|---|---|")
    print(f"| torch AdamW(fused=True) | {t_torch:.4f} | {rows['torch_GBps']:.2f} | 1.00x | "
          f"{rows['torch_GBps'] / rows['stream_GBps']:.2f} | |")
    print(f"| shadow numba replay | {t_shadow:.4f} | {rows['shadow_GBps']:.2f} | {rows['shadow_vs_torch']:.2f}x | "
          f"{rows['shadow_vs_stream_bw']:.2f} | >= 0.95x torch, >= 0.9 of the stream |")
    print(f"| stream, Adam's traffic (28 B/elem) | {t_stream:.4f} | {rows['stream_GBps']:.2f} | | 1.00 | |")
    print(f"| parallel copy (8 B/elem) | {t_copy:.4f} | {rows['copy_GBps']:.2f} | | "
          f"{rows['copy_GBps'] / rows['stream_GBps']:.2f} | |")
    print(f"bit-identical to torch: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
