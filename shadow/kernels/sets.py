"""The :class:`shadow.kernels.base.KernelSet` of the kernel modules that predate it:
:data:`ADAM_KERNELS` (:mod:`shadow.kernels.adam`) and :data:`SGD_KERNELS`
(:mod:`shadow.kernels.sgd`), which fill their scalar tables and call their kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shadow.core.optimizers.adam import AdamGroup
from shadow.core.optimizers.sgd import SgdGroup
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import adam as _adam
from shadow.kernels import adam_columns as _cols
from shadow.kernels import adam_cpu_table as _table
from shadow.kernels import sgd as _sgd
from shadow.kernels.replay import ReplayPlan, adam_scalars, exact_reciprocal, segments_for_range

_ONE = np.float32(1.0)


def _tiny(impl: str) -> list:
    return segments_for_range([0], [16], [0], 0, 16, impl, 16, 8)


class AdamKernels:
    """Adam / AdamW: one kernel per rounding rule (``adam.KERNELS``)."""

    n_f, n_i = _cols.N_FSCALARS, _cols.N_ISCALARS
    RULES = {
        "fused": _cols.RULE_CPU,
        "foreach": _cols.RULE_CPU,
        "single": _cols.RULE_CPU,
        "cuda_fused": _cols.RULE_CUDA_FUSED,
        "cuda_foreach": _cols.RULE_CUDA_FOREACH,
        "cuda_single": _cols.RULE_CUDA_FOREACH,
    }

    def rule(self, impl: str, sqrt: SqrtTable | None) -> int:
        return _cols.RULE_CPU_TABLE if sqrt is not None else self.RULES[impl]

    def setup(self, plan: ReplayPlan) -> None:
        for s, seg in enumerate(plan.segments):
            plan.seg_i[s, _cols.I_TAIL_START] = seg.tail
            plan.seg_i[s, _cols.I_RULE] = plan.rule
            plan.seg_i[s, _cols.I_PARAM_START] = seg.start
            plan.seg_i[s, _cols.I_RECIP] = int(plan.impl == "cuda_single")

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
        cache: dict[tuple[int, float], tuple[float, ...]] = {}
        rgs = exact_reciprocal(grad_scale) if grad_scale is not None else None
        for s, seg in enumerate(plan.segments):
            row_i = plan.seg_i[s]
            if seg.param in skipped:
                row_i[_cols.I_ACTIVE] = 0
                continue
            grp: AdamGroup = groups[seg.group]
            step = float(steps[seg.param])
            key = (seg.group, step)
            if key not in cache:
                beta1, beta2 = grp.betas
                cache[key] = adam_scalars(
                    plan.impl, grp.lr, beta1, beta2, grp.eps, grp.weight_decay, grp.decoupled, step, plan.powers
                )
            sc = cache[key]
            plan.seg_f[s, : len(sc)] = sc
            plan.seg_f[s, _cols.F_CLIP] = clip if clip is not None else _ONE
            plan.seg_f[s, _cols.F_INV_SCALE] = inv_scale if inv_scale is not None else _ONE
            plan.seg_f[s, _cols.F_GRAD_SCALE] = grad_scale if grad_scale is not None else _ONE
            plan.seg_f[s, _cols.F_RGRAD_SCALE] = rgs if rgs is not None else _ONE
            row_i[_cols.I_INV_SCALE] = int(inv_scale is not None)
            row_i[_cols.I_GRAD_SCALE] = int(grad_scale is not None and rgs is None)  # divide
            row_i[_cols.I_ACTIVE] = 1
            row_i[_cols.I_AMSGRAD] = int(bool(grp.amsgrad))
            row_i[_cols.I_MAXIMIZE] = int(bool(grp.maximize))
            row_i[_cols.I_LERP_SMALL] = int(abs(sc[_cols.F_W1]) < 0.5)
            wd = grp.weight_decay
            row_i[_cols.I_L2] = int(wd != 0 and not grp.decoupled)
            row_i[_cols.I_DECOUPLED] = int(wd != 0 and grp.decoupled)
            row_i[_cols.I_CLIP] = int(clip is not None)

    def run(self, plan, arrays, addr, length, work, snaps, threads) -> None:
        fn = _adam.KERNELS[plan.rule][0 if threads else 1]
        sq = (plan.sqrt.words, plan.sqrt.emap32) if plan.sqrt is not None else (_table.NO_TABLE, _table.NO_MAP)
        fn(*arrays, addr, length, work, plan.seg_f, plan.seg_i, *snaps, *sq)

    def warm_up(self, threads: tuple[bool, ...]) -> list:
        one = np.ones(16, dtype=np.float32)
        group = AdamGroup(
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, decoupled=True
        )
        table = SqrtTable.build(np.zeros(2 * (1 << 20), dtype=np.uint8), [-1] + [(e - 127) & 1 for e in range(1, 255)])
        for impl, sqrt in (("fused", None), ("cuda_fused", None), ("cuda_foreach", None), ("single", table)):
            plan = ReplayPlan(_tiny("fused"), impl, 16, "adam", sqrt=sqrt)  # one kernel per rounding rule
            plan.prepare([group], np.ones(1), set(), None)
            for t in threads:
                plan.apply(one.copy(), one.copy(), one.copy(), np.zeros(0, np.float32), one, threads=t)
        return [pair[0 if t else 1] for pair in _adam.KERNELS.values() for t in threads]


class SgdKernels:
    """SGD: one kernel for every implementation (the fused tail rule per segment)."""

    n_f, n_i = _sgd.N_FSCALARS, _sgd.N_ISCALARS

    def rule(self, impl: str, sqrt: SqrtTable | None) -> int:
        return 0

    def setup(self, plan: ReplayPlan) -> None:
        for s, seg in enumerate(plan.segments):
            plan.seg_i[s, _sgd.J_TAIL_START] = seg.tail

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
        for s, seg in enumerate(plan.segments):
            row_i, row_f = plan.seg_i[s], plan.seg_f[s]
            if seg.param in skipped:
                row_i[_sgd.J_ACTIVE] = 0
                continue
            grp: SgdGroup = groups[seg.group]
            row_f[:4] = _sgd.sgd_scalars(grp)
            row_f[_sgd.S_CLIP] = clip if clip is not None else _ONE
            row_f[_sgd.S_INV_SCALE] = inv_scale if inv_scale is not None else _ONE
            row_f[_sgd.S_GRAD_SCALE] = grad_scale if grad_scale is not None else _ONE
            row_i[_sgd.J_ACTIVE] = 1
            row_i[_sgd.J_FIRST] = int(not has_state[seg.param])
            row_i[_sgd.J_NESTEROV] = int(bool(grp.nesterov))
            row_i[_sgd.J_MAXIMIZE] = int(bool(grp.maximize))
            row_i[_sgd.J_MOMENTUM] = int(grp.momentum != 0)
            row_i[_sgd.J_WD] = int(grp.weight_decay != 0)
            row_i[_sgd.J_CLIP] = int(clip is not None)
            row_i[_sgd.J_INV_SCALE] = int(inv_scale is not None)
            row_i[_sgd.J_GRAD_SCALE] = int(grad_scale is not None)

    def run(self, plan, arrays, addr, length, work, snaps, threads) -> None:
        fn = _sgd.sgd_apply if threads else _sgd.sgd_apply_serial
        fn(*arrays, addr, length, work, plan.seg_f, plan.seg_i, *snaps)

    def warm_up(self, threads: tuple[bool, ...]) -> list:
        one = np.ones(16, dtype=np.float32)
        plan = ReplayPlan(_tiny("fused"), "fused", 16, "sgd")
        group = SgdGroup(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
        plan.fill([group], np.zeros(1), np.zeros(1, dtype=bool), set())
        for t in threads:
            plan.apply(one.copy(), one.copy(), one, threads=t)
        return [(_sgd.sgd_apply, _sgd.sgd_apply_serial)[0 if t else 1] for t in threads]


ADAM_KERNELS = AdamKernels()
SGD_KERNELS = SgdKernels()
