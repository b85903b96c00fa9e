"""SGD (momentum, dampening, Nesterov, weight decay, maximize) replay kernel,
bit-identical to torch's CPU implementations (fused, foreach and single-tensor).

Per element, in torch's order: the gradient transforms of :mod:`shadow.kernels.adam_rules`,
``g = -g`` (maximize), ``g = fma(p, wd, g)``, then with momentum
``buf = g`` on a parameter's first step, else ``buf = fma(g, 1 - dampening, buf * m)``
("body" rule) or, in the fused kernel's scalar tail, ``buf = fma(buf, m, g * (1 - dampening))``;
Nesterov ``g = fma(buf, m, g)`` else ``g = buf``; finally ``p = fma(g, -lr, p)``.
Measured against torch 2.13 (``tests/kernels/test_kernels.py``).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from shadow.core.optimizers import SgdGroup
from shadow.kernels import _cache  # first: it chooses the kernel cache directory before any @njit
from shadow.kernels._fma import f32_at, fma32

# float32 scalar columns
S_NEG_LR, S_MOMENTUM, S_DAMP1, S_WD, S_CLIP, S_INV_SCALE, S_GRAD_SCALE = range(7)
N_FSCALARS = 7
# int64 flag columns
(J_ACTIVE, J_TAIL_START, J_FIRST, J_NESTEROV, J_MAXIMIZE, J_MOMENTUM, J_WD, J_CLIP, J_INV_SCALE, J_GRAD_SCALE) = range(
    10
)
N_ISCALARS = 10


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sgd_step(p, g, bo, inv, cl, gs, sign, wd, has_wd, m, d1, first, nesterov, neg_lr, tail_rule):
    """One element with momentum: ``(new param, new momentum buffer)``."""
    g = ((g * inv) * cl) / gs * sign
    gw = fma32(p, wd, g)
    g = gw if has_wd else g
    if tail_rule:
        b = fma32(bo, m, g * d1)
    else:
        b = fma32(g, d1, bo * m)
    b = g if first else b
    gn = fma32(b, m, g)
    g = gn if nesterov else b
    return fma32(g, neg_lr, p), b


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sgd_range(param, buf, grad, goff, lo, hi, f, fl, tail_rule, snap_p, snap_b):
    # straight-line loop bodies (see adam_loops.py): neutral factors and selects for the
    # loop-invariant flags, slices from 0, numpy's error model -- LLVM vectorises them
    one = np.float32(1.0)
    neg_lr, m, d1, wd = f[S_NEG_LR], f[S_MOMENTUM], f[S_DAMP1], f[S_WD]
    inv = f[S_INV_SCALE] if fl[J_INV_SCALE] != 0 else one
    cl = f[S_CLIP] if fl[J_CLIP] != 0 else one
    gs = f[S_GRAD_SCALE] if fl[J_GRAD_SCALE] != 0 else one
    sign = -one if fl[J_MAXIMIZE] != 0 else one
    has_wd = fl[J_WD] != 0
    first = fl[J_FIRST] != 0
    nesterov = fl[J_NESTEROV] != 0
    n = hi - lo
    p_, g_ = param[lo:hi], grad[goff : goff + n]
    snap = len(snap_p) > 0
    sp_ = snap_p[lo:hi]
    if fl[J_MOMENTUM] == 0:
        for i in range(n):
            p = p_[i]
            g = ((g_[i] * inv) * cl) / gs * sign
            gw = fma32(p, wd, g)
            g = gw if has_wd else g
            p_[i] = fma32(g, neg_lr, p)
        if snap:
            sp_[:] = p_
        return
    b_ = buf[lo:hi]
    if snap:  # a loop of its own: a branch in the body would stop vectorisation
        sb_ = snap_b[lo:hi]
        for i in range(n):
            p, b = _sgd_step(
                p_[i], g_[i], b_[i], inv, cl, gs, sign, wd, has_wd, m, d1, first, nesterov, neg_lr, tail_rule
            )
            b_[i] = b
            p_[i] = p
            sb_[i] = b
            sp_[i] = p
    else:
        for i in range(n):
            p, b = _sgd_step(
                p_[i], g_[i], b_[i], inv, cl, gs, sign, wd, has_wd, m, d1, first, nesterov, neg_lr, tail_rule
            )
            b_[i] = b
            p_[i] = p


def _sgd_apply(param, buf, grad_addr, grad_len, work, seg_f, seg_i, snap_p, snap_b):
    """One SGD step in place over ``work`` rows ``(lo, hi, segment, part, goff)`` (see
    :func:`shadow.kernels.adam._adam_apply`); ``snap_*`` are length 0 unless this pass
    also fills a snapshot."""
    for w in prange(work.shape[0]):
        lo = work[w, 0]
        hi = work[w, 1]
        s = work[w, 2]
        fl = seg_i[s]
        if fl[J_ACTIVE] == 0:
            continue
        f = seg_f[s]
        part = work[w, 3]
        grad = carray(f32_at(grad_addr[part]), grad_len[part])
        goff = work[w, 4]
        mid = min(max(fl[J_TAIL_START], lo), hi)
        if mid > lo:
            _sgd_range(param, buf, grad, goff, lo, mid, f, fl, False, snap_p, snap_b)
        if hi > mid:
            _sgd_range(param, buf, grad, goff + (mid - lo), mid, hi, f, fl, True, snap_p, snap_b)


#: multi-threaded (numba prange over work items): the worker's kernel; single-threaded:
#: for trainer processes (calibration), which must not start a thread pool that competes
#: with torch's own threads
sgd_apply, sgd_apply_serial = _cache.kernel(_sgd_apply, True), _cache.kernel(_sgd_apply, False)


def sgd_scalars(group: SgdGroup) -> tuple:
    f32 = np.float32
    return (f32(-group.lr), f32(group.momentum), f32(1 - group.dampening), f32(group.weight_decay))
