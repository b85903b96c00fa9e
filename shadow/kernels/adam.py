"""Adam / AdamW replay kernels, bit-identical to torch's CPU implementations.

The shadow applies each iteration over a worker's contiguous range of the flat fp32
space. The range is cut into *segments* (one per parameter slice) that carry their
own scalars (hyperparameters and per-parameter step count), and into *work items*
(bounded slices of one segment) that numba runs in parallel.

Floating-point model (measured against torch 2.13 on an AVX512 build; see
``docs/kernels.md``):

* gradient transforms, in torch's order: ``g * inv_scale`` (``GradScaler.unscale_``),
  ``g * clip`` (clipping), ``g / grad_scale`` (``GradScaler.step`` into a fused kernel);
* every element: ``exp_avg = fma(w, g - exp_avg, exp_avg)`` (lerp with small weight,
  ``fma(w - 1, g - exp_avg, g)`` otherwise), weight decay L2 ``g = fma(p, wd, g)``,
  AdamW decay ``p = p * (1 - lr * wd)``, ``denom = sqrt(v) / bc2_sqrt + eps``,
  ``p = p + (-step_size * m) / denom``;
* ``exp_avg_sq`` is ``fma(c2 * g, g, v * beta2)`` ("body" rule) except, in the fused
  kernel, for the last ``(numel % V) % T`` elements of each tensor, which the
  compiler's scalar remainder loop contracts as ``fma(v, beta2, (c2 * g) * g)``
  ("tail" rule). ``V`` is ATen's vector width, ``T`` the compiler's epilogue width.

Which elements take the tail rule is precomputed per segment (``tail_start``), so
the kernel itself is branch-light and shared by every variant.

CUDA's kernels round differently (measured on an H200 with torch 2.11,
``tests/data/cuda_optim.npz``); a segment's ``I_RULE`` selects their formulas:

* ``RULE_CUDA_FUSED`` (``fused=True``): scalars in float32 (``step_size = lr / (1 -
  b1^k)``, ``bc2s = sqrtf(1 - b2^k)``); AdamW decay ``p = fma(-(lr*wd), p, p)``; L2
  ``g = fma(p, wd, g)``, except ``g + p*wd`` at element indices ``% 4 == 0``;
  ``m = fma(b1, m, fma(-b1, g, g))``; ``v = fma(b2, v, fma(-b2, g*g, g*g))``; the update
  as on CPU (``p - (step_size*m) / (sqrt(v)/bc2s + eps)``, no FMA).
* ``RULE_CUDA_FOREACH`` (foreach and single-tensor): scalars from doubles as on CPU;
  ``v = fma(1-b2, g*g, v*b2)``; ``p = fma(-(lr/bc1), m / s, p)`` with ``s = sqrt(v)/bc2s
  + eps`` (single-tensor: ``sqrt(v) * (1/bc2s) + eps``, ``F_BC2S`` then holds ``1/bc2s``
  and ``I_RECIP`` is set); decay, L2 and the first moment as on CPU.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from shadow.kernels import _cache  # noqa: F401  (chooses the kernel cache directory before any @njit)
from shadow.kernels._fma import f32_at, fma32

# Columns of the per-segment float32 scalar table.
F_W1, F_B2, F_C2, F_BC2S, F_EPS, F_NSTEP, F_DECAY, F_WD, F_CLIP, F_INV_SCALE, F_GRAD_SCALE = range(11)
N_FSCALARS = 11
# Columns of the per-segment int64 table.
(I_ACTIVE, I_AMSGRAD, I_MAXIMIZE, I_TAIL_START, I_LERP_SMALL, I_L2, I_DECOUPLED, I_CLIP, I_INV_SCALE,
 I_GRAD_SCALE, I_RULE, I_PARAM_START, I_RECIP) = range(13)
N_ISCALARS = 13
# I_RULE values: whose rounding the segment reproduces
RULE_CPU, RULE_CUDA_FUSED, RULE_CUDA_FOREACH = 0, 1, 2


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _moments(g, p, m, v, inv, cl, gs, sign, wd, l2, dec, a, small, b2, c2, tail_rule):
    """One element up to the new moments: ``(p after decoupled decay, exp_avg, exp_avg_sq)``."""
    g = g * inv  # GradScaler.unscale_
    g = g * cl  # clipping
    g = g / gs  # GradScaler.step with a fused optimizer: the kernel divides
    g = g * sign  # maximize
    gl = fma32(p, wd, g)
    g = gl if l2 else g
    p = p * dec
    d = g - m
    m = fma32(a, d, m if small else g)
    if tail_rule:
        v = fma32(v, b2, (c2 * g) * g)
    else:
        v = fma32(c2 * g, g, v * b2)
    return p, m, v


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _update_range(param, exp_avg, exp_avg_sq, max_sq, grad, goff, lo, hi, f, fl, tail_rule, snap_p, snap_m, snap_v,
                  snap_x):
    """Local elements ``[lo, hi)``; their gradient is ``grad[goff:goff + hi - lo]``. With
    ``snap_p`` non-empty, the new values are also written to the ``snap_*`` arrays (the
    persistence image of this iteration: one pass instead of an apply and a copy)."""
    one = np.float32(1.0)
    # loop-invariant choices become neutral factors and selects (x * 1 and x / 1 are
    # exact), the loops run over slices from 0 and numpy's error model is used: the body
    # is then straight-line code LLVM vectorizes (4-6x faster than the branchy version)
    inv = f[F_INV_SCALE] if fl[I_INV_SCALE] != 0 else one
    cl = f[F_CLIP] if fl[I_CLIP] != 0 else one
    gs = f[F_GRAD_SCALE] if fl[I_GRAD_SCALE] != 0 else one
    sign = -one if fl[I_MAXIMIZE] != 0 else one
    wd = f[F_WD]
    l2 = fl[I_L2] != 0
    dec = f[F_DECAY] if fl[I_DECOUPLED] != 0 else one
    small = fl[I_LERP_SMALL] != 0
    a = f[F_W1] if small else f[F_W1] - one
    b2, c2, bc2s, eps, nstep = f[F_B2], f[F_C2], f[F_BC2S], f[F_EPS], f[F_NSTEP]
    n = hi - lo
    p_, m_, v_, g_ = param[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[goff:goff + n]
    snap = len(snap_p) > 0
    if fl[I_AMSGRAD] != 0:
        x_ = max_sq[lo:hi]
        sp_, sm_, sv_, sx_ = snap_p[lo:hi], snap_m[lo:hi], snap_v[lo:hi], snap_x[lo:hi]
        for i in range(n):
            p, m, v = _moments(g_[i], p_[i], m_[i], v_[i], inv, cl, gs, sign, wd, l2, dec, a, small, b2, c2,
                               tail_rule)
            m_[i] = m
            v_[i] = v
            mx = x_[i]
            if v > mx or np.isnan(v):
                mx = v
            x_[i] = mx
            p = p + (nstep * m) / (np.sqrt(mx) / bc2s + eps)
            p_[i] = p
            if snap:
                sp_[i] = p
                sm_[i] = m
                sv_[i] = v
                sx_[i] = mx
    elif snap:  # a loop of its own: a branch in the body would stop vectorisation
        sp_, sm_, sv_ = snap_p[lo:hi], snap_m[lo:hi], snap_v[lo:hi]
        for i in range(n):
            p, m, v = _moments(g_[i], p_[i], m_[i], v_[i], inv, cl, gs, sign, wd, l2, dec, a, small, b2, c2,
                               tail_rule)
            p = p + (nstep * m) / (np.sqrt(v) / bc2s + eps)
            m_[i] = m
            v_[i] = v
            p_[i] = p
            sm_[i] = m
            sv_[i] = v
            sp_[i] = p
    else:
        for i in range(n):
            p, m, v = _moments(g_[i], p_[i], m_[i], v_[i], inv, cl, gs, sign, wd, l2, dec, a, small, b2, c2,
                               tail_rule)
            m_[i] = m
            v_[i] = v
            p_[i] = p + (nstep * m) / (np.sqrt(v) / bc2s + eps)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _cuda_moments(g, p, m, v, lane, inv, cl, gs, sign, wd, l2, decoupled, fused, w1, small, b2, c2, lrwd):
    """CUDA's rounding up to the new moments (``fused``: the fused kernel's; else foreach's)."""
    g = g * inv
    g = g * cl
    g = g / gs
    g = g * sign
    gf = fma32(p, wd, g)
    gp = g + p * wd  # the fused kernel's lane 0 of every 4 (aligned fast path)
    gl = gf if (lane != 0 or not fused) else gp
    g = gl if l2 else g
    pf = fma32(lrwd, p, p)
    pd = pf if fused else p * lrwd
    p = pd if decoupled else p
    gg = g * g
    mf = fma32(w1, m, fma32(-w1, g, g))
    ml = fma32(w1 if small else w1 - np.float32(1.0), g - m, m if small else g)
    vf = fma32(b2, v, fma32(-b2, gg, gg))
    vl = fma32(c2, gg, v * b2)
    m = mf if fused else ml
    v = vf if fused else vl
    return p, m, v


