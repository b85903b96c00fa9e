"""A Llama-style model trained the way torchtitan trains one, attached to the shadow: FSDP2
over tensor parallel (2D), or pipeline stages over FSDP2, built from torch's own parallel
APIs (``parallelize_module``, ``fully_shard``, ``torch.distributed.pipelining``).

    torchrun --standalone --nproc_per_node=4 examples/llama_parallel.py --parallel=2d --coordinator=tcp://127.0.0.1:5555
    torchrun --standalone --nproc_per_node=4 examples/llama_parallel.py --parallel=pp --coordinator=tcp://127.0.0.1:5555
    # after a crash, the same command with --resume: it goes on from the shadow's last iteration

``--parallel=2d``: a (dp, tp) mesh of (world / 2, 2); the tensor-parallel plan is
torchtitan's for Llama (a row-wise embedding, sequence-parallel norms, column-wise
``wq``/``wk``/``wv``/``w1``/``w3``, row-wise ``wo``/``w2``, a column-wise output), then
``fully_shard`` of every block and the root over ``dp``. ``--parallel=pp``: a (pp, dp) mesh
of (2, world / 2); each stage is the whole model with the other stage's modules deleted
(its FQNs stay the whole model's), ``fully_shard`` over ``dp`` (on more than one rank),
a 1F1B (or GPipe: ``--schedule=gpipe``) schedule over 4 micro-batches, and the clip over
the whole model (each stage's norm reduced over the stages, as torchtitan clips).

Runs on CPU with gloo (on GPUs with NCCL under ``--device=cuda``). Only the lines marked
``# shadow`` are the shadow's: four of them.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainer_hooks  # shadow


@dataclass
class Config:
    vocab: int = 97
    dim: int = 32
    heads: int = 4
    layers: int = 4
    hidden: int = 86
    seq: int = 16
    batch: int = 4


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: this rank's share of them under tensor parallelism (torchtitan's habit)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm: nn.Module | None = nn.RMSNorm(c.dim)
        self.output: nn.Module | None = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def tensor_parallel(model: Llama, tp_mesh) -> None:
    """torchtitan's tensor-parallel plan for Llama (sequence parallel between blocks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def data_parallel(model: Llama, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def stage_of(c: Config, stage: int, stages: int) -> Llama:
    """Stage ``stage`` of ``stages``: the whole model with the other stages' layers deleted,
    the embedding on the first stage, the norm and output on the last (torchtitan's split)."""
    model = Llama(c)
    per = c.layers // stages
    for i in range(c.layers):
        if not stage * per <= i < (stage + 1) * per:
            del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = model.output = None
    return model


def clip_across_stages(params: list, max_norm: float, pp_group) -> None:
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0, False, True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm**2
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm**0.5, True)


def batch(c: Config, it: int, dp_rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + dp_rank)
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", choices=("2d", "pp"), default="2d")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    ap.add_argument("--coordinator", default="", help="tcp://host:port of the shadow cluster ('': no shadow)")
    ap.add_argument("--job", default="llama")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill_at", type=int, default=0, help="SIGKILL every rank after this step (a crash)")
    ap.add_argument("--out_dir", default="", help="each rank's end state and losses, for comparisons")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    c = Config()
    torch.manual_seed(0)
    if args.parallel == "2d":
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank, stage, schedule = mesh["dp"].get_local_rank(), 0, None
        model = Llama(c).to(device)
        tensor_parallel(model, mesh["tp"])
        data_parallel(model, mesh["dp"])
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
        dp_rank, stage = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        model = stage_of(c, stage, 2).to(device)
        if world // 2 > 1:
            data_parallel(model, mesh["dp"])
        pipe = PipelineStage(model, stage, 2, device, group=mesh["pp"].get_group())
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = kind(pipe, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))

    start = 0
    if args.resume:
        start = trainer_hooks.restore(model, opt, args.coordinator, scheduler=sched, job=args.job).iteration  # shadow
    session = None
    if args.coordinator:
        session = trainer_hooks.attach(model, opt, args.coordinator, scheduler=sched, job=args.job)  # shadow

    losses = []
    for it in range(start + 1, args.steps + 1):
        x, y = batch(c, it, dp_rank, device)
        if schedule is None:
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            losses.append(loss.item())
        else:
            out: list = []
            if stage == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=out)
                losses.append(sum(v.item() for v in out) / len(out))
            clip_across_stages(list(model.parameters()), 1.0, mesh["pp"].get_group())
        opt.step()
        sched.step()
        opt.zero_grad()
        if args.kill_at and it == args.kill_at:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    if session is not None:
        session.close()  # shadow
    if args.out_dir:
        from torch.distributed.tensor import DTensor

        def local(t):
            return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()

        state = {n: local(p) for n, p in model.named_parameters()}
        moments = {f"{n}/{k}": local(v) for n, p in model.named_parameters() for k, v in opt.state[p].items()}
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"state": {**state, **moments}, "losses": losses}, os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
