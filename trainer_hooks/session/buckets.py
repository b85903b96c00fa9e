"""How one DDP bucket maps to the flat space: this rank's stripe, its runs per worker,
and the positions probed at the step to check the gradients were not changed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shadow.core.layout import bucket_runs, stripe_bounds


@dataclass
class BucketPlan:
    stripe: tuple[int, int]
    runs: list  # per worker: [(src relative to stripe, dst, n)]
    counts: list  # per worker: elements
    probes: list  # [(bucket position, param index, element of the param)] inside the stripe

    def pick(self, k: int) -> list:
        """The probes of iteration ``k`` (a few, spread differently each iteration), as
        ``(position relative to the stripe, param index, element)``."""
        n = len(self.probes)
        lo = self.stripe[0]
        out = []
        for j in range(min(SAMPLES_PER_BUCKET, n)):
            pos, pidx, elem = self.probes[(k * 7 + j * 13) % n]
            out.append((pos - lo, pidx, elem))
        return out


SAMPLES_PER_BUCKET = 4  # gradient elements checked per bucket and step


def probes(slots: list, stripe: tuple[int, int], count: int = 64) -> list:
    """Up to ``count`` positions spread over the stripe that belong to parameters."""
    out = []
    for b_off, _flat, n, idx in slots:
        lo, hi = max(b_off, stripe[0]), min(b_off + n, stripe[1])
        for pos in range(lo, hi, max(1, (hi - lo) // 8)):
            out.append((pos, idx, pos - b_off))
    if len(out) > count:
        step = len(out) / count
        out = [out[int(i * step)] for i in range(count)]
    return out


class Planner:
    """The plans of one attachment's buckets, made on a bucket's first reduction and kept
    (DDP may rebuild its buckets after the first iteration: a new key, a new plan)."""

    def __init__(self, layout, index: dict[int, int], rank: int, world: int, shards: Sequence[tuple[int, int]]):
        self.layout, self.index, self.rank, self.world, self.shards = layout, index, rank, world, shards
        self.plans: dict[tuple, BucketPlan] = {}

    def plan(self, bucket: dist.GradBucket, reduced: torch.Tensor) -> BucketPlan:
        params = bucket.parameters()
        key = (bucket.index(), reduced.numel(), tuple(id(p) for p in params))
        plan = self.plans.get(key)
        if plan is None:
            base = reduced.data_ptr()
            slots = []
            for p, g in zip(params, bucket.gradients(), strict=True):
                i = self.index.get(id(p))
                if i is not None:
                    slots.append(((g.data_ptr() - base) // 4, self.layout.params[i].offset, p.numel(), i))
            stripe = stripe_bounds(reduced.numel(), self.world)[self.rank]
            per_worker = bucket_runs([s[:3] for s in slots], stripe, self.shards)
            runs = [[(r.src - stripe[0], r.dst, r.nelem) for r in rs] for rs in per_worker]
            plan = BucketPlan(stripe, runs, [sum(n for _, _, n in rs) for rs in runs], probes(slots, stripe))
            self.plans[key] = plan
        return plan