@njit(cache=True, nogil=True, error_model="numpy")
def _cuda_range(param, exp_avg, exp_avg_sq, max_sq, grad, goff, lo, hi, f, fl, snap_p, snap_m, snap_v, snap_x):
    """:func:`_update_range` with CUDA's rounding (see the module docstring)."""
    one = np.float32(1.0)
    inv = f[F_INV_SCALE] if fl[I_INV_SCALE] != 0 else one
    cl = f[F_CLIP] if fl[I_CLIP] != 0 else one
    gs = f[F_GRAD_SCALE] if fl[I_GRAD_SCALE] != 0 else one
    sign = -one if fl[I_MAXIMIZE] != 0 else one
    wd, l2, decoupled = f[F_WD], fl[I_L2] != 0, fl[I_DECOUPLED] != 0
    fused, small, recip = fl[I_RULE] == RULE_CUDA_FUSED, fl[I_LERP_SMALL] != 0, fl[I_RECIP] != 0
    w1, b2, c2, bc2s, eps, nstep, lrwd = f[F_W1], f[F_B2], f[F_C2], f[F_BC2S], f[F_EPS], f[F_NSTEP], f[F_DECAY]
    ams, snap = fl[I_AMSGRAD] != 0, len(snap_p) > 0
    start = fl[I_PARAM_START]  # local index of the parameter's element 0
    for i in range(lo, hi):
        p, m, v = _cuda_moments(grad[goff + i - lo], param[i], exp_avg[i], exp_avg_sq[i], (i - start) & 3, inv, cl,
                                gs, sign, wd, l2, decoupled, fused, w1, small, b2, c2, lrwd)
        vm = v
        if ams:
            vm = max_sq[i]
            if v > vm or np.isnan(v):
                vm = v
            max_sq[i] = vm
        root = np.sqrt(vm)
        if fused:
            p = p + (nstep * m) / (root / bc2s + eps)
        else:
            s = (root * bc2s if recip else root / bc2s) + eps
            p = fma32(nstep, m / s, p)
        param[i] = p
        exp_avg[i] = m
        exp_avg_sq[i] = v
        if snap:
            snap_p[i] = p
            snap_m[i] = m
            snap_v[i] = v
            if ams:
                snap_x[i] = vm


