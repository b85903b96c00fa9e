"""SGD (momentum, dampening, Nesterov, weight decay, maximize) replay kernel,
bit-identical to torch's CPU implementations (fused, foreach and single-tensor).

Per element, in torch's order: the gradient transforms of :mod:`shadow.kernels.adam`,
``g = -g`` (maximize), ``g = fma(p, wd, g)``, then with momentum
``buf = g`` on a parameter's first step, else ``buf = fma(g, 1 - dampening, buf * m)``
("body" rule) or, in the fused kernel's scalar tail, ``buf = fma(buf, m, g * (1 - dampening))``;
Nesterov ``g = fma(buf, m, g)`` else ``g = buf``; finally ``p = fma(g, -lr, p)``.
Measured against torch 2.13 (``tests/test_kernels.py``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from shadow.kernels._fma import fma32

# float32 scalar columns
S_NEG_LR, S_MOMENTUM, S_DAMP1, S_WD, S_CLIP, S_INV_SCALE, S_GRAD_SCALE = range(7)
N_FSCALARS = 7
# int64 flag columns
(J_ACTIVE, J_TAIL_START, J_FIRST, J_NESTEROV, J_MAXIMIZE, J_MOMENTUM, J_WD, J_CLIP, J_INV_SCALE,
 J_GRAD_SCALE) = range(10)
N_ISCALARS = 10


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sgd_range(param, buf, grad, lo, hi, f, fl, tail_rule):
    neg_lr = f[S_NEG_LR]
    m = f[S_MOMENTUM]
    d1 = f[S_DAMP1]
    wd = f[S_WD]
    first = fl[J_FIRST] != 0
    nesterov = fl[J_NESTEROV] != 0
    maximize = fl[J_MAXIMIZE] != 0
    has_m = fl[J_MOMENTUM] != 0
    has_wd = fl[J_WD] != 0
    has_clip = fl[J_CLIP] != 0
    has_inv = fl[J_INV_SCALE] != 0
    has_gs = fl[J_GRAD_SCALE] != 0
    for i in range(lo, hi):
        g = grad[i]
        if has_inv:
            g = g * f[S_INV_SCALE]
        if has_clip:
            g = g * f[S_CLIP]
        if has_gs:
            g = g / f[S_GRAD_SCALE]
        if maximize:
            g = -g
        p = param[i]
        if has_wd:
            g = fma32(p, wd, g)
        if has_m:
            if first:
                b = g
            elif tail_rule:
                b = fma32(buf[i], m, g * d1)
            else:
                b = fma32(g, d1, buf[i] * m)
            buf[i] = b
            if nesterov:
                g = fma32(b, m, g)
            else:
                g = b
        param[i] = fma32(g, neg_lr, p)


def _sgd_apply(param, buf, grad, work, seg_f, seg_i):
    for w in prange(work.shape[0]):
        lo = work[w, 0]
        hi = work[w, 1]
        s = work[w, 2]
        fl = seg_i[s]
        if fl[J_ACTIVE] == 0:
            continue
        f = seg_f[s]
        mid = min(max(fl[J_TAIL_START], lo), hi)
        if mid > lo:
            _sgd_range(param, buf, grad, lo, mid, f, fl, False)
        if hi > mid:
            _sgd_range(param, buf, grad, mid, hi, f, fl, True)


sgd_apply = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(_sgd_apply)
sgd_apply_serial = njit(cache=True, nogil=True, error_model="numpy")(_sgd_apply)


def sgd_scalars(group: dict) -> tuple:
    f32 = np.float32
    return (f32(-group["lr"]), f32(group["momentum"]), f32(1 - group["dampening"]), f32(group["weight_decay"]))
