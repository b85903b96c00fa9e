"""The loops of the Adam / AdamW kernels, shared by every rounding rule: one work item
(:func:`_item`) over a slice of one segment (:func:`_update_range`), with the rule a
constant that picks its element arithmetic (:mod:`shadow.kernels.adam_rules`) or, for
``RULE_CPU_TABLE``, the table rule's blocked loop (:mod:`shadow.kernels.adam_cpu_table`).

The rules share these loops rather than each having its own copy so that they stay
alike: the same slicing, the same amsgrad and snapshot variants (each a loop of its own,
as a branch in a loop's body would stop its vectorisation), the same gradient transforms.
The kernels that run them, one per rule, are :mod:`shadow.kernels.adam`.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from shadow.kernels import _cache  # noqa: F401 - first: it chooses the kernel cache directory before any @njit
from shadow.kernels._fma import f32_at
from shadow.kernels.adam_columns import (
    F_B2,
    F_BC2S,
    F_C2,
    F_CLIP,
    F_DECAY,
    F_EPS,
    F_GRAD_SCALE,
    F_INV_SCALE,
    F_NSTEP,
    F_RGRAD_SCALE,
    F_W1,
    F_WD,
    I_ACTIVE,
    I_AMSGRAD,
    I_CLIP,
    I_DECOUPLED,
    I_GRAD_SCALE,
    I_INV_SCALE,
    I_L2,
    I_LERP_SMALL,
    I_MAXIMIZE,
    I_PARAM_START,
    I_RECIP,
    I_TAIL_START,
    RULE_CPU,
    RULE_CPU_TABLE,
)
from shadow.kernels.adam_cpu_table import _update_table
from shadow.kernels.adam_rules import _grad, _moments, _step


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _update_range(
    rule,
    param,
    exp_avg,
    exp_avg_sq,
    max_sq,
    grad,
    goff,
    lo,
    hi,
    f,
    fl,
    tail,
    snap_p,
    snap_m,
    snap_v,
    snap_x,
    sq_tab,
    sq_map,
):
    """Local elements ``[lo, hi)``; their gradient is ``grad[goff:goff + hi - lo]``. With
    ``snap_p`` non-empty, the new values are also written to the ``snap_*`` arrays (the
    persistence image of this iteration: one pass instead of an apply and a copy).

    The loops run over slices from 0 (no negative-index wrap in the body), with numpy's
    error model (no zero-division checks) and the segment's choices as selects: LLVM
    then vectorises them (``tools/inspect_kernels.py`` shows the loops per CPU)."""
    one = np.float32(1.0)
    inv = f[F_INV_SCALE] if fl[I_INV_SCALE] != 0 else one
    inv = -inv if fl[I_MAXIMIZE] != 0 else inv
    cl = f[F_CLIP] if fl[I_CLIP] != 0 else one
    div = fl[I_GRAD_SCALE] != 0
    gs, rgs = f[F_GRAD_SCALE], f[F_RGRAD_SCALE]
    wd, l2, decoupled = f[F_WD], fl[I_L2] != 0, fl[I_DECOUPLED] != 0
    dec = f[F_DECAY] if decoupled else one
    small, recip = fl[I_LERP_SMALL] != 0, fl[I_RECIP] != 0
    w1, b2, c2, bc2s, eps, nstep = f[F_W1], f[F_B2], f[F_C2], f[F_BC2S], f[F_EPS], f[F_NSTEP]
    off = lo - fl[I_PARAM_START]  # element i of the slice is element off + i of its parameter
    n = hi - lo
    p_, m_, v_, g_ = param[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[goff : goff + n]
    snap = len(snap_p) > 0
    if fl[I_AMSGRAD] != 0:
        x_ = max_sq[lo:hi]
        sp_, sm_, sv_, sx_ = snap_p[lo:hi], snap_m[lo:hi], snap_v[lo:hi], snap_x[lo:hi]
        for i in range(n):
            p, m, v = _moments(
                rule,
                _grad(g_[i], inv, cl, div, gs, rgs),
                p_[i],
                m_[i],
                v_[i],
                (off + i) & 3,
                wd,
                l2,
                decoupled,
                tail,
                dec,
                w1,
                small,
                b2,
                c2,
            )
            m_[i] = m
            v_[i] = v
            mx = x_[i]
            if v > mx or np.isnan(v):
                mx = v
            x_[i] = mx
            p = _step(rule, p, m, mx, recip, nstep, bc2s, eps, sq_tab, sq_map)
            p_[i] = p
            if snap:
                sp_[i] = p
                sm_[i] = m
                sv_[i] = v
                sx_[i] = mx
    elif snap:  # a loop of its own: a branch in the body would stop vectorisation
        sp_, sm_, sv_ = snap_p[lo:hi], snap_m[lo:hi], snap_v[lo:hi]
        for i in range(n):
            p, m, v = _moments(
                rule,
                _grad(g_[i], inv, cl, div, gs, rgs),
                p_[i],
                m_[i],
                v_[i],
                (off + i) & 3,
                wd,
                l2,
                decoupled,
                tail,
                dec,
                w1,
                small,
                b2,
                c2,
            )
            p = _step(rule, p, m, v, recip, nstep, bc2s, eps, sq_tab, sq_map)
            m_[i] = m
            v_[i] = v
            p_[i] = p
            sm_[i] = m
            sv_[i] = v
            sp_[i] = p
    else:
        for i in range(n):
            p, m, v = _moments(
                rule,
                _grad(g_[i], inv, cl, div, gs, rgs),
                p_[i],
                m_[i],
                v_[i],
                (off + i) & 3,
                wd,
                l2,
                decoupled,
                tail,
                dec,
                w1,
                small,
                b2,
                c2,
            )
            m_[i] = m
            v_[i] = v
            p_[i] = _step(rule, p, m, v, recip, nstep, bc2s, eps, sq_tab, sq_map)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _row(w, work, seg_f, seg_i, grad_addr, grad_len):
    """Work row ``w``: ``(lo, hi, float scalars, int scalars, its gradient part, goff)``."""
    s = work[w, 2]
    return (
        work[w, 0],
        work[w, 1],
        seg_f[s],
        seg_i[s],
        carray(f32_at(grad_addr[work[w, 3]]), grad_len[work[w, 3]]),
        work[w, 4],
    )


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _item(
    rule,
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
):
    """Work row ``w`` under ``rule`` (a constant)."""
    lo, hi, f, fl, grad, goff = _row(w, work, seg_f, seg_i, grad_addr, grad_len)
    if fl[I_ACTIVE] == 0:
        return
    if rule == RULE_CPU_TABLE:
        one = np.float32(1.0)
        inv = f[F_INV_SCALE] if fl[I_INV_SCALE] != 0 else one
        inv = -inv if fl[I_MAXIMIZE] != 0 else inv
        ams, snap = fl[I_AMSGRAD] != 0, len(snap_p) > 0
        _update_table(
            param[lo:hi],
            exp_avg[lo:hi],
            exp_avg_sq[lo:hi],
            max_sq[lo:hi] if ams else max_sq[:0],
            grad[goff : goff + hi - lo],
            inv,
            f[F_CLIP] if fl[I_CLIP] != 0 else one,
            fl[I_GRAD_SCALE] != 0,
            f[F_GRAD_SCALE],
            f[F_RGRAD_SCALE],
            f,
            fl,
            snap_p[lo:hi] if snap else snap_p,
            snap_m[lo:hi] if snap else snap_m,
            snap_v[lo:hi] if snap else snap_v,
            snap_x[lo:hi] if snap and ams else snap_x[:0],
            sq_tab,
            sq_map,
        )
        return
    # the fused CPU kernel's tail rule from I_TAIL_START on: one loop, run over the body
    # part and then the tail part (the rule a uniform choice in it)
    mid = min(max(fl[I_TAIL_START], lo), hi) if rule == RULE_CPU else hi  # (the table rule has no tail)
    for half in range(2):
        a = lo if half == 0 else mid
        b = mid if half == 0 else hi
        if b > a:
            _update_range(
                rule,
                param,
                exp_avg,
                exp_avg_sq,
                max_sq,
                grad,
                goff + (a - lo),
                a,
                b,
                f,
                fl,
                half == 1,
                snap_p,
                snap_m,
                snap_v,
                snap_x,
                sq_tab,
                sq_map,
            )
