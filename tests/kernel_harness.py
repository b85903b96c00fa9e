"""One bit-exactness harness for every optimizer kernel: run torch's optimizer and the
shadow's replay plan side by side on the same gradients, compare every tensor."""

from __future__ import annotations

import numpy as np
import torch

from shadow.kernels import ReplayPlan, segments_for_range
from trainer_hooks.optim.describe import calibrate, cpu_sqrt_table, replay_groups


def make_optimizer(cls, params, impl: str, **kw):
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    return cls(params, **kw, **flag)


def run_pair(
    cls,
    impl: str,
    sizes,
    steps: int = 3,
    clip: float | None = None,
    shards: int = 1,
    seed: int = 0,
    grad_scale: float | None = None,
    sqrt_table: bool = True,
    **kw,
):
    """Returns ``(torch_tensors, shadow_tensors)`` dicts of name -> list per param.
    ``grad_scale``: the gradients are that many times larger and the fused step divides
    them (as ``GradScaler.step`` runs a fused optimizer). ``sqrt_table``: the single-tensor
    and foreach replays take this CPU's square roots (False: IEEE's)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = make_optimizer(cls, params, impl, **kw)
    vec, tail, _ = calibrate()
    offsets = np.cumsum([0] + list(sizes))[:-1]
    total = int(sum(sizes))
    flat = np.concatenate([p.detach().numpy() for p in params]).astype(np.float32)
    m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
    amsgrad = kw.get("amsgrad", False)
    mx = np.zeros(total if amsgrad else 0, np.float32)
    bounds = np.linspace(0, total, shards + 1).astype(int)
    table = cpu_sqrt_table()[0] if sqrt_table and impl != "fused" else None
    plans = [
        ReplayPlan(
            segments_for_range(offsets, sizes, [0] * len(sizes), lo, hi, impl, vec, tail), impl, 4096, sqrt=table
        )
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    for k in range(1, steps + 1):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        if grad_scale is not None:
            grads = [g * grad_scale for g in grads]
            opt.grad_scale = torch.tensor(grad_scale, dtype=torch.float32)  # what GradScaler.step sets
            opt.found_inf = torch.tensor(0.0)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        coef = None
        if clip is not None:
            total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params, clip, total_norm)
            coef = np.float32(torch.clamp(clip / (total_norm + 1e-6), max=1.0).item())
        opt.step()
        gflat = np.concatenate([g.numpy() for g in grads]).astype(np.float32)
        groups = replay_groups(opt)
        for plan, lo, hi in zip(plans, bounds[:-1], bounds[1:], strict=True):
            gs = np.float32(grad_scale) if grad_scale is not None else None
            plan.prepare(groups, np.full(len(sizes), float(k)), set(), coef, grad_scale=gs)
            plan.apply(flat[lo:hi], m[lo:hi], v[lo:hi], mx[lo:hi] if amsgrad else mx, gflat[lo:hi])
    ours = {"param": flat, "exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        ours["max_exp_avg_sq"] = mx
    theirs = {"param": [p.detach() for p in params]}
    for key in ours:
        if key != "param":
            theirs[key] = [opt.state[p][key] for p in params]
    split = {
        key: [torch.from_numpy(arr[o : o + n].copy()) for o, n in zip(offsets, sizes, strict=True)]
        for key, arr in ours.items()
    }
    return theirs, split


def update_ulps(a: torch.Tensor, b: torch.Tensor, lr: float) -> float:
    """Largest ``|a - b|`` in units of the float32 spacing at ``max(|a|, lr)``: a
    deviation in the update (of size ~lr) is measured in the update's own ulp."""
    mag = torch.maximum(a.abs(), torch.full_like(a, lr))
    spacing = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return float(((a - b).abs() / spacing).max()) if a.numel() else 0.0


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def run_pair_sgd(impl: str, sizes, steps: int = 4, seed: int = 0, **kw):
    """SGD through torch and through the shadow's plan; returns ``(theirs, ours)``."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = make_optimizer(torch.optim.SGD, params, impl, **kw)
    vec, tail, _ = calibrate()
    offsets = np.cumsum([0] + list(sizes))[:-1]
    total = int(sum(sizes))
    flat = np.concatenate([p.detach().numpy() for p in params]).astype(np.float32)
    buf = np.zeros(total, np.float32)
    plan = ReplayPlan(
        segments_for_range(offsets, sizes, [0] * len(sizes), 0, total, impl, vec, tail), impl, 4096, "sgd"
    )
    has_state = np.zeros(len(sizes), dtype=bool)
    for _ in range(steps):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        plan.fill(replay_groups(opt), np.zeros(len(has_state)), has_state, set())
        plan.apply(flat, buf, np.concatenate([g.numpy() for g in grads]).astype(np.float32))
        has_state[:] = kw.get("momentum", 0) != 0
    theirs = {"param": [p.detach() for p in params]}
    ours = {"param": [torch.from_numpy(flat[o : o + n].copy()) for o, n in zip(offsets, sizes, strict=True)]}
    if kw.get("momentum", 0):
        theirs["momentum_buffer"] = [opt.state[p]["momentum_buffer"] for p in params]
        ours["momentum_buffer"] = [torch.from_numpy(buf[o : o + n].copy()) for o, n in zip(offsets, sizes, strict=True)]
    return theirs, ours
