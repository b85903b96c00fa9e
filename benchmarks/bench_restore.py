"""Restore time: bring a trainer's model + AdamW state back from the shadow workers' memory,
from the shadow's local-disk tier, with torch.distributed.checkpoint (DCP) `dcp.load`, and
with a plain `torch.load` of a `torch.save`d state dict. All in one run, same state.

    python benchmarks/bench_restore.py [--quick] [--n-layer 8] [--n-embd 576] [--steps 3]
                                    [--repeat 3] [--no-evict] [--no-s3] [--keep] [--json PATH]

Setup (not timed): a shadow cluster (coordinator + 2 workers, 127.0.0.1, a free port,
`persist.local.dir` in a temp dir, `persist.local.every_n=--steps`) and one trainer
process (gloo, world 1, DDP) that trains the example GPT (examples/gpt.py, default 32M
params) for --steps iterations attached to the shadow, so iteration --steps is in the
workers' memory and on the local tier; the trainer then writes the same state with
`dcp.save` (from `get_state_dict`) and with `torch.save`, and exits. With `weed` and s3fs
(the test extra) and without --no-s3, a SeaweedFS S3 server on loopback too: the cluster's
remote tier (`persist.remote.url=s3://...`, uploaded by the workers) and DCP's own fsspec
writer put the same state there.

Timed, in a fresh process (gloo world 1, as a restarted trainer), each restore into a
freshly constructed GPT + AdamW(fused) (construction not timed), from the call until the
model and optimizer hold the state:

  shadow memory   trainer_hooks.restore(model, opt, source="tcp://127.0.0.1:PORT")
  shadow local    trainer_hooks.restore(model, opt, source=<persist.local.dir>)
  DCP load        get_state_dict(model, opt); dcp.load({"model", "optim"}, checkpoint_id=dir);
                  set_state_dict(model, opt, ...)   (get_state_dict on a fresh optimizer
                  runs DCP's zero-grad lr=0 step to allocate the state it loads into)
  torch.load      sd = torch.load(path, weights_only=True); model.load_state_dict(sd["model"]);
                  opt.load_state_dict(sd["optim"])
  shadow remote (S3)  trainer_hooks.restore(model, opt, source="s3://bucket/...")
  DCP load, S3    as DCP load, with storage_reader=FsspecReader("s3://bucket/...")

One warm-up round (reported as "first call", not in the median), then --repeat rounds;
the paths run interleaved, the order rotated each round; the figure is the median. After
every restore the model and optimizer state dicts are compared with the trained state
(torch.equal on every tensor, == on param_groups); a mismatch is printed loudly and the
script exits 1. Separate, untimed-in-the-table rounds split the shadow paths into fetch
(`shadow.restore.resolve`: coordinator query + worker fetch, the parameters straight into
the model as `trainer_hooks.restore` does, or catalog list + read + xxh3 check) and
install (`trainer_hooks.apply_snapshot`), and time xxh3 over the shard bytes alone.

Caches: the page cache is not dropped (that would hit everyone on a shared machine). The
"warm" disk rows read files that were just written and sit in the page cache. The
"evicted" rows fsync and posix_fadvise(DONTNEED) the files just before each call, which
drops this guest's cached pages of those files only; a hypervisor below a virtual disk may
still cache them, so evicted is not necessarily cold media. The shadow reads its shards
with O_DIRECT where the file system allows, i.e. past the page cache in both rows.
"state GB/s" = (params + exp_avg + exp_avg_sq bytes, fp32) / seconds; "read GB/s" = the
bytes the path reads (files, or what the workers send) / seconds.

--quick: a 1.6M-param GPT (2 layers, width 256), 2 steps, 3 rounds: about 40 s in all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchcluster import Services, compare, dir_bytes, evict, free_port, wait_persisted
from benchlib import Goal, bars, example_gpt, machine_info

ROOT = Path(__file__).resolve().parents[1]

JOB = "bench_restore"
LR, WD = 1e-3, 0.1
PATHS = (
    "shadow memory",
    "shadow local",
    "shadow local, evicted",
    "DCP load",
    "DCP load, evicted",
    "torch.load",
    "torch.load, evicted",
    "shadow remote (S3)",
    "DCP load, S3",
)

GOALS = [
    Goal("restore {path} / DCP load", "rows.*.vs_dcp_load", 0.5, "<=", "x", where={"path": "shadow local*"}),
    Goal("restore {path} / DCP load", "rows.*.vs_dcp_load", 0.5, "<=", "x", where={"path": "shadow memory*"}),
    Goal("restore {path} / DCP load, S3", "rows.*.vs_dcp_load", 1.0, "<=", "x", where={"path": "shadow remote*"}),
    Goal("every restore bit-identical to the trained state", "bit_identical", True, "=="),
    Goal("restore {path}, median seconds", "rows.*.median_s", None, unit="s"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--no-evict", "--repeat", "5"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--quick", "--no-evict", "--repeat", "1"]


# --------------------------------------------------------------------------- shared


def _setup_torch(work: Path, threads: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(str(work / f"pg-{os.getpid()}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return torch, dist


def build(args, seed: int):
    import torch

    GPT, CharData, GPTConfig, corpus = example_gpt()
    data = CharData(corpus(4000))
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=len(data.chars), block_size=64, n_layer=args.n_layer, n_embd=args.n_embd))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    return model, opt, data


# --------------------------------------------------------------------------- trainer


def train_main(args) -> None:
    work = Path(args.work)
    torch, dist = _setup_torch(work, 1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks

    model, opt, data = build(args, 0)
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=args.coordinator, job=JOB)
    t0 = time.perf_counter()
    for it in range(1, args.steps + 1):
        x, y = data.batch(it, 0, 8, 64)
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
    step_s = (time.perf_counter() - t0) / args.steps
    session.close()
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "s_per_step": step_s, "iteration": args.steps}
    # the reference the restores are compared with, and the plain torch.save checkpoint
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, work / "reference.pt")
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, work / "torch_ckpt.pt")
    out["torch_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "dcp"))
    out["dcp_save_s"] = time.perf_counter() - t0
    if args.s3_url:  # DCP's own fsspec writer, to the same object store
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(args.s3_url + "/dcp"))
        out["dcp_save_s3_s"] = time.perf_counter() - t0
    (work / "train.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- restorer


def restore_main(args) -> None:
    work = Path(args.work)
    torch, dist = _setup_torch(work, os.cpu_count() or 1)
    import numpy as np
    import torch.distributed.checkpoint as dcp
    import xxhash
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import trainer_hooks
    from shadow.persist import checkpoints
    from shadow.restore.memory import fetch_memory, restore_info
    from trainer_hooks._model import build_layout
    from trainer_hooks._sink import ModelParams

    local, dcp_dir, torch_file = work / "local", work / "dcp", work / "torch_ckpt.pt"
    ref = torch.load(work / "reference.pt", weights_only=True)
    n_params = sum(t.numel() for t in dict(build(args, 0)[0].named_parameters()).values())
    state_bytes = 3 * 4 * n_params  # param, exp_avg, exp_avg_sq in fp32
    (ckpt,) = [c for c in checkpoints.list_checkpoints(str(local), job=JOB) if c.iteration == args.steps]
    read_bytes = {
        "shadow remote (S3)": ckpt.bytes,  # the same shard files, uploaded
        "shadow memory": state_bytes,
        "shadow local": ckpt.bytes,
        "DCP load": dir_bytes(dcp_dir),
        "torch.load": dir_bytes(torch_file),
    }

    def shadow(source: str, tier: str):
        def run(model, opt, parts):
            info = trainer_hooks.restore(model, opt, source=source, job=JOB)
            if (info.tier, info.iteration) != (tier, args.steps):
                raise RuntimeError(f"restore from {source} gave {info.tier} iteration {info.iteration}")

        return run

    def dcp_load(model, opt, parts):
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        t1 = time.perf_counter()
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(dcp_dir))
        t2 = time.perf_counter()
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        t3 = time.perf_counter()
        parts.update({"get_state_dict": t1 - t0, "dcp.load": t2 - t1, "set_state_dict": t3 - t2})

    def dcp_load_s3(model, opt, parts):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=FsspecReader(args.s3_url + "/dcp"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def torch_load(model, opt, parts):
        t0 = time.perf_counter()
        sd = torch.load(torch_file, weights_only=True)
        t1 = time.perf_counter()
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        t2 = time.perf_counter()
        parts.update({"torch.load": t1 - t0, "load_state_dict": t2 - t1})

    runs = {
        "shadow memory": (shadow(args.coordinator, "memory"), None),
        "shadow local": (shadow(str(local), "local"), None),
        "shadow local, evicted": (shadow(str(local), "local"), local),
        "DCP load": (dcp_load, None),
        "DCP load, evicted": (dcp_load, dcp_dir),
        "torch.load": (torch_load, None),
        "torch.load, evicted": (torch_load, torch_file),
        "shadow remote (S3)": (shadow(args.s3_url + "/shadow", "remote"), None),
        "DCP load, S3": (dcp_load_s3, None),
    }
    paths = [p for p in PATHS if (args.evict or "evicted" not in p) and (args.s3_url or "S3" not in p)]
    times: dict[str, list[float]] = {p: [] for p in paths}
    first: dict[str, float] = {}
    parts_all: dict[str, list[dict]] = {p: [] for p in paths}
    mismatches: list[str] = []
    seed = 1000
    for rnd in range(args.repeat + 1):  # round 0: warm-up ("first call" in a fresh process)
        order = paths[rnd % len(paths) :] + paths[: rnd % len(paths)]
        for name in order:
            fn, to_evict = runs[name]
            seed += 1
            model, opt, _ = build(args, seed)  # a fresh model and optimizer, differently initialised
            if to_evict is not None:
                evict(to_evict)
            gc.collect()
            parts: dict = {}
            t0 = time.perf_counter()
            fn(model, opt, parts)
            dt = time.perf_counter() - t0
            problems = compare(model, opt, ref)
            if problems:
                msg = f"MISMATCH after '{name}' (round {rnd}): {len(problems)} differences, e.g. {problems[:3]}"
                print("!" * 80 + "\n" + msg + "\n" + "!" * 80, file=sys.stderr, flush=True)
                mismatches.append(msg)
            if rnd == 0:
                first[name] = dt
            else:
                times[name].append(dt)
                parts_all[name].append(parts)
            del model, opt
            print(f"  round {rnd} {name:22s} {dt:7.3f} s{'' if rnd else '  (warm-up)'}", flush=True)

    # where the shadow's restore time goes: resolve() (fetch) vs apply_snapshot() (install),
    # the same two calls trainer_hooks.restore makes
    breakdown: dict[str, list[dict]] = {"shadow memory": [], "shadow local": []}
    for rnd in range(args.repeat):
        for name, source in (("shadow memory", args.coordinator), ("shadow local", str(local))):
            seed += 1
            model, opt, _ = build(args, seed)
            gc.collect()
            b: dict = {}
            t0 = time.perf_counter()
            sink = ModelParams.of(*build_layout(model, opt))  # as trainer_hooks.restore: from memory, in place
            if name == "shadow memory":
                info = restore_info(source, JOB, 10.0)
                t1 = time.perf_counter()
                snap = fetch_memory(info["memory"], source, sink=sink)
                t2 = time.perf_counter()
                b.update({"coordinator restore_info": t1 - t0, "worker fetch": t2 - t1})
            else:
                found = checkpoints.list_checkpoints(source, "local", JOB)
                t1 = time.perf_counter()
                snap = checkpoints.load(found[-1])
                t2 = time.perf_counter()
                b.update({"catalog list": t1 - t0, "read + xxh3 check": t2 - t1})
            t3 = time.perf_counter()
            sd = trainer_hooks.state_dicts(snap)
            t4 = time.perf_counter()
            trainer_hooks.apply_snapshot(snap, model, opt)
            t5 = time.perf_counter()
            b.update(
                {
                    "resolve (fetch)": t2 - t0,
                    "state_dicts (views)": t4 - t3,
                    "apply_snapshot (install)": t5 - t3,
                    "total": t5 - t0,
                }
            )
            if name == "shadow local":
                h = xxhash.xxh3_64()
                t6 = time.perf_counter()
                for arr in [*snap.arrays.values(), *(t.detach().numpy() for t in snap.placed)]:
                    h.update(arr.view(np.uint8))
                b["xxh3 of the state bytes alone"] = time.perf_counter() - t6
            problems = compare(model, opt, ref)
            if problems:
                msg = f"MISMATCH after '{name}' (breakdown round {rnd}): {problems[:3]}"
                print("!" * 80 + "\n" + msg + "\n" + "!" * 80, file=sys.stderr, flush=True)
                mismatches.append(msg)
            breakdown[name].append(b)
            del model, opt, snap, sd
    out = {
        "state_bytes": state_bytes,
        "params": n_params,
        "read_bytes": read_bytes,
        "times_s": times,
        "first_call_s": first,
        "parts_s": parts_all,
        "breakdown_s": breakdown,
        "mismatches": mismatches,
        "torch_threads": torch.get_num_threads(),
    }
    (work / "restore.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 1.6M-param GPT, 2 steps: under a minute in all")
    ap.add_argument("--n-layer", type=int, default=None, help="GPT layers (default 8; --quick 2)")
    ap.add_argument("--n-embd", type=int, default=None, help="GPT width (default 576, ~32M params; --quick 256)")
    ap.add_argument("--steps", type=int, default=None, help="iterations trained with the shadow (default 3)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up (median)")
    ap.add_argument(
        "--no-evict",
        dest="evict",
        action="store_false",
        help="skip the rows that evict the files from the page cache first",
    )
    ap.add_argument(
        "--no-s3",
        dest="s3",
        action="store_false",
        help="skip the object-store rows (a SeaweedFS S3 server on loopback: `weed` and s3fs, the test extra)",
    )
    ap.add_argument("--dir", default=None, help="where the temp dir goes (the disk measured); default $TMPDIR")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", default="")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--s3-url", default="", help=argparse.SUPPRESS)
    return ap


def _sizes(args) -> None:
    """The model and step defaults (smaller with --quick)."""
    q = args.quick
    args.n_layer = args.n_layer or (2 if q else 8)
    args.n_embd = args.n_embd or (256 if q else 576)
    args.steps = args.steps or (2 if q else 3)


def _object_store(args, work: Path):
    """The S3 server for the object-store rows (None without ``weed`` or s3fs, or with
    --no-s3), the tiers to wait for, and the cluster's remote-tier overrides."""
    if not args.s3:
        return None, ("local",), []
    import importlib.util

    if shutil.which("weed") is None or importlib.util.find_spec("s3fs") is None:
        print("no `weed` or s3fs here (the test extra has both): skipping the object-store rows", flush=True)
        return None, ("local",), []
    from shadow.testing.s3 import S3Server

    s3 = S3Server(work / "s3")
    extra = [f"persist.remote.url=s3://{s3.bucket}/{JOB}/shadow", f"persist.remote.every_n={args.steps}"]
    return s3, ("local", "remote"), extra + ["persist.remote.keep=1"]


