"""FSDP2, HSDP, tensor parallel and FSDP2 over tensor parallel against DDP, attached to the
shadow: bytes streamed per iteration per rank, and the step time with the shadow against
without it, in the same run.

    python benchmarks/bench_fsdp.py [--world 2] [--hsdp] [--tp] [--pp] [--width 512] [--layers 6]
                                   [--steps 12] [--warmup 4] [--json PATH]

Each mode trains the same MLP (``--layers`` square layers of ``--width`` plus a 13-row
head: uneven shards) with AdamW (foreach) on CPU with gloo, ``--world`` ranks, two
micro-batches and a clip per step, in fresh processes: ``ddp`` (DDP, ``no_sync`` on the
first micro-batch), ``fsdp`` (``fully_shard`` on each layer and the root), and with
``--hsdp`` also ``hsdp`` (a 2 x world/2 mesh); with ``--tp`` also ``tp`` (tensor parallel
over every rank: the layers column- then row-wise in pairs, the head column-wise) and,
on 4 ranks or more, ``fsdp_tp`` (FSDP2 over a 2-way data-parallel dimension of the
tensor-parallel model, torchtitan's 2D); with ``--pp`` also ``pp`` (two pipeline stages,
1F1B over four micro-batches, FSDP2 over the world/2 ranks of each). Each runs unattached (``none``) and attached
to a 2-worker cluster (``shadow``). Reported per mode: the median step time of rank 0 after
``--warmup`` steps, the bytes each rank sent per iteration once the bootstrap was through
(the mean over the ranks, and the largest), and their ratios to DDP's.

Goals: bytes per iteration per rank under FSDP2/HSDP <= DDP's (issue 40); under every
mode, the mean bytes per rank equal the rank's unique share of the model, 4 bytes per
parameter / ranks (issue 55).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import Goal, bars, destroy_process_group

from shadow.testing import LocalCluster, free_port

GOALS = [
    Goal("{key}: bytes per iteration per rank / DDP's", "modes.*.bytes_vs_ddp", 1.0, "<=", unit="x"),
    Goal("{key}: bytes per iteration per rank / its unique share", "modes.*.bytes_vs_share", 1.01, "<=", unit="x"),
    Goal("{key}: step time with the shadow / without (CPU, shared cores)", "modes.*.shadow_over_none", None, unit="x"),
]

# bench_all.py runs it with: ARGS_QUICK (its default set), ARGS_FULL (--full), ARGS_SMOKE
ARGS_QUICK = ["--steps", "8", "--tp", "--pp"]
ARGS_FULL = ["--world", "4", "--hsdp", "--tp", "--pp"]
ARGS_SMOKE = ["--steps", "2", "--warmup", "1", "--width", "32", "--layers", "2", "--tp", "--pp"]


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, 13))
    return torch.nn.Sequential(*mods)


def _tensor_parallel(m: torch.nn.Sequential, world: int, fsdp: bool) -> torch.nn.Module:
    """``m``'s linear layers column- then row-wise in pairs over a tensor-parallel mesh
    dimension (every rank, or world/2 under ``fsdp``, FSDP2 then sharding a 2-way data
    dimension), the head column-wise (row-wise after an odd count)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    shape = (2, world // 2) if fsdp else (1, world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    linears = [i for i, layer in enumerate(m) if isinstance(layer, torch.nn.Linear)]
    plan: dict = {}
    for k, i in enumerate(linears[:-1]):
        plan[str(i)] = ColwiseParallel() if k % 2 == 0 else RowwiseParallel()
    odd = (len(linears) - 1) % 2 == 1
    plan[str(linears[-1])] = RowwiseParallel() if odd else ColwiseParallel(output_layouts=Replicate())
    parallelize_module(m, mesh["tp"], plan)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for i in linears:
            fully_shard(m[i], mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    return m


def _pipeline(m: torch.nn.Sequential, world: int) -> tuple[torch.nn.Module, tuple]:
    """Two pipeline stages of ``m`` (its first half of layers and the rest: slices keep the
    whole model's names), FSDP2 over the ``world / 2`` ranks of each; a 1F1B schedule."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    cut = len(m) // 2
    part = m[:cut] if stage == 0 else m[cut:]
    if world // 2 > 1:
        for layer in part:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    pipe = PipelineStage(part, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=4, loss_fn=lambda out, _: out.square().mean())
    return part, (schedule, stage, mesh, mesh["dp"].get_local_rank())


def _pipeline_step(part: torch.nn.Module, pipe: tuple, it: int, rank: int, width: int) -> None:
    schedule, stage, mesh, dp = pipe
    g = torch.Generator().manual_seed(1000 * it + dp)
    x = torch.randn(32, width, generator=g)
    if stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=torch.zeros(32, 13), losses=[])
    norm = torch.nn.utils.get_total_norm([p.grad for p in part.parameters() if p.grad is not None])
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    dist.all_reduce(norm, group=mesh["pp"].get_group())
    torch.nn.utils.clip_grads_with_norm_(list(part.parameters()), 1.0, norm**0.5)


def _rank(rank: int, world: int, port: int, args: dict, address: str | None, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mode = args["mode"]
    m = _model(args["width"], args["layers"])
    pipe: tuple = ()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model: torch.nn.Module = DDP(m)
    elif mode in ("tp", "fsdp_tp"):
        model = _tensor_parallel(m, world, mode == "fsdp_tp")
    elif mode == "pp":
        model, pipe = _pipeline(m, world)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape, names = ((2, world // 2), ("replicate", "shard")) if mode == "hsdp" else ((world,), ("shard",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    session = None
    if address is not None:
        import trainer_hooks

        session = trainer_hooks.attach(model, opt, address, job=f"bench-{mode}")
    times, bytes0 = [], 0
    for it in range(args["warmup"] + args["steps"]):
        if it == args["warmup"] and session is not None:
            while session.committed < args["warmup"] and session.degraded is None:
                time.sleep(0.01)  # the bootstrap and the warm-up are through: count from here
            bytes0 = session.stats()["bytes_out"]
        dist.barrier()
        t0 = time.perf_counter()
        for j in range(2 if mode != "pp" else 0):
            g = torch.Generator().manual_seed(1000 * it + 10 * rank + j)
            x = torch.randn(32, args["width"], generator=g)
            if mode == "ddp" and j == 0:
                with model.no_sync():  # type: ignore[operator]
                    model(x).square().mean().backward()
            else:
                if mode not in ("ddp", "tp"):
                    model.set_requires_gradient_sync(j == 1)  # type: ignore[operator]
                model(x).square().mean().backward()
        if mode == "pp":  # four micro-batches through the two stages, the clip across them
            _pipeline_step(model, pipe, it, rank, args["width"])
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if it >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    sent = 0.0
    if session is not None:
        session.close()
        sent = (session.stats()["bytes_out"] - bytes0) / args["steps"]
    got: list = [None] * world
    dist.all_gather_object(got, {"sent": sent, "step_s": statistics.median(times)})
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    del model, session  # (DDP) before the group goes, or this rank may never exit: see destroy_process_group
    destroy_process_group()


def _measure(mode: str, shadow: bool, args: argparse.Namespace, tmp: Path, address: str) -> dict:
    out = tmp / f"{mode}-{shadow}.json"
    conf = {"mode": mode, "width": args.width, "layers": args.layers, "steps": args.steps, "warmup": args.warmup}
    mp.start_processes(
        _rank,
        args=(args.world, free_port(), conf, address if shadow else None, str(out)),
        nprocs=args.world,
        join=True,
        start_method="spawn",
    )
    ranks = json.loads(out.read_text())
    return {
        "step_s": ranks[0]["step_s"],
        "bytes_per_iter_mean": statistics.mean(r["sent"] for r in ranks),
        "bytes_per_iter_max": max(r["sent"] for r in ranks),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hsdp", action="store_true", help="also HSDP on a 2 x world/2 mesh (world >= 4, even)")
    ap.add_argument("--tp", action="store_true", help="also tensor parallel, and (world >= 4, even) FSDP2 over it")
    ap.add_argument("--pp", action="store_true", help="also 2 pipeline stages (1F1B), FSDP2 over world/2 ranks each")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", default="")
    return ap


def run(args) -> dict:
    """Every mode without and with the shadow, the table printed; the JSON document."""
    modes = ["ddp", "fsdp"] + (["hsdp"] if args.hsdp else [])
    modes += (["tp"] + (["fsdp_tp"] if args.world >= 4 and args.world % 2 == 0 else [])) if args.tp else []
    modes += ["pp"] if args.pp and args.world % 2 == 0 else []
    params = sum(p.numel() for p in _model(args.width, args.layers).parameters())
    results: dict = {"params": params, "world": args.world, "cpu": _cpu(), "modes": {}}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=2) as cl:
        for mode in modes:
            none = _measure(mode, False, args, Path(d), cl.address)
            shadow = _measure(mode, True, args, Path(d), cl.address)
            results["modes"][mode] = {
                "step_s_none": none["step_s"],
                "step_s_shadow": shadow["step_s"],
                "shadow_over_none": shadow["step_s"] / none["step_s"],
                "bytes_per_iter_per_rank": shadow["bytes_per_iter_mean"],
                "bytes_per_iter_max_rank": shadow["bytes_per_iter_max"],
            }
    ddp = results["modes"]["ddp"]["bytes_per_iter_per_rank"]
    print(f"{params} parameters ({4 * params / args.world:.0f} fp32 bytes per rank), {args.world} ranks, {_cpu()}")
    print(
        f"{'mode':7} {'none s':>9} {'shadow s':>9} {'ratio':>6} {'B/iter/rank':>12} {'max rank':>10} "
        f"{'vs DDP':>7} {'vs share':>8}"
    )
    for mode, r in results["modes"].items():
        r["bytes_vs_ddp"] = r["bytes_per_iter_per_rank"] / ddp if ddp else float("nan")
        r["bytes_vs_share"] = r["bytes_per_iter_per_rank"] / (4 * params / args.world)
        print(
            f"{mode:7} {r['step_s_none']:9.4f} {r['step_s_shadow']:9.4f} {r['shadow_over_none']:6.3f} "
            f"{r['bytes_per_iter_per_rank']:12.0f} {r['bytes_per_iter_max_rank']:10.0f} {r['bytes_vs_ddp']:7.3f} "
            f"{r['bytes_vs_share']:8.3f}"
        )
    return results


def plot(results: dict, path) -> bool:
    """Bytes per iteration per rank of each mode."""
    modes = results["modes"]
    return bars(
        path,
        list(modes),
        [r["bytes_per_iter_per_rank"] / 1e6 for r in modes.values()],
        f"Bytes streamed per iteration per rank, {results['params'] / 1e6:.2f}M params, {results['world']} ranks",
        "MB / iteration / rank",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
