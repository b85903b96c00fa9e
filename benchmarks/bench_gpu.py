"""The shadow on a GPU: step-time overhead, hook time, restore time and fidelity.

    python benchmarks/bench_gpu.py [--accum 8,2] [--modes none,shadow,shadow_foreach,dcp]
                                [--steps 16] [--warmup 4] [--json PATH] [--tiny] [--device cuda|cpu]

The protocol of issue 17: GPT-124M (12 layers, width 768, 12 heads, vocab 50304, block
1024, tied embeddings, ``F.scaled_dot_product_attention``), bf16 autocast,
AdamW(fused=True, lr 3e-4, betas (0.9, 0.95), wd 0.1); micro-batch 16 x 1024 tokens,
gradient accumulation with ``ddp.no_sync()``; world size 1 on
``init_process_group("cpu:gloo,cuda:nccl")`` (DCP's async_save needs both); a shadow
cluster of 5 workers x 2 numba threads pinned with ``taskset`` to the cores the trainer
does not use (the trainer on cores 0-5); the median step time over ``--steps`` steps after
``--warmup`` (each step ends with a device synchronise, in every mode alike).

Modes, each in a fresh trainer process: ``none``; ``shadow`` (attached, fused AdamW);
``shadow_foreach`` (attached, foreach AdamW); ``dcp`` (``dcp.async_save`` every iteration,
one save in flight). The shadow modes also report the hook time on the autograd thread
(per bucket and per step, ``session.stats()``), the blocked time, the restore time from
shadow memory against ``dcp.load`` of the same state from the page cache, and fidelity
after the last step: the max ulp and the fraction of differing elements between the
restored param / exp_avg / exp_avg_sq and the live ones.

``--tiny --device cpu`` runs the same code on a small model with gloo (a smoke run).
Goals (H200): shadow/none <= 1.005 at accumulation 8, <= 1.03 at accumulation 2; hook
time <= 1 ms per bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Goal, bars, destroy_process_group, machine_info

from shadow.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "shadow", "shadow_foreach", "dcp")

_SHADOW = {"mode": "shadow*"}
GOALS = [
    Goal("accum {accum}: {mode} / none", "results.*.vs_none", 1.005, "<=", "x", where={**_SHADOW, "accum": "8"}),
    Goal("accum {accum}: {mode} / none", "results.*.vs_none", 1.03, "<=", "x", where={**_SHADOW, "accum": "2"}),
    Goal("accum {accum}, {mode}: hook time per bucket", "results.*.hook_ms_per_bucket", 1.0, "<=", "ms"),
    Goal("accum {accum}: {mode} / none", "results.*.vs_none", None, unit="x", where={"mode": "!shadow*"}),
]
NEEDS_CUDA = True  # bench_all.py skips it where torch sees no CUDA device
# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
# (--smoke: seconds, the figures meaningless)
ARGS_QUICK = ["--steps", "8", "--warmup", "2"]
ARGS_FULL: list[str] = []
ARGS_SMOKE = ["--tiny", "--steps", "2", "--warmup", "1", "--accum", "2"]


def build_model(tiny: bool):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    vocab, block, layers, heads, width = (512, 64, 2, 2, 64) if tiny else (50304, 1024, 12, 12, 768)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(width), Attention(), nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied embeddings
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, idx, targets):
            pos = torch.arange(idx.size(1), device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))

    return GPT(), vocab, block


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = args.device == "cuda"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, vocab, block = build_model(args.tiny)
    model.to(device)
    ddp = DDP(model, device_ids=[0] if cuda else None)
    micro = 2 if args.tiny else 16
    impl = {"foreach": True} if args.mode == "shadow_foreach" else {"fused": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **impl)
    session = None
    job = f"bench-{args.mode}-{args.accum}"
    if args.mode.startswith("shadow"):
        import trainer_hooks

        session = trainer_hooks.attach(ddp, opt, coordinator=args.coordinator, job=job)
    work = Path(args.out)
    ckpt_pg = dist.new_group(backend="gloo") if args.mode == "dcp" else None
    fut = None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times = []
    total = args.warmup + args.steps
    for it in range(1, total + 1):
        sync()
        t0 = time.perf_counter()
        for m in range(args.accum):
            g = torch.Generator(device=device).manual_seed(it * 1000 + m)
            tok = torch.randint(0, vocab, (micro, block + 1), generator=g, device=device)
            ctx = ddp.no_sync() if m < args.accum - 1 else contextlib.nullcontext()
            with ctx:
                with autocast:
                    loss = ddp(tok[:, :-1], tok[:, 1:]) / args.accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.mode == "dcp":
            if fut is not None:
                fut.result()  # one save in flight, like a real loop
            msd, osd = get_state_dict(ddp, opt)
            fut = dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=str(work / f"dcp-{it % 2}"), process_group=ckpt_pg
            )
        sync()
        if it > args.warmup:
            times.append(time.perf_counter() - t0)
    if fut is not None:
        fut.result()
    result = {
        "mode": args.mode,
        "accum": args.accum,
        "s_per_step": statistics.median(times),
        "times": times,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if session is not None:
        st = session.stats()
        steps = max(st["steps"], 1)
        result.update(
            hook_ms_per_bucket=1e3 * st["hook_s_per_bucket"],
            hook_ms_per_step=1e3 * st["hook_s"] / steps,
            buckets_per_step=st["buckets"] / steps,
            blocked_s=st["blocked_s"],
            bytes_out_per_step=st["bytes_out"] / steps,
        )
        committed = session.close()
        result["committed"] = committed
        result.update(restore_and_fidelity(args, model, opt, device, total, job))
    print(json.dumps(result), flush=True)
    (work / "result.json").write_text(json.dumps(result))
    del ddp, session  # before the group goes, or this rank may never exit: see destroy_process_group
    destroy_process_group()


def restore_and_fidelity(args, model, opt, device, iteration: int, job: str) -> dict:
    """Restore from shadow memory into a fresh model (timed), compare it with the live
    state (ulp), and time ``dcp.load`` of the same live state from the page cache."""
    import torch
    import torch.distributed.checkpoint as dcp

    import trainer_hooks
    from shadow.testing import ulp_report

    torch.manual_seed(1)
    fresh, _, _ = build_model(args.tiny)
    fresh.to(device)
    impl = {"foreach": True} if args.mode == "shadow_foreach" else {"fused": True}
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **impl)
    t0 = time.perf_counter()
    info = trainer_hooks.restore(fresh, fresh_opt, source=args.coordinator, job=job, rank=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - t0
    out = {"restore_s": restore_s, "restored_iteration": info.iteration, "restore_tier": info.tier}
    fid = {}
    live_params, fresh_params = list(model.parameters()), list(fresh.parameters())
    for key in ("param", "exp_avg", "exp_avg_sq"):
        worst = {"max_ulp": 0, "frac_diff": 0.0}
        n_total, n_diff = 0, 0.0
        for p, q in zip(live_params, fresh_params, strict=True):
            a = p if key == "param" else opt.state[p][key]
            b = q if key == "param" else fresh_opt.state[q][key]
            r = ulp_report(a, b)
            worst["max_ulp"] = max(worst["max_ulp"], r["max_ulp"])
            n_total += a.numel()
            n_diff += r["frac_diff"] * a.numel()
        worst["frac_diff"] = n_diff / max(n_total, 1)
        fid[key] = worst
    out["fidelity"] = fid
    out["fidelity_iteration"] = iteration
    # dcp.load of the same (live) state, written just before: served from the page cache
    path = Path(args.out) / "dcp-ref"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(path))
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(path))
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["dcp_load_s"] = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return out


class ShadowCluster:
    """A local cluster (127.0.0.1, a free port), its processes pinned to ``cores``."""

    def __init__(self, work: Path, workers: int, threads: int, cores: str | None) -> None:
        from shadow.testing import status

        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        self.log = open(work / "cluster.log", "a")  # noqa: SIM115 (closed in stop())
        pin = ["taskset", "-c", cores] if cores else []
        self.proc = subprocess.Popen(
            pin
            + [
                sys.executable,
                "-m",
                "shadow",
                "cluster",
                f"workers={workers}",
                f"port={port}",
                "host=127.0.0.1",
                f"threads_per_worker={threads}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                st = status(self.address, timeout=1.0)
                if sum(1 for w in st["workers"] if w["ready"]) == workers:
                    return
            except TimeoutError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the shadow cluster did not start; see {work / 'cluster.log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def launch(mode: str, accum: int, args, work: Path, coordinator: str, cores: str | None) -> dict:
    out = work / f"{mode}-{accum}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    pin = ["taskset", "-c", cores] if cores else []
    cmd = (
        pin
        + [
            sys.executable,
            __file__,
            "--rank-mode",
            mode,
            "--rank-accum",
            str(accum),
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
            "--coordinator",
            coordinator,
        ]
        + (["--tiny"] if args.tiny else [])
    )
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=1800)
    res = json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return res


def pinning(args) -> tuple[str | None, str | None]:
    """(trainer cores, cluster cores): the trainer on --trainer-cores, the cluster on the rest."""
    n = os.cpu_count() or 1
    lo, _, hi = args.trainer_cores.partition("-")
    first, last = int(lo), int(hi or lo)
    if shutil.which("taskset") is None or n <= last + 1:
        return None, None  # too few cores to split (or no taskset): nothing pinned, and the table says so
    return f"{first}-{last}", f"{last + 1}-{n - 1}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accum", default="8,2")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ",".join(MODES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument("--trainer-cores", default="0-5")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke run)")
    ap.add_argument("--json", default="")
    ap.add_argument("--rank-mode", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank-accum", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    return ap


def run(args) -> dict:
    """Every accumulation x mode in a fresh trainer process, the table printed; the JSON
    document (each result with its step time against none at that accumulation,
    ``vs_none``). Needs a CUDA device unless ``--device cpu``."""
    import torch

    trainer_cores, cluster_cores = pinning(args)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    modes = [m for m in args.modes.split(",") if m]
    results: list[dict] = []
    try:
        for accum in (int(a) for a in args.accum.split(",") if a):
            for mode in modes:
                cluster = None
                if mode.startswith("shadow"):
                    cluster = ShadowCluster(work, args.workers, args.worker_threads, cluster_cores)
                try:
                    res = launch(mode, accum, args, work, cluster.address if cluster else "", trainer_cores)
                finally:
                    if cluster is not None:
                        cluster.stop()
                results.append(res)
                print(f"  accum {accum} {mode}: {res['s_per_step']:.4f} s/step", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in results:
        base = next((b["s_per_step"] for b in results if b["mode"] == "none" and b["accum"] == r["accum"]), None)
        if base and r["mode"] != "none":
            r["vs_none"] = r["s_per_step"] / base
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (cpu)"
    print(
        f"\n{gpu}, torch {torch.__version__}, trainer cores {trainer_cores or 'not pinned'}, cluster cores "
        f"{cluster_cores or 'not pinned'} ({args.workers} workers x {args.worker_threads} threads), "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(
        "| accum | mode | s/step | vs none | hook ms/bucket | hook ms/step | blocked s | restore s | dcp.load s "
        "| max ulp p/m/v | differing p/m/v |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next((b["s_per_step"] for b in results if b["mode"] == "none" and b["accum"] == r["accum"]), math.nan)
        fid = r.get("fidelity")
        ulp = "/".join(str(fid[k]["max_ulp"]) for k in ("param", "exp_avg", "exp_avg_sq")) if fid else "-"
        frac = "/".join(f"{fid[k]['frac_diff']:.2e}" for k in ("param", "exp_avg", "exp_avg_sq")) if fid else "-"

        def f(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        print(
            f"| {r['accum']} | {r['mode']} | {r['s_per_step']:.4f} | {r['s_per_step'] / base:.4f} | "
            f"{f('hook_ms_per_bucket', '.3f')} | {f('hook_ms_per_step', '.2f')} | {f('blocked_s', '.3f')} | "
            f"{f('restore_s', '.2f')} | {f('dcp_load_s', '.2f')} | {ulp} | {frac} |"
        )
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "trainer_cores": trainer_cores,
        "cluster_cores": cluster_cores,
        "workers": args.workers,
        "worker_threads": args.worker_threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "tiny": args.tiny,
        "results": results,
        "machine": machine_info(),
    }


def plot(results: dict, path) -> bool:
    """Step time of each mode against none, per accumulation (the goal line: 1.005x)."""
    rows = [r for r in results["results"] if "vs_none" in r]
    return bars(
        path,
        [f"{r['mode']}\naccum {r['accum']}" for r in rows],
        [r["vs_none"] for r in rows],
        f"{results['gpu']}: step time / no checkpoint",
        "step time / none",
        goal=1.005,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rank_mode:
        args.mode, args.accum = args.rank_mode, args.rank_accum
        rank_main(args)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
