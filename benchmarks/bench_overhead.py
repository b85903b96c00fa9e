"""Trainer overhead of checkpointing, side by side in one run: 2-rank gloo DDP training of
the example GPT with no checkpointing, with the shadow attached (workers on this machine),
with DCP async_save every iteration and every 50, and with torch.save every iteration.
``shadow`` is the default cluster: keyed with this user's key set (``security.data=mac``),
the ranks finding it themselves. ``shadow_insecure``: without any keys
(``security.insecure=true``, ranks ``SHADOW_INSECURE=1``), the baseline of the keyed modes.
``shadow_mac`` and ``shadow_curve``: a cluster with role keys of its own (``security.data=mac``
and ``curve``), the ranks carrying the trainer key.

    python benchmarks/bench_overhead.py [--steps 20] [--rounds 1] [--n-layer 6] [--n-embd 512] [--json PATH]

Each mode runs in fresh rank processes; the figure is seconds per step over the timed
steps (after 3 warm-up steps), taken on rank 0, and its ratio to no checkpointing; with
--rounds R the modes run R times in interleaved order and the figure is the median.
Goals (issue 6): shadow <= 1.05x, and the shadow's overhead <= 1/5 of DCP async_save's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Goal, bars, destroy_process_group, example_gpt, machine_info

ROOT = Path(__file__).resolve().parents[1]
MODES = (
    "none",
    "shadow",
    "dcp_async",
    "torch_save",
    "dcp_async_50",
    "shadow_mac",
    "shadow_curve",
    "python_hook",
    "shadow_insecure",
)
DEFAULT_MODES = ("none", "shadow", "dcp_async", "torch_save", "dcp_async_50", "shadow_insecure")

GOALS = [
    Goal("step time, shadow / none", "vs_none.shadow", 1.05, "<=", "x"),
    Goal("shadow overhead / DCP async_save overhead", "overhead_vs_dcp_async", 0.2, "<="),
    Goal("step time, {key} / none", "vs_none.*", None, unit="x", where={"key": "!shadow"}),
    Goal("step time, {key} (keyed) / shadow_insecure (no keys)", "keyed_vs_plain.*", None, unit="x"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--steps", "8", "--rounds", "2", "--n-layer", "8", "--n-embd", "576"]
ARGS_FULL = ["--steps", "20", "--rounds", "3", "--n-layer", "8", "--n-embd", "576"]
ARGS_SMOKE = ["--steps", "2", "--rounds", "1", "--n-layer", "1", "--n-embd", "64", "--modes", "none,shadow"]


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    GPT, CharData, GPTConfig, corpus = example_gpt()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = CharData(corpus(4000))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(data.chars), block_size=64, n_layer=args.n_layer, n_embd=args.n_embd))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    session = None
    if args.mode == "python_hook":  # diagnostic: the shadow's reduce path as a Python hook, nothing streamed

        def hook(_state, bucket):
            buf = bucket.buffer()
            buf.mul_(1.0 / dist.get_world_size())
            fut = dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
            return fut.then(lambda f: f.value())

        ddp.register_comm_hook(None, hook)
    if args.mode.startswith("shadow"):
        import trainer_hooks

        session = trainer_hooks.attach(ddp, opt, coordinator=args.coordinator, job="bench")
    out = Path(args.out)
    fut = None
    # DCP's async save runs collectives from a background thread: give it its own group so
    # they never interleave with DDP's all-reduces on the default one
    ckpt_pg = dist.new_group(backend="gloo") if args.mode.startswith("dcp") else None

    def checkpoint(it: int, ddp) -> None:
        nonlocal fut
        if args.mode in ("dcp_async", "dcp_async_50") and (args.mode == "dcp_async" or it % 50 == 0):
            if fut is not None:
                fut.result()  # one save in flight, like a real loop
            msd, osd = get_state_dict(ddp, opt)
            fut = dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=str(out / f"dcp-{it % 2}"), process_group=ckpt_pg
            )
        elif args.mode == "torch_save" and rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out / "ckpt.pt")

    t0 = 0.0
    for it in range(1, args.steps + 4):
        if it == 4:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = data.batch(it, rank, 8, 64)
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
        checkpoint(it, ddp)
    if fut is not None:
        fut.result()
    dist.barrier()
    per_step = (time.perf_counter() - t0) / args.steps
    if session is not None:
        session.close()
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        (out / "result.json").write_text(json.dumps({"mode": args.mode, "s_per_step": per_step, "params": n}))
    del ddp, session  # before the group goes, or this rank may never exit: see destroy_process_group
    destroy_process_group()


def launch(mode: str, args, work: Path, coordinator: str = "", env_extra: dict | None = None) -> dict:
    out = work / mode
    out.mkdir(parents=True, exist_ok=True)
    port = str(29500 + os.getpid() % 1000 + MODES.index(mode))
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            PYTHONPATH=str(ROOT),
            **(env_extra or {}),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-mode",
                    mode,
                    "--out",
                    str(out),
                    "--steps",
                    str(args.steps),
                    "--n-layer",
                    str(args.n_layer),
                    "--n-embd",
                    str(args.n_embd),
                    "--coordinator",
                    coordinator,
                ],
                env=env,
                cwd=ROOT,
            )
        )
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"mode {mode}: a rank exited with {p.returncode}")
    res = json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per mode (the figure is the median)")
    ap.add_argument("--json", default="")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated, of " + ",".join(MODES))
    ap.add_argument("--rank-mode", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    return ap


def run(args) -> dict:
    """Every mode in fresh 2-rank processes (``--rounds`` interleaved rounds), the table
    printed; the JSON document, with each mode's step time against none (``vs_none``)."""
    from shadow.testing import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="bench_overhead-"))
    runs: dict[str, list[dict]] = {}
    modes = [m for m in args.modes.split(",") if m]
    for rnd in range(args.rounds):  # interleaved rounds: drift on a noisy machine hits every mode alike
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            if mode.startswith("shadow"):
                if mode == "shadow":  # the default: this user's key set, found by every process
                    cluster = LocalCluster(work, workers=2)
                    env = None
                elif mode == "shadow_insecure":
                    cluster = LocalCluster(work, workers=2, args=("security.insecure=true",))
                    env = {"SHADOW_INSECURE": "1"}
                else:
                    sec = _keys(work, mode.removeprefix("shadow_"))
                    cluster = LocalCluster(work, workers=2, args=sec["args"], keys=sec["admin"])
                    env = sec["env"]
                try:
                    res = launch(mode, args, work, cluster.address, env)
                finally:
                    cluster.stop()
            else:
                res = launch(mode, args, work)
            runs.setdefault(mode, []).append(res)
            print(f"  round {rnd + 1} {mode}: {res['s_per_step']:.3f} s/step", flush=True)
    results = {}
    for mode in modes:
        times = sorted(r["s_per_step"] for r in runs[mode])
        results[mode] = dict(runs[mode][0], s_per_step=statistics.median(times), rounds=times)
    base = results.get("none", next(iter(results.values())))["s_per_step"]
    params = results.get("none", next(iter(results.values())))["params"]
    print(
        f"GPT {params / 1e6:.1f}M params, 2 gloo ranks, {args.steps} timed steps, {os.cpu_count()} cores "
        "(the shadow's workers share them)"
    )
    print("| mode | s/step | vs no checkpoint |")
    print("|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['s_per_step']:.3f} | {r['s_per_step'] / base:.2f}x |")
    if "shadow" in results and "dcp_async" in results:
        sh, dc = results["shadow"]["s_per_step"] - base, results["dcp_async"]["s_per_step"] - base
        print(f"shadow overhead / DCP async_save overhead: {sh / dc:.2f} (goal <= 0.2)" if dc > 0 else "")
    keyed_vs_plain = {
        m: results[m]["s_per_step"] / results["shadow_insecure"]["s_per_step"]
        for m in ("shadow", "shadow_mac", "shadow_curve")
        if m in results and "shadow_insecure" in results
    }
    for k, x in keyed_vs_plain.items():
        print(f"step time, {k} (keyed) / shadow_insecure (no keys): {x:.2f}x")
    shutil.rmtree(work, ignore_errors=True)
    doc = {
        "params": params,
        "steps": args.steps,
        "rounds": args.rounds,
        "results": results,
        "machine": machine_info(),
        "vs_none": {m: r["s_per_step"] / base for m, r in results.items() if m != "none" and "none" in results},
        "keyed_vs_plain": keyed_vs_plain,
    }
    if "shadow" in results and "dcp_async" in results:
        sh, dc = results["shadow"]["s_per_step"] - base, results["dcp_async"]["s_per_step"] - base
        if dc > 0:
            doc["overhead_vs_dcp_async"] = sh / dc
    return doc


