"""The Adamax replay kernel against torch.optim.Adamax on this CPU, bit for bit: single-tensor
and foreach, weight decay, maximize, betas with a large 1 - beta1, eps 0, clipping and
GradScaler's unscale, a step count in the thousands, and the flat space cut into ranges
that split parameters (as workers hold it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shadow.core.optimizers.adamax import AdamaxGroup
from shadow.kernels import ReplayPlan, segments_for_range

SIZES = (4096, 4099, 1000, 5, 1, 17, 3001)
CONFIGS = {
    "default": {},
    "decay": {"lr": 0.1, "weight_decay": 0.5},
    "maximize-decay": {"maximize": True, "weight_decay": 0.01},
    "small-beta1": {"betas": (0.3, 0.99)},
    "eps0": {"betas": (0.6, 0.9), "eps": 0.0},
}


def _grads(gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for n in SIZES:
        g = torch.randn(n, generator=gen) * 1e-3
        band = min(n, 64)
        g[:band] *= torch.logspace(-12, 4, band)
        out.append(g)
    return out


def _run(impl: str, kw: dict, ranges: int, clip: float | None, inv: float | None, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.05) for n in SIZES]
    opt = torch.optim.Adamax(params, **{"lr": 2e-3, **kw}, foreach=impl == "foreach")
    group = AdamaxGroup.from_torch(opt.param_groups[0], {})
    total = sum(SIZES)
    offsets = list(np.cumsum((0,) + SIZES)[:-1])
    cuts = np.linspace(0, total, ranges + 1).astype(int)
    flat = np.concatenate([p.detach().numpy() for p in params])
    shards = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        segs = segments_for_range(offsets, SIZES, [0] * len(SIZES), lo, hi, impl, 16, 8)
        plan = ReplayPlan(segs, impl, 1024, "adamax")
        shards.append((lo, hi, plan, flat[lo:hi].copy(), np.zeros(hi - lo, np.float32), np.zeros(hi - lo, np.float32)))
    for k in range(1, steps + 1):
        gs = _grads(gen)
        flat_g = np.concatenate([g.numpy() for g in gs])
        for p, g in zip(params, gs, strict=True):  # what GradScaler.unscale_ and clipping leave in .grad
            t = g.clone()
            if inv is not None:
                t = t * torch.tensor(inv, dtype=torch.float32)
            if clip is not None:
                t = t * torch.tensor(clip, dtype=torch.float32)
            p.grad = t
        if k == steps:
            for p in params:
                opt.state[p]["step"].fill_(4999)
        opt.step()
        step = float(opt.state[params[0]]["step"])
        for lo, hi, plan, p_, m_, u_ in shards:
            plan.fill(
                [group],
                np.full(len(SIZES), step),
                np.ones(len(SIZES), dtype=bool),
                set(),
                clip=None if clip is None else np.float32(clip),
                inv_scale=None if inv is None else np.float32(inv),
            )
            plan.apply(p_, m_, u_, flat_g[lo:hi].copy(), threads=ranges > 1)
        for name, key in (("param", None), ("exp_avg", "exp_avg"), ("exp_inf", "exp_inf")):
            want = np.concatenate([(p.detach() if key is None else opt.state[p][key]).numpy() for p in params])
            idx = {"param": 3, "exp_avg": 4, "exp_inf": 5}[name]
            got = np.concatenate([s[idx] for s in shards])
            bad = np.flatnonzero(want.view(np.uint32) != got.view(np.uint32))
            assert not len(bad), f"step {k} {name}: {len(bad)} elements differ, first at {bad[0]}"


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_adamax_replays_torch_bit_for_bit(impl, config):
    _run(impl, CONFIGS[config], ranges=1, clip=None, inv=None)


@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_adamax_with_clip_unscale_and_sharded_ranges(impl):
    _run(impl, {"weight_decay": 0.05, "maximize": True}, ranges=3, clip=0.37, inv=1 / 1024)


def test_adamax_has_no_fused_rule():
    segs = segments_for_range([0], [8], [0], 0, 8, "fused", 16, 8)
    with pytest.raises(ValueError, match="no 'fused' implementation"):
        ReplayPlan(segs, "fused", 16, "adamax")
    with pytest.raises(ValueError, match="no 'cuda_fused' implementation"):
        ReplayPlan(segs, "cuda_fused", 16, "adamax")
