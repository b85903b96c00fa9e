"""The divergence audit's trainer side: which elements to sample after step k, and their
values (a local generator seeded by k; the training loop's RNGs are never touched).

The values are gathered on the device into one small tensor that the commit copies to
the host non-blocking; :func:`values` turns what landed into the per-worker records."""

from __future__ import annotations

import numpy as np
import torch

from shadow.core import optimizers
from trainer_hooks.session import transfer


def sample(layout, params: list, optimizer, optim_desc: dict, shards: list, k: int) -> tuple[list, object]:
    """``(plan, gathered values)`` after step k. ``plan`` per worker: None or
    ``(positions, {field: [index into the gathered values, or -1 for no state]})``."""
    rng = np.random.default_rng(k)
    offsets = np.asarray([p.offset for p in layout.params], dtype=np.int64)
    spec = optimizers.spec_of(optim_desc)
    keys = {f: spec.torch_key(f) for f in spec.fields(optim_desc)}
    views: list[torch.Tensor] = []
    plan: list[tuple[list[int], dict[int, list]] | None] = []
    for lo, hi in shards:
        if hi <= lo:
            plan.append(None)
            continue
        pos = np.unique(rng.integers(lo, hi, size=min(64, hi - lo)))
        idx = np.searchsorted(offsets, pos, side="right") - 1
        where: dict[int, list] = {int(f): [] for f in keys}
        for flat, i in zip(pos, idx, strict=True):
            p = params[i]
            elem = int(flat - offsets[i])
            for f, key in keys.items():
                t = p.detach() if key is None else optimizer.state.get(p, {}).get(key)
                if t is None:
                    where[int(f)].append(-1)
                else:
                    where[int(f)].append(len(views))
                    views.append(t.detach().reshape(-1)[elem])
        plan.append(([int(x) for x in pos], where))
    return plan, transfer.gather(views)


def values(plan: list, gathered) -> list:
    """Per worker: ``{"positions", "values": {field: [float]}}`` (or None) from the
    sampled values as they landed on the host."""
    got = [] if gathered is None else gathered.numpy().tolist()
    return [
        None
        if p is None
        else {"positions": p[0], "values": {f: [0.0 if j < 0 else got[j] for j in where] for f, where in p[1].items()}}
        for p in plan
    ]
