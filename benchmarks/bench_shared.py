"""Jobs on one shared cluster against each alone on a cluster of its share, measured in one
run on this machine.

    python benchmarks/bench_shared.py [--steps 30] [--n-embd 384] [--gpu-ms 60] [--json docs/bench/shared.json]

Two jobs (the example GPT, fused AdamW, one gloo rank each, in processes of their own) on
one ``shadow cluster shared=true`` with ``cores_per_job=1``: each job's one worker is
pinned to a core of its own, and so is the job's trainer process (to its job's core: this
machine has no GPU hosts apart, so a job's share is its core). A step is the model's
forward and backward on a small batch, then ``--gpu-ms`` of sleep standing for the GPU's
work (this machine has none), then the optimizer step. Job a and job b are measured alone
(attached while the other job's trainer runs the same loop without a shadow: the trainers'
own CPU load is the same in both runs, and only the other job's replay is missing), then
together. Reported: each job's median seconds per step alone and shared, and their ratio
(goal: within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Goal, bars

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("a", "b")

GOALS = [
    Goal("job {job}: step time shared / alone on its share", "jobs.*.ratio", 1.05, "<=", unit="x"),
]
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--steps", "30"]
ARGS_FULL = ["--steps", "100"]
ARGS_SMOKE = ["--steps", "4", "--n-embd", "64", "--gpu-ms", "5"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--gpu-ms", type=float, default=60.0, help="sleep per step, standing for the GPU's work")
    ap.add_argument("--json", default="")
    ap.add_argument("--trainer", nargs=3, metavar=("ADDRESS", "JOB", "OUT"), help=argparse.SUPPRESS)
    return ap


def trainer(args) -> None:
    """One job's rank: ``--steps`` timed steps after 3 warm-up ones, attached to the cluster
    at ADDRESS ("-": no shadow); each step's seconds to OUT (JSON)."""
    import torch
    import torch.distributed as dist
    from benchlib import destroy_process_group, example_gpt
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks

    address, job, out = args.trainer
    torch.set_num_threads(1)
    store = dist.FileStore(out + ".store", 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    GPT, CharData, GPTConfig, corpus = example_gpt()
    data = CharData(corpus(2000))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(data.chars), block_size=8, n_layer=4, n_embd=args.n_embd))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    attached = address != "-"  # (overwrite: the same job names run again from iteration 0)
    session = trainer_hooks.attach(ddp, opt, coordinator=address, job=job, overwrite=True) if attached else None
    times = []
    for it in range(1, args.steps + 4):
        t0 = time.perf_counter()
        x, y = data.batch(it, 0, 1, 8)  # little CPU: the GPU's work is the sleep below
        ddp(x, y).backward()
        time.sleep(args.gpu_ms / 1e3)
        opt.step()
        opt.zero_grad()
        if it > 3:
            times.append(time.perf_counter() - t0)
    committed = session.close() if session is not None else None
    params = sum(p.numel() for p in model.parameters())
    Path(out).write_text(json.dumps({"times": times, "committed": committed, "params": params}))
    del ddp, session
    destroy_process_group()


def _run(address: str, attached: set[str], args, tmp: Path, tag: str, pinned: dict) -> dict[str, dict]:
    """Both jobs' trainers at once, those in ``attached`` attached to ``address``; each
    pinned to the core in ``pinned`` (its job's), if any."""
    procs = {}
    for job in JOBS:
        out = tmp / f"{tag}-{job}.json"
        cmd = [sys.executable, __file__, "--trainer", address if job in attached else "-", job, str(out)]
        cmd += ["--steps", str(args.steps), "--n-embd", str(args.n_embd), "--gpu-ms", str(args.gpu_ms)]
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
        core = pinned.get(job)  # the job's trainer on its job's core, as its worker (this host has no GPU host apart)
        pin = (lambda c=core: os.sched_setaffinity(0, {c})) if core is not None else None
        procs[job] = (subprocess.Popen(cmd, env=env, cwd=ROOT, preexec_fn=pin), out)
    results = {}
    for job, (p, out) in procs.items():
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"job {job}'s trainer ({tag}) exited with status {p.returncode}")
        results[job] = json.loads(out.read_text())
    return results


def run(args) -> dict:
    from shadow.testing import LocalCluster

    tmp = Path(tempfile.mkdtemp(prefix="bench_shared-"))
    cpus = sorted(os.sched_getaffinity(0))
    cores = 1 if len(cpus) >= len(JOBS) else 0
    pinned = {job: cpus[i] for i, job in enumerate(JOBS)} if cores else {}  # the front gives cores in this order
    cluster = LocalCluster(tmp, workers=1, args=("shared=true", f"cores_per_job={cores}"))
    try:
        alone = {}
        for job in JOBS:  # alone on its share: the other job's trainer runs, unattached
            alone[job] = _run(cluster.address, {job}, args, tmp, f"alone-{job}", pinned)[job]
        both = _run(cluster.address, set(JOBS), args, tmp, "shared", pinned)
    finally:
        cluster.stop()
    rows = {}
    for job in JOBS:
        a, s = statistics.median(alone[job]["times"]), statistics.median(both[job]["times"])
        rows[job] = {
            "job": job,
            "alone_s_per_step": a,
            "shared_s_per_step": s,
            "ratio": s / a,
            "committed": both[job]["committed"],
        }
    params = both[JOBS[0]]["params"]
    print(
        f"GPT {params / 1e6:.2f}M params per job, 1 rank each, {args.steps} steps, {args.gpu_ms:g} ms 'GPU' per "
        f"step; 1 worker per job, "
        + ("each job (worker and trainer) pinned to a core of its own" if cores else "not pinned (too few cores)")
    )
    print("| job | alone on its share (ms/step) | shared (ms/step) | shared / alone |")
    print("|---|---|---|---|")
    for r in rows.values():
        print(
            f"| {r['job']} | {r['alone_s_per_step'] * 1e3:.1f} | {r['shared_s_per_step'] * 1e3:.1f} | "
            f"{r['ratio']:.3f}x |"
        )
    return {"params": params, "jobs": rows, "cores_per_job": cores, "machine": f"{os.cpu_count()} cores"}


def plot(results: dict, path) -> bool:
    rows = list(results["jobs"].values())
    labels = [f"{r['job']} {k}" for r in rows for k in ("alone", "shared")]
    values = [1e3 * r[f"{k}_s_per_step"] for r in rows for k in ("alone", "shared")]
    return bars(path, labels, values, "Two jobs on one shared cluster", "ms / step")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.trainer:
        trainer(args)
        return 0
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
