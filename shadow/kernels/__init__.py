"""Optimizer replay kernels (numba) and the per-range plans that drive them."""

from shadow.kernels.replay import (
    IMPLS,
    ReplayPlan,
    Segment,
    adam_scalars,
    segments_for_range,
    segments_for_runs,
    tail_start,
    work_items,
)

__all__ = [
    "IMPLS",
    "ReplayPlan",
    "Segment",
    "adam_scalars",
    "segments_for_range",
    "segments_for_runs",
    "tail_start",
    "work_items",
]
