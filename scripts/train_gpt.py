"""Train the example GPT with DDP (gloo) under torchrun, attached to a shadow cluster.

    torchrun --nproc_per_node=2 scripts/train_gpt.py --coordinator tcp://127.0.0.1:5555 --steps 200
    # after a crash:
    torchrun --nproc_per_node=2 scripts/train_gpt.py --coordinator tcp://127.0.0.1:5555 --steps 200 --resume
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, CharData, GPTConfig, corpus  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", default="", help="shadow coordinator address; empty = no shadow")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--resume", action="store_true", help="restore from the shadow first")
    ap.add_argument("--out", default="", help="directory for losses.jsonl and final.pt (rank 0)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.out:
        os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
        with open(os.path.join(args.out, "pids", f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    data = CharData(corpus())
    cfg = GPTConfig(vocab_size=len(data.chars), block_size=args.block, n_layer=args.n_layer, n_embd=args.n_embd)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    ddp = DDP(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)

    import trainer_hooks

    start = 0
    if args.resume:
        info = trainer_hooks.restore(ddp, opt, source=args.coordinator, scheduler=sched)
        start = info.iteration
        if rank == 0:
            print(f"[rank 0] restored iteration {start} from {info.source} ({info.tier})", flush=True)
    state = {"iteration": start}
    session = None
    if args.coordinator:
        session = trainer_hooks.attach(ddp, opt, coordinator=args.coordinator, scheduler=sched,
                                       extra_state=lambda: dict(state))
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"[rank 0] GPT with {n / 1e6:.2f}M parameters, steps {start + 1}..{args.steps}", flush=True)
    log = open(os.path.join(args.out, "losses.jsonl"), "a") if args.out and rank == 0 else None
    t0 = time.perf_counter()
    for it in range(start + 1, args.steps + 1):
        state["iteration"] = it
        x, y = data.batch(it, rank, args.batch, args.block, args.seed)
        loss = ddp(x, y)
        loss.backward()
        if session is not None:
            session.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log is not None:
            log.write(json.dumps({"iteration": it, "loss": loss.item(), "loss_hex": loss.item().hex()}) + "\n")
            log.flush()
            if it % 10 == 0:
                print(f"[rank 0] iteration {it} loss {loss.item():.4f} "
                      f"({(time.perf_counter() - t0) / (it - start):.3f} s/it)", flush=True)
    if session is not None:
        session.close()
        if rank == 0:
            print(f"[rank 0] shadow: {session.stats()}", flush=True)
    if args.out and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
