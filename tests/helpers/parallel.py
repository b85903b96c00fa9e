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
