"""Adam / AdamW replay kernels, bit-identical to torch's implementations: one kernel per
rounding rule (:data:`KERNELS`).

The shadow applies each iteration over a worker's contiguous range of the flat fp32
space. The range is cut into *segments* (one per parameter slice) that carry their
own scalars (hyperparameters and per-parameter step count: the columns of
:mod:`shadow.kernels.adam_columns`), and into *work items* (bounded slices of one
segment) that numba runs in parallel.

Each rule has a kernel of its own (the plan picks it from the implementation; ``I_RULE``
names it per segment), so that the rule is a constant in its loops:

* ``RULE_CPU``: torch's CPU kernels (:func:`_adam_apply`);
* ``RULE_CUDA_FUSED``: CUDA's fused kernel (:func:`_adam_apply_cuda_fused`);
* ``RULE_CUDA_FOREACH``: CUDA's foreach and single-tensor kernels
  (:func:`_adam_apply_cuda_foreach`);
* ``RULE_CPU_TABLE``: torch's CPU single-tensor and foreach paths, with the trainer's
  square root (:func:`_adam_apply_cpu_table`).

Their element arithmetic is :mod:`shadow.kernels.adam_rules` (the first three) and
:mod:`shadow.kernels.adam_cpu_table`; the loops they share, :mod:`shadow.kernels.adam_loops`.
"""

from __future__ import annotations

from numba import prange

from shadow.kernels import _cache  # first: it chooses the kernel cache directory before any @njit
from shadow.kernels.adam_columns import RULE_CPU, RULE_CPU_TABLE, RULE_CUDA_FOREACH, RULE_CUDA_FUSED
from shadow.kernels.adam_loops import _item


def _adam_apply(
    param,
    exp_avg,
    exp_avg_sq,
    max_sq,
    grad_addr,
    grad_len,
    work,
    seg_f,
    seg_i,
    snap_p,
    snap_m,
    snap_v,
    snap_x,
    sq_tab,
    sq_map,
):
    """Apply one Adam/AdamW step in place over the work items, with torch's CPU rounding.

    ``work`` is int64 ``[n, 5]`` of ``(lo, hi, segment, part, goff)``: local elements
    ``[lo, hi)`` of one segment whose gradient is elements ``goff .. goff + hi - lo`` of
    gradient part ``part``, a C-contiguous float32 array of ``grad_len[part]`` elements
    at address ``grad_addr[part]`` (the received payload frames, or one contiguous
    gradient; the caller keeps them alive); ``seg_f`` / ``seg_i`` are the per-segment scalar tables
    (columns ``F_*``/``I_*``). ``max_sq`` may be a length-0 array when no segment uses
    amsgrad; the ``snap_*`` arrays are length 0 unless this pass also fills a snapshot.
    ``sq_tab``/``sq_map`` are the square root table of :data:`RULE_CPU_TABLE` (its kernel
    only; the others are given placeholders).
    """
    for w in prange(work.shape[0]):
        _item(
            RULE_CPU,
            w,
            param,
            exp_avg,
            exp_avg_sq,
            max_sq,
            grad_addr,
            grad_len,
            work,
            seg_f,
            seg_i,
            snap_p,
            snap_m,
            snap_v,
            snap_x,
            sq_tab,
            sq_map,
        )


def _adam_apply_cuda_fused(
    param,
    exp_avg,
    exp_avg_sq,
    max_sq,
    grad_addr,
    grad_len,
    work,
    seg_f,
    seg_i,
    snap_p,
    snap_m,
    snap_v,
    snap_x,
    sq_tab,
    sq_map,
):
    """:func:`_adam_apply` with the rounding of CUDA's fused Adam/AdamW."""
    for w in prange(work.shape[0]):
        _item(
            RULE_CUDA_FUSED,
            w,
            param,
            exp_avg,
            exp_avg_sq,
            max_sq,
            grad_addr,
            grad_len,
            work,
            seg_f,
            seg_i,
            snap_p,
            snap_m,
            snap_v,
            snap_x,
            sq_tab,
            sq_map,
        )


def _adam_apply_cpu_table(
    param,
    exp_avg,
    exp_avg_sq,
    max_sq,
    grad_addr,
    grad_len,
    work,
    seg_f,
    seg_i,
    snap_p,
    snap_m,
    snap_v,
    snap_x,
    sq_tab,
    sq_map,
):
    """:func:`_adam_apply` for torch's single-tensor and foreach CPU paths, whose square root
    is the trainer's library's (``sq_tab``, ``sq_map``)."""
    for w in prange(work.shape[0]):
        _item(
            RULE_CPU_TABLE,
            w,
            param,
            exp_avg,
            exp_avg_sq,
            max_sq,
            grad_addr,
            grad_len,
            work,
            seg_f,
            seg_i,
            snap_p,
            snap_m,
            snap_v,
            snap_x,
            sq_tab,
            sq_map,
        )


def _adam_apply_cuda_foreach(
    param,
    exp_avg,
    exp_avg_sq,
    max_sq,
    grad_addr,
    grad_len,
    work,
    seg_f,
    seg_i,
    snap_p,
    snap_m,
    snap_v,
    snap_x,
    sq_tab,
    sq_map,
):
    """:func:`_adam_apply` with the rounding of CUDA's foreach and single-tensor Adam/AdamW."""
    for w in prange(work.shape[0]):
        _item(
            RULE_CUDA_FOREACH,
            w,
            param,
            exp_avg,
            exp_avg_sq,
            max_sq,
            grad_addr,
            grad_len,
            work,
            seg_f,
            seg_i,
            snap_p,
            snap_m,
            snap_v,
            snap_x,
            sq_tab,
            sq_map,
        )


#: per rounding rule (``I_RULE``), the kernel pair ``(multi-threaded, single-threaded)``:
#: the first for workers (numba prange over the work items), the second for trainer
#: processes (calibration), which must not start a thread pool that competes with
#: torch's own threads. One kernel per rule keeps the rule a constant in its loops, and
#: each compiles on first use.
KERNELS = {
    rule: (_cache.kernel(fn, True), _cache.kernel(fn, False))
    for rule, fn in (
        (RULE_CPU, _adam_apply),
        (RULE_CUDA_FUSED, _adam_apply_cuda_fused),
        (RULE_CUDA_FOREACH, _adam_apply_cuda_foreach),
        (RULE_CPU_TABLE, _adam_apply_cpu_table),
    )
}
adam_apply, adam_apply_serial = KERNELS[RULE_CPU]
