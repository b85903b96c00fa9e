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

torch's single-tensor and foreach CPU paths compute ``sqrt(v)`` with MKL's vector math
library, which is not correctly rounded: ``RULE_CPU_TABLE`` is the CPU rule with the
trainer's square root, measured at attach (:mod:`shadow.core.sqrttab`).

CUDA's kernels round differently (measured on an H200 with torch 2.11,
``tests/data/cuda_optim.npz``); each rule has a kernel of its own (:data:`KERNELS`, the
plan picks it from the implementation; ``I_RULE`` names it per segment):

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

from shadow.kernels import _cache  # first: it chooses the kernel cache directory before any @njit
from shadow.kernels._fma import bits_f32, f32_at, f32_bits, fma32

# Columns of the per-segment float32 scalar table.
(F_W1, F_B2, F_C2, F_BC2S, F_EPS, F_NSTEP, F_DECAY, F_WD, F_CLIP, F_INV_SCALE, F_GRAD_SCALE, F_RGRAD_SCALE) = range(12)
N_FSCALARS = 12
# Columns of the per-segment int64 table.
(
    I_ACTIVE,
    I_AMSGRAD,
    I_MAXIMIZE,
    I_TAIL_START,
    I_LERP_SMALL,
    I_L2,
    I_DECOUPLED,
    I_CLIP,
    I_INV_SCALE,
    I_GRAD_SCALE,
    I_RULE,
    I_PARAM_START,
    I_RECIP,
) = range(13)
N_ISCALARS = 13
# I_RULE values: whose rounding the segment reproduces (RULE_CPU_TABLE: torch's CPU
# single-tensor and foreach paths, whose square root is MKL's: ``shadow.core.sqrttab``)
RULE_CPU, RULE_CUDA_FUSED, RULE_CUDA_FOREACH, RULE_CPU_TABLE = 0, 1, 2, 3

# The element functions below are plain ``@njit``, not inlined by numba: LLVM inlines them
# into each loop, which it then vectorises (``tools/inspect_kernels.py`` shows it).
# numba's own inlining (``inline="always"``) of the three rules' loops took 57-70 s to
# compile instead of 18. They are not cached themselves: they are compiled (in
# milliseconds) with the kernels that use them, and those are cached.


@njit(nogil=True, error_model="numpy")
def _grad(g, inv, cl, div, gs, rgs):
    """The gradient transforms, in torch's order: ``g * inv_scale`` (``GradScaler.unscale_``),
    ``* clip``, ``/ grad_scale`` (``GradScaler.step`` into a fused kernel), ``* -1``
    (maximize). Negation is exact and commutes with rounding, so maximize is folded into
    ``inv`` (``-inv``). ``x / 2**k`` and ``x * 2**-k`` round alike, so a power-of-two
    grad scale (GradScaler's) multiplies by its reciprocal ``rgs``: a division costs
    3-5x a multiplication, and the divider is what bounds this kernel on Intel cores.
    ``div`` is set only for other scales."""
    g = g * inv
    g = g * cl
    return g / gs if div else g * rgs


@njit(nogil=True, error_model="numpy")
def _moments(rule, g, p, m, v, lane, wd, l2, decoupled, tail, dec, w1, small, b2, c2):
    """One element up to the new moments: ``(p after decoupled decay, exp_avg, exp_avg_sq)``.

    ``rule`` is a constant at every call site, so each kernel keeps one rule's code; the
    other flags are the segment's, uniform over a loop (LLVM vectorises the loop and
    lowers a uniform choice as a predictable branch)."""
    one = np.float32(1.0)
    if rule == RULE_CUDA_FUSED:
        gf = fma32(p, wd, g)
        gp = g + p * wd  # lane 0 of every 4 (the aligned fast path)
        gl = gf if lane != 0 else gp
        g = gl if l2 else g
        pd = fma32(dec, p, p)  # dec = -(lr * wd)
        p = pd if decoupled else p
        gg = g * g
        return p, fma32(w1, m, fma32(-w1, g, g)), fma32(b2, v, fma32(-b2, gg, gg))
    if rule == RULE_CUDA_FOREACH:
        gl = fma32(p, wd, g)
        g = gl if l2 else g
        p = p * dec  # dec = 1 - lr * wd, or 1
        return p, fma32(w1 if small else w1 - one, g - m, m if small else g), fma32(c2, g * g, v * b2)
    gl = fma32(p, wd, g)
    g = gl if l2 else g
    p = p * dec  # dec = 1 unless decoupled
    m = fma32(w1 if small else w1 - one, g - m, m if small else g)
    cg = c2 * g
    vt = fma32(v, b2, cg * g)  # the fused kernel's scalar remainder loop
    vb = fma32(cg, g, v * b2)
    return p, m, (vt if tail else vb)


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


@njit(nogil=True, error_model="numpy")
def _step(rule, p, m, vm, recip, nstep, bc2s, eps, tab, emap):
    """The parameter update from the new moments (``vm``: amsgrad's max, else ``v``)."""
    root = np.sqrt(vm)
    if rule == RULE_CUDA_FOREACH:  # the single-tensor path multiplies by 1 / bc2s (recip)
        return fma32(nstep, m / ((root * bc2s if recip else root / bc2s) + eps), p)
    return p + (nstep * m) / (root / bc2s + eps)


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
#: the square root table the rules other than RULE_CPU_TABLE are given (never read)
NO_TABLE, NO_MAP = np.zeros(1, dtype=np.uint32), np.full(512, -1, dtype=np.int32)