def _keys(work: Path, data: str) -> dict:
    """A keyed cluster's role keys under ``work`` (made once): its arguments with
    ``security.data=data``, the admin's client keys, and the trainer ranks' environment."""
    from shadow import security

    keys = work / "keys"
    if not (keys / "server.key").exists():
        security.generate(keys, "server")
        for role in ("worker", "trainer", "admin"):
            security.generate(keys / f"{role}s", role)
    return {
        "args": (
            f"security.server_key={keys / 'server.key_secret'}",
            f"security.client_key={keys / 'workers' / 'worker.key_secret'}",
            *(f"security.allow_{r}s={keys / f'{r}s'}" for r in ("worker", "trainer", "admin")),
            f"security.data={data}",
        ),
        "admin": security.client_keys(keys / "server.key", keys / "admins" / "admin.key_secret"),
        "env": {
            security.ENV_SERVER_KEY: str(keys / "server.key"),
            security.ENV_CLIENT_KEY: str(keys / "trainers" / "trainer.key_secret"),
        },
    }


def plot(results: dict, path) -> bool:
    """Step time of each mode against no checkpointing, the goal line at 1.05x."""
    r = results["results"]
    base = r.get("none", next(iter(r.values())))["s_per_step"]
    return bars(
        path,
        list(r),
        [r[m]["s_per_step"] / base for m in r],
        f"Trainer overhead, GPT {results['params'] / 1e6:.0f}M, 2 gloo ranks",
        "step time / no checkpoint",
        goal=1.05,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rank_mode:
        args.mode = args.rank_mode
        rank_main(args)
        return 0
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