def run(args) -> dict:
    """Train with a shadow cluster, then every restore path in a fresh process, the tables
    printed; the JSON document (``bit_identical`` False: a restore differed)."""
    _sizes(args)
    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops the services
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench_restore-", dir=args.dir))
    services = Services(work, __file__)
    common = [
        "--work",
        str(work),
        "--n-layer",
        str(args.n_layer),
        "--n-embd",
        str(args.n_embd),
        "--steps",
        str(args.steps),
        "--repeat",
        str(args.repeat),
    ] + ([] if args.evict else ["--no-evict"])
    s3, tiers, extra = _object_store(args, work)
    try:
        if s3 is not None:
            os.environ.update(s3.env)  # the cluster, the trainer and the restorer read AWS_* from here
            common += ["--s3-url", f"s3://{s3.bucket}/{JOB}"]
        address = services.start_cluster(free_port(), args.steps, extra)
        print(f"shadow cluster at {address} (2 workers), work dir {work}", flush=True)
        services.run("train", common + ["--coordinator", address], timeout=900)
        train = json.loads((work / "train.json").read_text())
        st = wait_persisted(address, args.steps, tiers=tiers)
        print(
            f"trained GPT {train['params'] / 1e6:.1f}M params for {args.steps} iterations "
            f"({train['s_per_step']:.2f} s/step with the shadow); iteration {args.steps} in memory and on the "
            f"local tier ({st['persist']['local']['last_complete']['bytes'] / 1e6:.0f} MB)",
            flush=True,
        )
        services.run("restore", common + ["--coordinator", address], timeout=1800)
        res = json.loads((work / "restore.json").read_text())
    finally:
        services.stop()
        if s3 is not None:
            s3.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    gb = res["state_bytes"] / 1e9
    med = {p: statistics.median(v) for p, v in res["times_s"].items()}
    base = {
        "warm": med["DCP load"],
        "evicted": med.get("DCP load, evicted", med["DCP load"]),
        "s3": med.get("DCP load, S3", med["DCP load"]),
    }
    rows = []
    for p, s in med.items():
        kind = p.split(",")[0]
        rb = res["read_bytes"][kind]
        rows.append(
            {
                "path": p,
                "median_s": s,
                "min_s": min(res["times_s"][p]),
                "max_s": max(res["times_s"][p]),
                "first_call_s": res["first_call_s"][p],
                "state_GBps": gb / s,
                "bytes_read": rb,
                "read_GBps": rb / 1e9 / s,
                "vs_dcp_load": s / base["evicted" if p.endswith("evicted") else "s3" if "S3" in p else "warm"],
            }
        )
    print()
    print(
        f"restore of GPT {res['params'] / 1e6:.1f}M params + AdamW state ({gb:.3f} GB fp32: param, exp_avg, "
        f"exp_avg_sq), 1 trainer, 2 shadow workers, {os.cpu_count()} cores, median of {args.repeat} interleaved "
        f"rounds after a warm-up"
    )
    print(
        f"| {'path':22s} | {'median s':>8s} | {'min s':>6s} | {'1st call':>8s} | {'state GB/s':>10s} | "
        f"{'MB read':>8s} | {'read GB/s':>9s} | {'vs DCP load':>11s} |"
    )
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 12}|{'-' * 10}|{'-' * 11}|{'-' * 13}|")
    for r in rows:
        print(
            f"| {r['path']:22s} | {r['median_s']:8.3f} | {r['min_s']:6.3f} | {r['first_call_s']:8.3f} | "
            f"{r['state_GBps']:10.2f} | {r['bytes_read'] / 1e6:8.1f} | {r['read_GBps']:9.2f} | "
            f"{r['vs_dcp_load']:10.2f}x |"
        )
    print(
        "vs DCP load: seconds / DCP load's seconds (evicted rows: / 'DCP load, evicted'; S3 rows: / 'DCP load, S3', "
        "DCP's fsspec reader); < 1 is faster. "
        "Warm rows read from the page cache; 'shadow memory' reads what the workers send over ZeroMQ."
    )
    print("\nwhere the time goes (median s):")
    for name in ("DCP load", "torch.load"):
        ks = res["parts_s"][name][0].keys()
        print(
            f"  {name:14s} " + ", ".join(f"{k} {statistics.median(d[k] for d in res['parts_s'][name]):.3f}" for k in ks)
        )
    for name, bs in res["breakdown_s"].items():
        print(f"  {name:14s} " + ", ".join(f"{k} {statistics.median(d[k] for d in bs):.3f}" for k in bs[0]))
    ok = not res["mismatches"]
    n_checks = (args.repeat + 1) * len(med) + 2 * args.repeat
    print(
        "\nstate check: "
        + (f"every restore bit-identical to the trained state (torch.equal), {n_checks} restores" if ok else "MISMATCH")
    )
    for m in res["mismatches"]:
        print("  " + m)
    wall = time.monotonic() - t_start
    print(f"wall time {wall:.0f} s")
    return {
        "benchmark": "restore",
        "quick": args.quick,
        "machine": machine_info(),
        "model": {
            "gpt_n_layer": args.n_layer,
            "gpt_n_embd": args.n_embd,
            "params": res["params"],
            "state_bytes": res["state_bytes"],
        },
        "train": train,
        "repeat": args.repeat,
        "rows": rows,
        "times_s": res["times_s"],
        "parts_s": res["parts_s"],
        "shadow_breakdown_s": res["breakdown_s"],
        "torch_threads_in_restorer": res["torch_threads"],
        "bit_identical": ok,
        "mismatches": res["mismatches"],
        "cache_note": "page cache not dropped; warm rows read cached files, evicted rows fsync + "
        "posix_fadvise(DONTNEED) the files first (guest cache only); the shadow reads with "
        "O_DIRECT where the file system allows",
        "wall_s": wall,
    }


def plot(results: dict, path) -> bool:
    """Median seconds of each restore path."""
    rows = results["rows"]
    return bars(
        path,
        [r["path"] for r in rows],
        [r["median_s"] for r in rows],
        f"Restore of {results['model']['params'] / 1e6:.0f}M params + AdamW state",
        "seconds",
        horizontal=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _sizes(args)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.role == "train":
        train_main(args)
        return 0
    if args.role == "restore":
        restore_main(args)
        return 0
    doc = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if doc["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
