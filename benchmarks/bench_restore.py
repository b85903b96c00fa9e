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

Keyed rows (without --no-keyed): a second cluster with role keys (``security.data=mac``,
its own local tier), trained the same way by a trainer carrying the trainer key; the
restorer switches to that key for these rows only:

  shadow memory, keyed            trainer_hooks.restore(model, opt, source=<the keyed cluster>)
  shadow local, via workers, keyed  its local tier, every shard through the worker holding it

"keyed / no keys" compares each with the same row of the cluster without keys.

One warm-up round (reported as "first call", not in the median), then --repeat rounds;
the paths run interleaved, in a seeded random order each round; the figure is the median. After
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
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchcluster import Services, free_port, wait_persisted
from benchlib import Goal, bars, machine_info
from restorer import JOB, restore_main, train_main

ROOT = Path(__file__).resolve().parents[1]


GOALS = [
    Goal("restore {path} / DCP load", "rows.*.vs_dcp_load", 0.5, "<=", "x", where={"path": "shadow local*"}),
    Goal("restore {path} / DCP load", "rows.*.vs_dcp_load", 0.5, "<=", "x", where={"path": "shadow memory*"}),
    Goal("restore {path} / DCP load, S3", "rows.*.vs_dcp_load", 1.0, "<=", "x", where={"path": "shadow remote*"}),
    Goal("every restore bit-identical to the trained state", "bit_identical", True, "=="),
    Goal("restore {path}, median seconds", "rows.*.median_s", None, unit="s"),
    Goal("restore shadow memory, keyed (mac) / no keys", "keyed_memory_vs_plain", 1.2, "<=", "x"),
    Goal("restore shadow local via workers, keyed / no keys", "keyed_via_workers_vs_plain", None, unit="x"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--no-evict", "--repeat", "5"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--quick", "--no-evict", "--repeat", "1"]


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
    ap.add_argument(
        "--no-keyed",
        dest="keyed",
        action="store_false",
        help="skip the rows of a keyed cluster (role keys, security.data=mac)",
    )
    ap.add_argument("--dir", default=None, help="where the temp dir goes (the disk measured); default $TMPDIR")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", default="")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--s3-url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--keyed-coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="", help=argparse.SUPPRESS)
    return ap


def _keyed_cluster(services: Services, work: Path, steps: int, common: list[str]) -> str:
    """A second cluster, with role keys (security.data=mac), trained as the first one; its
    address (the restorer gets the keys directory)."""
    from shadow import security

    keys = work / "keys"
    security.generate(keys, "server")
    for role in ("worker", "trainer", "admin"):
        security.generate(keys / f"{role}s", role)
    args = [
        f"security.server_key={keys / 'server.key_secret'}",
        f"security.client_key={keys / 'workers' / 'worker.key_secret'}",
        *(f"security.allow_{r}s={keys / f'{r}s'}" for r in ("worker", "trainer", "admin")),
        "security.data=mac",
    ]
    admin = security.client_keys(keys / "server.key", keys / "admins" / "admin.key_secret")
    address = services.start_cluster(free_port(), steps, args, local=work / "keyed" / "local", keys=admin)
    env = {
        security.ENV_SERVER_KEY: str(keys / "server.key"),
        security.ENV_CLIENT_KEY: str(keys / "trainers" / "trainer.key_secret"),
    }
    (work / "keyed").mkdir(exist_ok=True)
    argv = [*common, "--coordinator", address, "--work", str(work / "keyed")]
    services.run("train", argv, timeout=900, env_extra=env)
    wait_persisted(address, steps, keys=admin)
    print(f"keyed shadow cluster at {address} (role keys, security.data=mac), trained the same", flush=True)
    return address


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
        keyed = []
        if args.keyed:
            keyed_at = _keyed_cluster(services, work, args.steps, common)
            keyed = ["--keyed-coordinator", keyed_at, "--keys", str(work / "keys")]
        print(
            f"trained GPT {train['params'] / 1e6:.1f}M params for {args.steps} iterations "
            f"({train['s_per_step']:.2f} s/step with the shadow); iteration {args.steps} in memory and on the "
            f"local tier ({st['persist']['local']['last_complete']['bytes'] / 1e6:.0f} MB)",
            flush=True,
        )
        services.run("restore", common + ["--coordinator", address] + keyed, timeout=1800)
        res = json.loads((work / "restore.json").read_text())
    finally:
        services.stop()
        if s3 is not None:
            s3.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    gb = res["state_bytes"] / 1e9
    med = {p: statistics.median(v) for p, v in res["times_s"].items()}
    keyed_vs_plain = {
        p.removesuffix(", keyed"): s / med[p.removesuffix(", keyed")] for p, s in med.items() if p.endswith(", keyed")
    }
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
    for p, x in keyed_vs_plain.items():
        print(f"keyed (role keys, security.data=mac) / no keys, {p}: {x:.2f}x")
    print("\nwhere the time goes (median s):")
    for name in ("DCP load", "torch.load", "shadow local, via workers"):
        if not res["parts_s"].get(name):
            continue
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
        "keyed_vs_plain": keyed_vs_plain,
        "keyed_memory_vs_plain": keyed_vs_plain.get("shadow memory"),
        "keyed_via_workers_vs_plain": keyed_vs_plain.get("shadow local, via workers"),
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
