"""A small CUDA training run for the GPU tests (world size 1, NCCL): attached to a shadow
cluster, bf16 autocast, GradScaler with fused AdamW (the step is skipped on the device on
overflow), the session's clip, gradient accumulation with ``no_sync``.

    python tests/helpers/gpu_trainer.py train ADDRESS OUT STEPS KILL_AT
    python tests/helpers/gpu_trainer.py resume ADDRESS OUT STEPS

``train`` saves the live state (on the CPU) to OUT/live.pt once iteration KILL_AT is
committed by the cluster, then SIGKILLs itself. ``resume`` restores from the cluster,
re-attaches, trains to STEPS and saves OUT/final.pt with the restored iteration.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks


def build():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.05 * k))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=3)
    return model, opt, sched, scaler


def step(ddp, opt, sched, scaler, session, it: int, accum: int = 2) -> None:
    for m in range(accum):
        g = torch.Generator(device="cuda").manual_seed(it * 10 + m)
        x = torch.randn(32, 64, generator=g, device="cuda")
        y = torch.randint(0, 10, (32,), generator=g, device="cuda")
        ctx = ddp.no_sync() if m < accum - 1 else contextlib.nullcontext()
        with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y) / accum
            if it == 4:
                loss = loss * float("inf")  # an overflow: the fused step is skipped on the device
        with ctx:
            scaler.scale(loss).backward()
    scaler.unscale_(opt)
    session.clip_grad_norm_(1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad(set_to_none=True)


def state(model, opt, sched, scaler, iteration: int) -> dict:
    return {
        "iteration": iteration,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "opt": [{k: v.detach().cpu() for k, v in opt.state[p].items()} for p in model.parameters()],
        "sched": sched.state_dict(),
        "scaler": scaler.state_dict(),
    }


def main() -> None:
    mode, address, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    model, opt, sched, scaler = build()
    ddp = DDP(model, device_ids=[0])
    start = 0
    if mode == "resume":
        start = trainer_hooks.restore(ddp, opt, source=address, scheduler=sched, scaler=scaler, rank=0).iteration
    session = trainer_hooks.attach(ddp, opt, coordinator=address, scheduler=sched, scaler=scaler, job="gpu")
    kill_at = int(sys.argv[5]) if mode == "train" else None
    for it in range(start + 1, steps + 1):
        step(ddp, opt, sched, scaler, session, it)
        if it == kill_at:
            deadline = time.monotonic() + 60
            while session.committed < it and time.monotonic() < deadline:
                time.sleep(0.01)
            desc = session.attachment.target.optim_desc
            torch.save(dict(state(model, opt, sched, scaler, it), optim=desc), out / "live.pt")
            os.kill(os.getpid(), signal.SIGKILL)
    assert session.close() == steps
    torch.save(dict(state(model, opt, sched, scaler, steps), restored=start), out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
