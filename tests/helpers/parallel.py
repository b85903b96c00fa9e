"""A small Llama-style model (embedding, norm, MLP, output; uneven sizes) sharded the way
torchtitan shards it: tensor parallel with ``parallelize_module`` (row-wise embedding,
sequence-parallel norm, column- then row-wise MLP, column-wise output), FSDP2 over the
data-parallel mesh dimension on top; and the loop pieces the parallel tests share."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

VOCAB, DIM, HIDDEN = 33, 12, 70  # 33 rows on 2 ranks: 17 + 16; 70 on (dp 2, tp 2): 18 + 17 twice


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        h = h + self.w2(torch.relu(self.w1(h)))
        return self.out(h)


def plain() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def sharded(mesh, dp: bool) -> Tiny:
    """The model on ``mesh``: tensor parallel over ``mesh["tp"]``, then (``dp``) FSDP2 over
    ``mesh["dp"]``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    m = plain()
    parallelize_module(
        m,
        mesh["tp"],
        {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=True),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    if dp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(m, mesh=mesh["dp"])
    return m


def init(rank: int, world: int, port: int, shape: tuple[int, int]):
    """The process group and a ``(dp, tp)`` mesh of ``shape``."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def optimizer(m, impl: str):
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **kw)


def step(m, opt, it: int, dp_rank: int, micro: int = 2, clip: float = 0.5) -> float:
    """Iteration ``it``: ``micro`` micro-batches of this data-parallel rank's tokens (every
    tensor-parallel rank the same), a clip over the whole model, the step. The loss."""
    total = 0.0
    for j in range(micro):
        g = torch.Generator().manual_seed(1000 * it + 10 * dp_rank + j)
        x = torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = m(x).float().square().mean() / micro
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return total


def full(m, opt) -> dict:
    """The full parameters and optimizer state by name (collectives: every rank calls it)."""
    out = {}
    for n, p in m.named_parameters():
        out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).cpu().clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}/{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().clone()
    return out


# -- pipeline stages ---------------------------------------------------------------------------

LAYERS = 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(torch.relu(self.w1(self.norm(h))))


class Stack(torch.nn.Module):
    """A Llama-shaped stack whose stages are the whole model with the other stages'
    modules deleted (torchtitan's way: the FQNs stay the whole model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: torch.nn.Module | None = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: torch.nn.Module | None = torch.nn.LayerNorm(DIM)
        self.out: torch.nn.Module | None = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.out(h) if self.out is not None else h


def whole() -> Stack:
    torch.manual_seed(0)
    return Stack()


def stage_module(stage: int, stages: int) -> Stack:
    """Stage ``stage`` of ``stages``: its share of the layers, the embedding on the first,
    the norm and output on the last."""
    m = whole()
    per = LAYERS // stages
    for i in range(LAYERS):
        if not stage * per <= i < (stage + 1) * per:
            del m.layers[str(i)]
    if stage != 0:
        m.emb = None
    if stage != stages - 1:
        m.norm = m.out = None
    return m


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def clip_across_stages(params: list, max_norm: float, pp_group) -> None:
    """torchtitan's clip under pipeline parallelism: each stage's norm, reduced over the
    stages, then every stage's gradients scaled by the whole model's."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm**2
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm**0.5, True)


def batch(it: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + dp_rank)
    x = torch.randint(0, VOCAB, (4, 8), generator=g)
    return x, torch.randint(0, VOCAB, (4, 8), generator=g)
