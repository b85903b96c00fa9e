"""Adamax replay kernel and its :class:`~shadow.kernels.base.KernelSet` (:data:`KERNELS_SET`),
bit-identical to torch's CPU single-tensor and foreach Adamax (torch has no fused one).

Per element, in torch's order: the gradient transforms of :mod:`shadow.kernels.adam`
(``g * inv_scale``, ``* clip``, ``/ grad_scale``), ``g = -g`` (maximize), the L2 penalty
``g = fma(p, wd, g)``; ``exp_avg = fma(w, g - m, m)`` (lerp with weight ``w = 1 - beta1``;
``fma(w - 1, g - m, g)`` when ``|w| >= 0.5``); ``exp_inf = max(exp_inf * beta2, |g| + eps)``
(NaN if either is); then ``p = p + (-clr * m) / exp_inf`` with ``clr = lr / (1 - beta1**step)``
computed in double and rounded once (``RULE_CPU``). ``RULE_CUDA_FOREACH`` ends with
``p = fma(-clr, m / exp_inf, p)`` instead (CUDA's ``addcdiv``); attach's calibration decides
whether a GPU's Adamax is replayed. Measured against torch 2.13 (``tests/kernels/test_adamax.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit, prange

from shadow.core.optimizers.adamax import AdamaxGroup
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import _cache  # first: it chooses the kernel cache directory before any @njit
from shadow.kernels._fma import f32_at, fma32
from shadow.kernels.replay import ReplayPlan, exact_reciprocal, segments_for_range

# float32 scalar columns
F_W1, F_B2, F_EPS, F_NCLR, F_WD, F_CLIP, F_INV_SCALE, F_GRAD_SCALE, F_RGRAD_SCALE = range(9)
N_FSCALARS = 9
# int64 flag columns
I_ACTIVE, I_MAXIMIZE, I_LERP_SMALL, I_L2, I_CLIP, I_INV_SCALE, I_GRAD_SCALE, I_RULE = range(8)
N_ISCALARS = 8
# I_RULE values
RULE_CPU, RULE_CUDA_FOREACH = 0, 1
RULES = {"foreach": RULE_CPU, "single": RULE_CPU, "cuda_foreach": RULE_CUDA_FOREACH, "cuda_single": RULE_CUDA_FOREACH}


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _adamax_step(p, g, m, u, inv, cl, div, gs, rgs, wd, l2, w1, small, b2, eps, nclr, cuda):
    """One element: ``(new param, new exp_avg, new exp_inf)``."""
    one = np.float32(1.0)
    g = g * inv  # inv carries maximize's sign (negation is exact and commutes with rounding)
    g = g * cl
    g = g / gs if div else g * rgs
    gl = fma32(p, wd, g)
    g = gl if l2 else g
    m = fma32(w1 if small else w1 - one, g - m, m if small else g)
    u = u * b2
    a = abs(g) + eps
    mx = u if u > a else a
    u = u + a if (np.isnan(u) or np.isnan(a)) else mx  # NaN-propagating maximum
    pc = p + (nclr * m) / u
    pg = fma32(nclr, m / u, p)
    return (pg if cuda else pc), m, u


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _adamax_range(param, exp_avg, exp_inf, grad, goff, lo, hi, f, fl, snap_p, snap_m, snap_u):
    # straight-line loop bodies with the segment's choices as selects (see adam.py)
    one = np.float32(1.0)
    inv = f[F_INV_SCALE] if fl[I_INV_SCALE] != 0 else one
    inv = -inv if fl[I_MAXIMIZE] != 0 else inv
    cl = f[F_CLIP] if fl[I_CLIP] != 0 else one
    div = fl[I_GRAD_SCALE] != 0
    gs, rgs = f[F_GRAD_SCALE], f[F_RGRAD_SCALE]
    wd, l2 = f[F_WD], fl[I_L2] != 0
    w1, small, b2, eps, nclr = f[F_W1], fl[I_LERP_SMALL] != 0, f[F_B2], f[F_EPS], f[F_NCLR]
    cuda = fl[I_RULE] == RULE_CUDA_FOREACH
    n = hi - lo
    p_, m_, u_, g_ = param[lo:hi], exp_avg[lo:hi], exp_inf[lo:hi], grad[goff : goff + n]
    if len(snap_p) > 0:  # a loop of its own: a branch in the body would stop vectorisation
        sp_, sm_, su_ = snap_p[lo:hi], snap_m[lo:hi], snap_u[lo:hi]
        for i in range(n):
            p, m, u = _adamax_step(
                p_[i], g_[i], m_[i], u_[i], inv, cl, div, gs, rgs, wd, l2, w1, small, b2, eps, nclr, cuda
            )
            m_[i] = m
            u_[i] = u
            p_[i] = p
            sm_[i] = m
            su_[i] = u
            sp_[i] = p
    else:
        for i in range(n):
            p, m, u = _adamax_step(
                p_[i], g_[i], m_[i], u_[i], inv, cl, div, gs, rgs, wd, l2, w1, small, b2, eps, nclr, cuda
            )
            m_[i] = m
            u_[i] = u
            p_[i] = p


def _adamax_apply(param, exp_avg, exp_inf, grad_addr, grad_len, work, seg_f, seg_i, snap_p, snap_m, snap_u):
    """One Adamax step in place over ``work`` rows ``(lo, hi, segment, part, goff)`` (see
    :func:`shadow.kernels.adam._adam_apply`); ``snap_*`` are length 0 unless this pass
    also fills a snapshot."""
    for w in prange(work.shape[0]):
        lo = work[w, 0]
        hi = work[w, 1]
        s = work[w, 2]
        fl = seg_i[s]
        if fl[I_ACTIVE] == 0:
            continue
        part = work[w, 3]
        grad = carray(f32_at(grad_addr[part]), grad_len[part])
        _adamax_range(param, exp_avg, exp_inf, grad, work[w, 4], lo, hi, seg_f[s], fl, snap_p, snap_m, snap_u)


#: multi-threaded (the worker's) and single-threaded (trainer processes: calibration)
adamax_apply, adamax_apply_serial = _cache.kernel(_adamax_apply, True), _cache.kernel(_adamax_apply, False)


def adamax_scalars(group: AdamaxGroup, step: float) -> tuple:
    """The float32 scalars torch derives (in double) for one step at ``step``, in the
    column order ``F_W1 .. F_WD``."""
    f32 = np.float32
    beta1, beta2 = group.betas
    clr = group.lr / (1 - beta1**step)
    return (f32(1 - beta1), f32(beta2), f32(group.eps), f32(-clr), f32(group.weight_decay))


class AdamaxKernels:
    """Adamax: one kernel, the rounding rule per segment (``I_RULE``)."""

    n_f, n_i = N_FSCALARS, N_ISCALARS

    def rule(self, impl: str, sqrt: SqrtTable | None) -> int:
        if impl not in RULES:
            raise ValueError(f"Adamax has no {impl!r} implementation to replay; replayed: {tuple(RULES)}")
        return RULES[impl]

    def setup(self, plan: ReplayPlan) -> None:
        plan.seg_i[:, I_RULE] = plan.rule

    def fill(
        self,
        plan: ReplayPlan,
        groups: Sequence[Any],
        steps: np.ndarray,
        has_state: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None,
        inv_scale: np.float32 | None,
        grad_scale: np.float32 | None,
    ) -> None:
        one = np.float32(1.0)
        cache: dict[tuple[int, float], tuple] = {}
        rgs = exact_reciprocal(grad_scale) if grad_scale is not None else None
        for s, seg in enumerate(plan.segments):
            row_i, row_f = plan.seg_i[s], plan.seg_f[s]
            if seg.param in skipped:
                row_i[I_ACTIVE] = 0
                continue
            grp: AdamaxGroup = groups[seg.group]
            key = (seg.group, float(steps[seg.param]))
            if key not in cache:
                cache[key] = adamax_scalars(grp, key[1])
            sc = cache[key]
            row_f[: len(sc)] = sc
            row_f[F_CLIP] = clip if clip is not None else one
            row_f[F_INV_SCALE] = inv_scale if inv_scale is not None else one
            row_f[F_GRAD_SCALE] = grad_scale if grad_scale is not None else one
            row_f[F_RGRAD_SCALE] = rgs if rgs is not None else one
            row_i[I_ACTIVE] = 1
            row_i[I_MAXIMIZE] = int(bool(grp.maximize))
            row_i[I_LERP_SMALL] = int(abs(sc[F_W1]) < 0.5)
            row_i[I_L2] = int(grp.weight_decay != 0)
            row_i[I_CLIP] = int(clip is not None)
            row_i[I_INV_SCALE] = int(inv_scale is not None)
            row_i[I_GRAD_SCALE] = int(grad_scale is not None and rgs is None)  # divide

    def run(self, plan, arrays, addr, length, work, snaps, threads) -> None:
        fn = adamax_apply if threads else adamax_apply_serial
        fn(*arrays, addr, length, work, plan.seg_f, plan.seg_i, *snaps)

    def warm_up(self, threads: tuple[bool, ...]) -> list:
        one = np.ones(16, dtype=np.float32)
        plan = ReplayPlan(segments_for_range([0], [16], [0], 0, 16, "foreach", 16, 8), "foreach", 16, "adamax")
        group = AdamaxGroup(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False)
        plan.fill([group], np.ones(1), np.ones(1, dtype=bool), set())
        for t in threads:
            plan.apply(one.copy(), one.copy(), one.copy(), one, threads=t)
        return [(adamax_apply, adamax_apply_serial)[0 if t else 1] for t in threads]


KERNELS_SET = AdamaxKernels()
