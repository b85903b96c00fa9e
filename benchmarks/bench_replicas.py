"""What replicas=2 costs and what it buys, measured in one run on this machine.

    python benchmarks/bench_replicas.py [--steps 40] [--n-embd 256] [--json docs/bench/replicas.json]

One gloo rank trains the example GPT (fused AdamW) three ways: no shadow; attached to 2
workers (replicas=1); attached to 4 workers holding 2 shards twice (replicas=2, the
trainer feeds both copies). For each: seconds per step and bytes the trainer sent per
step. Then, in each attached run, worker 1 is SIGKILLed and `shadow cluster` restarts it:
with replicas=1 the job degrades and heals by a resync (every rank re-sends its whole
state); with replicas=2 the replacement copies its shard from the peer. Reported: time
from the kill until every worker is healthy again, whether training had to re-attach,
and the peer-copy time the worker logged. All workers share this machine's cores with
the trainer, so absolute step times include their replay work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from benchlib import Goal, bars, destroy_process_group, example_gpt
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
GPT, CharData, GPTConfig, corpus = example_gpt()

GOALS = [
    Goal(
        "replicas=2: a worker SIGKILL heals without re-attaching",
        "runs.*.reattached",
        False,
        "==",
        where={"replicas": "2"},
    ),
    Goal("replicas={replicas}: step time / no shadow", "runs.*.vs_plain", None, unit="x"),
    Goal("replicas={replicas}: heal after a worker SIGKILL", "runs.*.heal_s", None, unit="s"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--steps", "20"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--steps", "3", "--n-embd", "64"]


def build(n_embd: int):
    data = CharData(corpus(2000))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(data.chars), block_size=64, n_layer=4, n_embd=n_embd))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return data, model, ddp, opt


def step(data, ddp, opt, it: int) -> None:
    x, y = data.batch(it, 0, 8, 64)
    ddp(x, y).backward()
    opt.step()
    opt.zero_grad()


def timed(data, ddp, opt, steps: int, first: int = 1) -> float:
    t0 = time.perf_counter()
    for it in range(first, first + steps):
        step(data, ddp, opt, it)
    return (time.perf_counter() - t0) / steps


def run_attached(workers: int, replicas: int, steps: int, n_embd: int, tmp: Path) -> dict:
    data, model, ddp, opt = build(n_embd)
    cluster = LocalCluster(tmp, workers=workers, args=(f"replicas={replicas}",), env={"SHADOW_WORKER_LOST_S": "2"})
    try:
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, job=f"r{replicas}")
        timed(data, ddp, opt, 3)  # warm-up
        out0 = session.stats()["bytes_out"]
        per_step = timed(data, ddp, opt, steps, first=4)
        bytes_per_step = (session.stats()["bytes_out"] - out0) / steps
        epoch, it = session.epoch, 3 + steps
        victim = cluster.status()["workers"][1]["pid"]
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        healed = None
        while time.monotonic() - t_kill < 120:
            it += 1
            step(data, ddp, opt, it)
            st = cluster.status()
            w = st["workers"][1]
            if (
                w["pid"] != victim
                and all(x["health"] == "ok" for x in st["workers"])
                and st["job"]["status"] == "running"
                and st["job"]["committed"] >= it - 3
            ):
                healed = time.monotonic() - t_kill
                break
        session.close()
        log = cluster.log.read_text(errors="replace")
        copy = re.findall(r"copied iteration \d+ from peer worker \d+ in ([0-9.]+) s", log)
        return {
            "workers": workers,
            "replicas": replicas,
            "s_per_step": per_step,
            "bytes_per_step": bytes_per_step,
            "heal_s": healed,
            "reattached": session.epoch != epoch,
            "peer_copy_s": float(copy[0]) if copy else None,
        }
    finally:
        cluster.stop()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--json", default="")
    return ap


def run(args) -> dict:
    """No shadow, replicas=1 and replicas=2 (each with a worker SIGKILL), the table
    printed; the JSON document. Initialises (and destroys) a gloo group of one."""
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_replicas-"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    data, model, ddp, opt = build(args.n_embd)
    params = sum(p.numel() for p in model.parameters())
    timed(data, ddp, opt, 3)
    plain = timed(data, ddp, opt, args.steps, first=4)
    rows = [run_attached(2, 1, args.steps, args.n_embd, tmp), run_attached(4, 2, args.steps, args.n_embd, tmp)]
    for r in rows:
        r["vs_plain"] = r["s_per_step"] / plain
    print(f"GPT {params / 1e6:.2f}M params, 1 rank, {args.steps} steps; no shadow: {plain * 1e3:.1f} ms/step")
    print(
        "| workers | replicas | ms/step | vs no shadow | MB sent/step "
        "| heal after SIGKILL (s) | re-attach | peer copy (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        heal = "-" if r["heal_s"] is None else f"{r['heal_s']:.2f}"
        copy = "-" if r["peer_copy_s"] is None else f"{r['peer_copy_s']:.3f}"
        print(
            f"| {r['workers']} | {r['replicas']} | {r['s_per_step'] * 1e3:.1f} | {r['s_per_step'] / plain:.2f}x | "
            f"{r['bytes_per_step'] / 1e6:.1f} | {heal} | {'yes' if r['reattached'] else 'no'} | {copy} |"
        )
    del ddp  # before the group goes, or this process may never exit: see destroy_process_group
    destroy_process_group()
    return {"params": params, "plain_s_per_step": plain, "runs": rows, "machine": f"{os.cpu_count()} cores"}


def plot(results: dict, path) -> bool:
    """Milliseconds per step with no shadow and with replicas=1 and 2 (the heal times are
    single events: in the table, not plotted)."""
    runs = results["runs"]
    return bars(
        path,
        ["no shadow"] + [f"replicas={r['replicas']}" for r in runs],
        [1e3 * results["plain_s_per_step"]] + [1e3 * r["s_per_step"] for r in runs],
        f"Replicas, GPT {results['params'] / 1e6:.1f}M, 1 rank",
        "ms / step",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
