"""The per-element arithmetic of Adam / AdamW under each closed-form rounding rule:
torch's CPU kernels (``RULE_CPU``), CUDA's fused kernel (``RULE_CUDA_FUSED``) and CUDA's
foreach and single-tensor kernels (``RULE_CUDA_FOREACH``). The loops that apply them are
:mod:`shadow.kernels.adam_loops`; the rule with the trainer's square root table,
:mod:`shadow.kernels.adam_cpu_table`.

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
``tests/data/cuda_optim.npz``):

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
from numba import njit

from shadow.kernels._fma import fma32
from shadow.kernels.adam_columns import RULE_CUDA_FOREACH, RULE_CUDA_FUSED

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


@njit(nogil=True, error_model="numpy")
def _step(rule, p, m, vm, recip, nstep, bc2s, eps, tab, emap):
    """The parameter update from the new moments (``vm``: amsgrad's max, else ``v``)."""
    root = np.sqrt(vm)
    if rule == RULE_CUDA_FOREACH:  # the single-tensor path multiplies by 1 / bc2s (recip)
        return fma32(nstep, m / ((root * bc2s if recip else root / bc2s) + eps), p)
    return p + (nstep * m) / (root / bc2s + eps)
