"""The reduce-hook design FSDP2 support was mapped out with (docs/fsdp.md, "Why at the
step"): where each parameter's shard lies in an FSDP2 group's reduce output, computed from
public API (trainer_hooks.capture.fsdp.fsdp_spans), equals what FSDP hands the all-reduce hook and
then puts in ``p.grad`` (FSDP on 2 ranks and HSDP on 4 (2x2), uneven shards: 13 rows on 2
ranks are 7 + 6 and a row of padding); and the replay of those buffers in FSDP's order and
dtypes equals FSDP's AdamW. The shipped path, gradients taken at the step, is
tests/slow/test_fsdp.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shadow.testing.ports import free_port
from tests.helpers.end import end_rank

pytestmark = pytest.mark.slow


def _run(rank: int, world: int, port: int, hsdp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_hooks.capture.fsdp import fsdp_groups, fsdp_spans

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2) if hsdp else (world,), mesh_dim_names=("r", "s") if hsdp else ("s",))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)
        )
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root manages the last layer's parameters
        groups, spans = fsdp_groups(model), fsdp_spans(model)
        assert [name for name, _, _ in groups] == ["", "0", "2"], [name for name, _, _ in groups]
        captured: dict[int, torch.Tensor] = {}
        for gi, (_, module, _) in enumerate(groups):
            module.set_all_reduce_hook(lambda buf, gi=gi: captured.__setitem__(gi, buf.detach().clone()))
        torch.manual_seed(100 + rank)
        model(torch.randn(4, 5)).square().sum().backward()
        named = dict(model.named_parameters())
        for gi, group in enumerate(spans):
            buf = captured[gi]
            assert buf.numel() == sum(s.padded for s in group), (gi, buf.numel(), group)
            for s in group:
                p = named[s.fqn]
                local = p.grad.to_local().reshape(-1)
                assert s.numel == local.numel(), s
                assert torch.equal(buf[s.offset : s.offset + s.numel], local), s
                full = p.full_tensor().reshape(-1)  # a collective: every rank calls it in the same order
                assert torch.equal(full[s.global_offset : s.global_offset + s.numel], p.to_local().reshape(-1)), s
        uneven = next(s for s in spans[1] if s.fqn == "0.weight")
        shards = 2
        mine = uneven.global_offset // 5 // 7
        assert (uneven.padded, uneven.numel) == (7 * 5, (7 if mine < shards - 1 else 6) * 5), uneven
        dist.barrier()  # every rank through its collectives before any tears the group down
    finally:
        dist.destroy_process_group()
    end_rank()  # torch's teardown at interpreter exit aborted a rank once in CI


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp-2", "hsdp-2x2"])
def test_the_shard_spans_are_where_fsdp_puts_each_gradient(hsdp):
    world = 4 if hsdp else 2
    mp.spawn(_run, args=(world, free_port(), hsdp), nprocs=world, join=True)


def _replay(rank: int, world: int, port: int, impl: str, mode: str = "") -> None:
    """Three AdamW steps of an FSDP model, and the shadow's replay of each on this rank's
    shard, fed the spans of the reduce outputs the hook saw, turned into the gradient in
    FSDP's order and dtypes (post-divide in the reduce dtype, cast, micro-batch sums in the
    parameter dtype): equal every step. ``mode``: ``sum`` (sum reduction, FSDP divides
    after the hook), ``bf16`` (bf16 compute and reduction), ``accum`` (two micro-batches)."""
    import numpy as np
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shadow.kernels import ReplayPlan, segments_for_range
    from trainer_hooks.capture.fsdp import fsdp_groups, fsdp_spans
    from trainer_hooks.optim.describe import calibrate, cpu_sqrt_table, replay_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
        kw = {}
        if mode == "bf16":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        if mode == "sum":
            for _, module, _ in fsdp_groups(model):
                module.set_force_sum_reduction_for_comms(True)
        flag = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, **flag)
        groups = fsdp_groups(model)
        where = {s.fqn: s for group in fsdp_spans(model) for s in group}
        captured: dict[int, list[torch.Tensor]] = {}
        for gi, (_, module, _) in enumerate(groups):
            module.set_all_reduce_hook(lambda buf, gi=gi: captured.setdefault(gi, []).append(buf.detach().clone()))
        named = list(model.named_parameters())
        post = float(world) if mode == "sum" else None  # what FSDP divides by after the hook

        def grad(span) -> torch.Tensor:
            acc = None
            for buf in captured[span.group]:  # one per micro-batch, in order
                g = buf[span.offset : span.offset + span.numel].clone()
                if post is not None:
                    g.div_(post)  # in the reduce dtype
                g = g.to(torch.float32)
                acc = g if acc is None else acc.add_(g)
            assert acc is not None
            return acc

        sizes = [where[n].numel for n, _ in named]
        offsets = np.cumsum([0] + sizes)[:-1]
        flat = np.concatenate([p.to_local().detach().reshape(-1).numpy() for _, p in named]).astype(np.float32)
        m, v, mx = np.zeros_like(flat), np.zeros_like(flat), np.zeros(0, np.float32)
        vec, tail, _ = calibrate()
        table = cpu_sqrt_table()[0] if impl != "fused" else None
        plan = ReplayPlan(
            segments_for_range(offsets, sizes, [0] * len(sizes), 0, len(flat), impl, vec, tail), impl, 4096, sqrt=table
        )
        for k in range(1, 4):
            opt.zero_grad()
            captured.clear()
            for mb in range(2 if mode == "accum" else 1):
                torch.manual_seed(1000 * k + 10 * mb + rank)
                model(torch.randn(4, 5)).square().sum().backward()
            opt.step()
            bufs = [b for group in captured.values() for b in group]
            assert len(bufs) == len(groups) * (2 if mode == "accum" else 1), len(bufs)  # the hook, per micro-batch
            assert {b.dtype for b in bufs} == {torch.bfloat16 if mode == "bf16" else torch.float32}
            gflat = np.concatenate([grad(where[n]).numpy() for n, _ in named])
            plan.prepare(replay_groups(opt), np.full(len(sizes), float(k)), set(), None)
            plan.apply(flat, m, v, mx, gflat)
            for (n, p), o, size in zip(named, offsets, sizes, strict=True):
                ours = {"param": flat, "exp_avg": m, "exp_avg_sq": v}
                theirs = {"param": p, "exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
                for key, arr in ours.items():
                    want = theirs[key].to_local().detach().reshape(-1)
                    got = torch.from_numpy(arr[o : o + size].copy())
                    assert torch.equal(want, got), (impl, k, n, key, rank)
        dist.barrier()  # every rank through its collectives before any tears the group down
    finally:
        dist.destroy_process_group()
    end_rank()  # torch's teardown at interpreter exit aborted a rank once in CI


@pytest.mark.parametrize(
    "impl,mode",
    # foreach and fused under plain averaging are what tests/slow/test_fsdp.py runs end to end
    [("single", ""), ("foreach", "sum"), ("fused", "accum"), ("fused", "bf16")],
)
def test_the_shadows_replay_of_each_shard_equals_fsdp_adamw(impl, mode):
    mp.spawn(_replay, args=(2, free_port(), impl, mode), nprocs=2, join=True)