def _adam_apply(param, exp_avg, exp_avg_sq, max_sq, grad_addr, grad_len, work, seg_f, seg_i, snap_p, snap_m, snap_v,
                snap_x):
    """Apply one Adam/AdamW step in place over the work items.

    ``work`` is int64 ``[n, 5]`` of ``(lo, hi, segment, part, goff)``: local elements
    ``[lo, hi)`` of one segment whose gradient is elements ``goff .. goff + hi - lo`` of
    gradient part ``part``, a C-contiguous float32 array of ``grad_len[part]`` elements
    at address ``grad_addr[part]`` (the received payload frames, or one contiguous
    gradient; the caller keeps them alive); ``seg_f`` / ``seg_i`` are the per-segment scalar tables
    (columns ``F_*``/``I_*``). ``max_sq`` may be a length-0 array when no segment uses
    amsgrad; the ``snap_*`` arrays are length 0 unless this pass also fills a snapshot.
    """
    for w in prange(work.shape[0]):
        lo = work[w, 0]
        hi = work[w, 1]
        s = work[w, 2]
        fl = seg_i[s]
        if fl[I_ACTIVE] == 0:
            continue
        f = seg_f[s]
        part = work[w, 3]
        grad = carray(f32_at(grad_addr[part]), grad_len[part])
        goff = work[w, 4]
        if fl[I_RULE] != RULE_CPU:
            _cuda_range(param, exp_avg, exp_avg_sq, max_sq, grad, goff, lo, hi, f, fl, snap_p, snap_m, snap_v,
                        snap_x)
            continue
        tail = fl[I_TAIL_START]
        mid = min(max(tail, lo), hi)
        if mid > lo:
            _update_range(param, exp_avg, exp_avg_sq, max_sq, grad, goff, lo, mid, f, fl, False, snap_p, snap_m,
                          snap_v, snap_x)
        if hi > mid:
            _update_range(param, exp_avg, exp_avg_sq, max_sq, grad, goff + (mid - lo), mid, hi, f, fl, True,
                          snap_p, snap_m, snap_v, snap_x)


#: multi-threaded (numba prange over work items): the worker's kernel
adam_apply = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(_adam_apply)
#: single-threaded: for trainer processes (calibration), which must not start a thread
#: pool that competes with torch's own threads
adam_apply_serial = njit(cache=True, nogil=True, error_model="numpy")(_adam_apply)
