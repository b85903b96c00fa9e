"""The columns of the Adam kernels' per-segment scalar tables, and the ids of the rounding
rules a segment reproduces (``I_RULE``).

:class:`shadow.kernels.replay.ReplayPlan` fills the tables; the kernels
(:mod:`shadow.kernels.adam`) read them. numba compiles these integers into the kernels as
constants; :func:`shadow.kernels._cache.kernel` keys the kernels' cache by this module's
source too, so a change here is never read by a kernel compiled before it.
"""

from __future__ import annotations

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
