"""How one DDP bucket maps to the flat space: this rank's stripe, its runs per worker,
and the positions probed at the step to check the gradients were not changed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BucketPlan:
    stripe: tuple[int, int]
    runs: list  # per worker: [(src relative to stripe, dst, n)]
    counts: list  # per worker: elements
    probes: list  # [(bucket position, param index, element of the param)] inside the stripe


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
