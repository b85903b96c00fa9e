"""The processes `bench_restore.py` starts (``--role train``, ``--role restore``): the
trainer that trains the example GPT with the shadow attached and writes the same state
with DCP and ``torch.save``; and the restorer that times every restore path into fresh
models, checks each bit for bit, and splits the shadow's paths into fetch and install.
See bench_restore.py for what is measured and how."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

from benchcluster import compare, dir_bytes, evict
from benchlib import destroy_process_group, example_gpt

JOB = "bench_restore"
LR, WD = 1e-3, 0.1
PATHS = (
    "shadow memory",
    "shadow local",
    "shadow local, evicted",
    "shadow local, via workers",
    "DCP load",
    "DCP load, evicted",
    "torch.load",
    "torch.load, evicted",
    "shadow remote (S3)",
    "DCP load, S3",
    "shadow memory, keyed",
    "shadow local, via workers, keyed",
)

# --------------------------------------------------------------------------- shared


@contextlib.contextmanager
def _client_keys(keys):
    """This process's client sockets use ``keys`` (a keyed cluster's trainer key) inside the
    block, and the process's default keys again after it; ``keys`` None: the default
    throughout (the cluster without keys of its own runs with this user's key set, so its
    clients need that pair, as the trainer that attached to it had).

    Not ``security.set_client(None)`` afterwards: that means *no keys* (a client of a
    ``security.insecure=true`` cluster), which the default cluster refuses at the CURVE
    handshake; its coordinator then never answers (a restore waits out its timeout)."""
    from shadow import security

    if keys is None:
        yield
        return
    security.set_client(keys)
    try:
        yield
    finally:
        security.reset_client()


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
    del ddp, session  # before the group goes, or the trainer may never exit: see destroy_process_group
    destroy_process_group()


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
    from trainer_hooks.capture.model import build_layout
    from trainer_hooks.restorer.sink import ModelParams

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

    keyed_keys = None
    if args.keyed_coordinator:
        from shadow import security

        keys_dir = Path(args.keys)
        keyed_keys = security.client_keys(keys_dir / "server.key", keys_dir / "trainers" / "trainer.key_secret")

    def keyed(fn):
        """``fn`` as a trainer of the keyed cluster: with the trainer key, for this call only."""

        def run(model, opt, parts):
            with _client_keys(keyed_keys):
                fn(model, opt, parts)

        return run

    def via_workers(model, opt, parts, coordinator: str = args.coordinator):
        """The cluster's local tier as a client that sees none of the workers' disks reads it:
        listed by the coordinator, every shard sent by the worker holding it."""
        from shadow.restore.memory import MemorySource
        from shadow.restore.resolve import pick

        t0 = time.perf_counter()
        src = MemorySource(coordinator, 30.0)
        src.candidates(JOB)
        (tier,) = [t for t in src.tiers() if t.name == "local"]
        tier.direct = False
        t1 = time.perf_counter()
        _, snap = pick(tier, JOB, args.steps)
        t2 = time.perf_counter()
        info = trainer_hooks.apply_snapshot(snap, model, opt)
        t3 = time.perf_counter()
        if (info.tier, info.iteration) != ("local", args.steps):
            raise RuntimeError(f"the local tier through the workers gave {info.tier} iteration {info.iteration}")
        parts.update({"ask coordinator": t1 - t0, "read via workers": t2 - t1, "install": t3 - t2})

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
        "shadow local, via workers": (via_workers, None),
        "DCP load": (dcp_load, None),
        "DCP load, evicted": (dcp_load, dcp_dir),
        "torch.load": (torch_load, None),
        "torch.load, evicted": (torch_load, torch_file),
        "shadow remote (S3)": (shadow(args.s3_url + "/shadow", "remote"), None),
        "DCP load, S3": (dcp_load_s3, None),
    }
    if args.keyed_coordinator:
        runs["shadow memory, keyed"] = (keyed(shadow(args.keyed_coordinator, "memory")), None)
        runs["shadow local, via workers, keyed"] = (
            keyed(lambda m, o, p: via_workers(m, o, p, args.keyed_coordinator)),
            None,
        )
    paths = [
        p
        for p in PATHS
        if (args.evict or "evicted" not in p)
        and (args.s3_url or "S3" not in p)
        and (args.keyed_coordinator or "keyed" not in p)
    ]
    times: dict[str, list[float]] = {p: [] for p in paths}
    first: dict[str, float] = {}
    parts_all: dict[str, list[dict]] = {p: [] for p in paths}
    mismatches: list[str] = []
    seed = 1000
    for rnd in range(args.repeat + 1):  # round 0: warm-up ("first call" in a fresh process)
        # each round in its own seeded order: a rotation would keep every row behind the same
        # row each round (the keyed memory row always behind torch.load, which leaves 0.4 GB of
        # freed pages and a cold cache for the next one), biasing the comparison of two rows
        order = paths if rnd == 0 else random.Random(rnd).sample(paths, len(paths))
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
    sources = [("shadow memory", args.coordinator), ("shadow local", str(local))]
    if args.keyed_coordinator:
        sources.append(("shadow memory, keyed", args.keyed_coordinator))
    breakdown: dict[str, list[dict]] = {name: [] for name, _ in sources}
    for rnd in range(args.repeat):
        for name, source in sources:
            seed += 1
            model, opt, _ = build(args, seed)
            gc.collect()
            b: dict = {}
            t0 = time.perf_counter()
            sink = ModelParams.of(*build_layout(model, opt))  # as trainer_hooks.restore: from memory, in place
            if name.startswith("shadow memory"):
                with _client_keys(keyed_keys if name.endswith("keyed") else None):
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
