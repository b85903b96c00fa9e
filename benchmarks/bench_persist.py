"""Persistence benchmark: the shadow's shard write vs a raw O_DIRECT write of the same
bytes and vs torch.save + fsync; restore from disk vs torch.distributed.checkpoint.load.
All in one run, same machine, same bytes. Prints a table and writes JSON.

    python benchmarks/bench_persist.py --gib 1 --dir /path/on/the/disk --json docs/bench/persist.json

Goals: persist >= 0.9x raw write throughput and >= 1.5x torch.save; restore <= 0.5x DCP load.
Page caches are dropped before each read when the process may (root); the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import torch
from benchlib import Goal, bars

from shadow.core.layout import Layout
from shadow.persist import checkpoints, shardfile

GOALS = [
    Goal("shard write throughput / raw O_DIRECT", "ratios.persist_vs_raw_odirect", 0.9, ">=", "x"),
    Goal("shard write throughput / torch.save + fsync", "ratios.persist_vs_torch_save", 1.5, ">=", "x"),
    Goal("restore time / DCP load time", "ratios.restore_vs_dcp_load_time", 0.5, "<=", "x"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--gib", "0.25", "--repeat", "2"]
ARGS_FULL = ["--gib", "1", "--repeat", "3"]
ARGS_SMOKE = ["--gib", "0.02", "--repeat", "1"]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_odirect(buf: np.ndarray, path: str) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    mv, pos = memoryview(buf), 0
    while pos < len(buf):
        pos += os.pwrite(fd, mv[pos : pos + shardfile.CHUNK], pos)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="shard size (param + two Adam moments)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--json", default="bench_persist.json")
    ap.add_argument("--repeat", type=int, default=2)
    return ap


def run(args) -> dict:
    """Every write and read, best of --repeat, the table printed; the JSON document."""
    work = tempfile.mkdtemp(prefix="shadow-bench-", dir=args.dir)
    n = int(args.gib * 2**30 / 12) // 16 * 16
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(n, dtype=np.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
    nbytes = 3 * n * 4
    layout = Layout.build([("w", (n,), 0, True)], 1)
    results: dict = {
        "bytes": nbytes,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "dir": work,
        "torch": torch.__version__,
        "runs": [],
    }
    try:
        for rep in range(args.repeat):
            run: dict = {}
            # shadow: snapshot copy into the preallocated image, then the durable write
            img = shardfile.ShardImage(nbytes + (1 << 20))
            entries = [shardfile.Entry(k, "F32", n) for k in arrays]
            entries += [
                shardfile.Entry("param_index", "I64", 1),
                shardfile.Entry("steps", "F64", 1),
                shardfile.Entry("has_state", "U8", 1),
                shardfile.Entry("commit.rank0", "U8", 1),
            ]
            t0 = time.perf_counter()
            img.layout(entries, {"format": shardfile.FORMAT, "start": "0", "stop": str(n), "iteration": "1"})
            for k, a in arrays.items():
                img.fill(k, a)
            img.fill("param_index", np.zeros(1, np.int64))
            img.fill("steps", np.ones(1))
            img.fill("has_state", np.ones(1, np.uint8))
            img.fill("commit.rank0", np.zeros(1, np.uint8))
            run["snapshot_copy_s"] = time.perf_counter() - t0
            d = checkpoints.checkpoint_dir(work, "bench", rep)
            path = os.path.join(d, checkpoints.shard_name(0, 1))
            t0 = time.perf_counter()
            csum = img.checksum()
            run["checksum_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            img.write(path)
            run["shadow_write_s"] = time.perf_counter() - t0
            from shadow.export import blob as _codec

            blob = _codec.pack(
                {"rank": 0, "world": 1, "rng": None, "extra_state": None, "param_groups": [{}], "scheduler": None}
            )
            img.layout(
                entries[:-1] + [shardfile.Entry("commit.rank0", "U8", len(blob))],
                {"format": shardfile.FORMAT, "start": "0", "stop": str(n), "iteration": str(rep)},
            )
            for k, a in arrays.items():
                img.fill(k, a)
            img.fill("param_index", np.zeros(1, np.int64))
            img.fill("steps", np.ones(1))
            img.fill("has_state", np.ones(1, np.uint8))
            img.fill("commit.rank0", np.frombuffer(blob, np.uint8))
            size = img.write(path)
            manifest = checkpoints.new_manifest(
                "bench",
                rep,
                1,
                "local",
                layout.to_dict(),
                layout.hash,
                {"kind": "adam"},
                1,
                None,
                None,
                [
                    {
                        "index": 0,
                        "start": 0,
                        "stop": n,
                        "file": os.path.basename(path),
                        "bytes": size,
                        "checksum": f"{img.checksum():016x}",
                        "blob_ranks": [0],
                    }
                ],
            )
            checkpoints.write_manifest(work, "bench", rep, manifest)
            del csum
            # raw O_DIRECT write of the same bytes
            run["raw_odirect_write_s"] = raw_odirect(
                img.buf[: -(-img.size // 4096) * 4096], os.path.join(work, "raw.bin")
            )
            # torch.save + fsync
            tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
            t0 = time.perf_counter()
            with open(os.path.join(work, "torch.pt"), "wb") as f:
                torch.save(tensors, f)
                f.flush()
                os.fsync(f.fileno())
            run["torch_save_s"] = time.perf_counter() - t0
            # restore: shadow catalog load (read + checksum + parse) vs DCP load
            import torch.distributed.checkpoint as dcp

            dcp_dir = os.path.join(work, f"dcp{rep}")
            dcp.save({"state": tensors}, checkpoint_id=dcp_dir, no_dist=True)
            target = {"state": {k: torch.empty(n) for k in arrays}}
            run["caches_dropped"] = drop_caches()
            t0 = time.perf_counter()
            info = [c for c in checkpoints.list_checkpoints(work) if c.iteration == rep][0]
            snap = checkpoints.load(info)
            run["shadow_restore_s"] = time.perf_counter() - t0
            assert np.array_equal(snap.arrays[next(iter(snap.arrays))][:8], arrays["param"][:8])
            del snap
            drop_caches()
            t0 = time.perf_counter()
            dcp.load(target, checkpoint_id=dcp_dir, no_dist=True)
            run["dcp_load_s"] = time.perf_counter() - t0
            results["runs"].append(run)
            del img, tensors, target
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {k: min(r[k] for r in results["runs"]) for k in results["runs"][0] if k.endswith("_s")}
    gb = nbytes / 1e9
    rate = {k: gb / v for k, v in best.items()}
    results["best_s"] = best
    results["ratios"] = {
        "persist_vs_raw_odirect": best["raw_odirect_write_s"] / best["shadow_write_s"],
        "persist_vs_torch_save": best["torch_save_s"] / best["shadow_write_s"],
        "restore_vs_dcp_load_time": best["shadow_restore_s"] / best["dcp_load_s"],
    }
    goals = {g.key.split(".")[-1]: (g.op, g.target) for g in GOALS}
    print(f"persistence benchmark: {gb:.2f} GB shard (3 x {n} fp32), best of {args.repeat}, {results['dir']}")
    print(f"{'measurement':34s} {'seconds':>9s} {'GB/s':>8s}")
    for k, v in best.items():
        print(f"{k:34s} {v:9.3f} {rate[k]:8.2f}")
    print(f"{'ratio':34s} {'value':>9s} {'goal':>8s}")
    for k, v in results["ratios"].items():
        op, g = goals[k]
        ok = v >= g if op == ">=" else v <= g
        print(f"{k:34s} {v:9.2f} {op + str(g):>8s} {'met' if ok else 'NOT met'}")
    print(f"page caches dropped before reads: {results['runs'][0]['caches_dropped']}")
    return results


def plot(results: dict, path) -> bool:
    """GB/s of each write and read (best of the runs)."""
    gb = results["bytes"] / 1e9
    best = results["best_s"]
    return bars(
        path,
        [k.removesuffix("_s").replace("_", " ") for k in best],
        [gb / v for v in best.values()],
        f"Persistence, {gb:.2f} GB shard",
        "GB/s",
        horizontal=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run(args)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
