"""The Adam / AdamW rule of torch's single-tensor and foreach CPU paths
(``RULE_CPU_TABLE``): the CPU rule (:mod:`shadow.kernels.adam_rules`) with the trainer's
square root.

Those paths compute ``sqrt(v)`` with MKL's vector math library, which is not correctly
rounded: the trainer measures its square root at attach into a table
(:mod:`shadow.core.sqrttab`), and this rule steps IEEE's root by one ulp where the table
says so. The other rules' kernels are given :data:`NO_TABLE` and :data:`NO_MAP`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from shadow.kernels._fma import bits_f32, f32_bits, fma32
from shadow.kernels.adam_columns import (
    F_B2,
    F_BC2S,
    F_C2,
    F_DECAY,
    F_EPS,
    F_NSTEP,
    F_W1,
    F_WD,
    I_DECOUPLED,
    I_L2,
    I_LERP_SMALL,
    RULE_CPU,
)
from shadow.kernels.adam_rules import _grad, _moments

TABLE_BLOCK = 1024  # elements per block of the table rule's three passes


@njit(nogil=True, error_model="numpy")
def _table_word(x, tab, emap):
    """The uint32 word of the square root table (:class:`shadow.core.sqrttab.SqrtTable`: ``tab`` its
    slots as words, ``emap`` the slot of each sign and exponent, -1 for none) that holds
    ``x``'s bit (``m & 31`` of it), 0 where ``x`` takes IEEE's root."""
    b = f32_bits(x)
    slot = emap[b >> np.uint32(23)]
    m = b & np.uint32(0x7FFFFF)
    i = (np.uint64(max(slot, 0)) << np.uint64(18)) | np.uint64(m >> np.uint32(5))
    return tab[i] if slot >= 0 else np.uint32(0)


@njit(nogil=True, error_model="numpy")
def _table_sqrt(x, word):
    """The trainer's square root of ``x``: IEEE ``sqrt``, stepped one ulp towards the exact
    root where ``x``'s bit in ``word`` (:func:`_table_word`) is set. The direction is the sign
    of ``x - s * s``, exact in one fused operation."""
    s = np.sqrt(x)
    bit = np.int32((word >> (f32_bits(x) & np.uint32(31))) & np.uint32(1))
    step = bit if fma32(-s, s, x) > np.float32(0.0) else -bit
    return bits_f32(np.uint32(np.int32(f32_bits(s)) + step))


@njit(nogil=True, error_model="numpy")
def _update_table(p_, m_, v_, x_, g_, inv, cl, div, gs, rgs, f, fl, sp_, sm_, sv_, sx_, tab, emap):
    """:data:`RULE_CPU_TABLE` over one slice (the arrays are the slice's), in blocks of
    :data:`TABLE_BLOCK` elements and three passes each, so that the table's random reads do
    not keep the arithmetic from vectorising: the moments (and the decayed parameter, kept
    in ``p_`` meanwhile), then the table's words for the new ``v`` (or amsgrad's max), then
    the square roots and the update. ``x_``/``sx_``: amsgrad's arrays, length 0 without;
    ``sp_``..: the snapshot's, length 0 without."""
    one = np.float32(1.0)
    wd, l2, decoupled = f[F_WD], fl[I_L2] != 0, fl[I_DECOUPLED] != 0
    dec = f[F_DECAY] if decoupled else one
    small = fl[I_LERP_SMALL] != 0
    w1, b2, c2, bc2s, eps, nstep = f[F_W1], f[F_B2], f[F_C2], f[F_BC2S], f[F_EPS], f[F_NSTEP]
    ams, snap = len(x_) > 0, len(sp_) > 0
    words = np.empty(TABLE_BLOCK, dtype=np.uint32)
    n = len(p_)
    for lo in range(0, n, TABLE_BLOCK):
        k = min(TABLE_BLOCK, n - lo)
        bp, bm, bv, bg = p_[lo : lo + k], m_[lo : lo + k], v_[lo : lo + k], g_[lo : lo + k]
        for i in range(k):
            p, m, v = _moments(
                RULE_CPU,
                _grad(bg[i], inv, cl, div, gs, rgs),
                bp[i],
                bm[i],
                bv[i],
                0,
                wd,
                l2,
                decoupled,
                False,
                dec,
                w1,
                small,
                b2,
                c2,
            )
            bp[i] = p
            bm[i] = m
            bv[i] = v
        if ams:
            bx = x_[lo : lo + k]
            for i in range(k):
                mx = bx[i]
                v = bv[i]
                if v > mx or np.isnan(v):
                    mx = v
                bx[i] = mx
        root_of = x_[lo : lo + k] if ams else bv
        for i in range(k):  # the random reads alone: many in flight at once
            words[i] = _table_word(root_of[i], tab, emap)
        for i in range(k):
            bp[i] = bp[i] + (nstep * bm[i]) / (_table_sqrt(root_of[i], words[i]) / bc2s + eps)
        if snap:
            sp_[lo : lo + k] = bp
            sm_[lo : lo + k] = bm
            sv_[lo : lo + k] = bv
            if ams:
                sx_[lo : lo + k] = root_of


#: the square root table the rules other than RULE_CPU_TABLE are given (never read)
NO_TABLE, NO_MAP = np.zeros(1, dtype=np.uint32), np.full(512, -1, dtype=np.int32)
