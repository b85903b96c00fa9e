"""Per-range replay plan: which parameter slices a worker owns and their scalars.

Pure helpers (``segments_for_range``, ``adam_scalars``, ``tail_start``) are kept apart
from :class:`ReplayPlan`, which turns a commit record into the kernel's scalar tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shadow.kernels import adam as _adam
from shadow.kernels import sgd as _sgd

IMPLS = ("fused", "foreach", "single")
KINDS = ("adam", "sgd")


def tail_start(numel: int, impl: str, vec_width: int, tail_width: int) -> int:
    """First element index (within a tensor) that the fused kernel's scalar remainder
    loop computes; ``numel`` when the variant has no such elements."""
    if impl != "fused":
        return numel
    rem = numel % vec_width
    return numel - rem + (rem // tail_width) * tail_width


def adam_scalars(
    impl: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> tuple[float, ...]:
    """The float32 scalars torch derives (in double) for one Adam step at ``step``.

    Returned in the column order of ``adam.F_*`` except the clip column.
    """
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if impl == "fused":
        bc2_sqrt = math.sqrt(bias_correction2)
    else:
        bc2_sqrt = bias_correction2**0.5
    f32 = np.float32
    return (
        f32(1 - beta1),
        f32(beta2),
        f32(1 - beta2),
        f32(bc2_sqrt),
        f32(eps),
        f32(-step_size),
        f32(1 - lr * weight_decay),
        f32(weight_decay),
    )


@dataclass(frozen=True)
class Segment:
    """A slice of parameter ``param`` held at local ``[lo, hi)`` of a worker's range."""

    param: int
    group: int
    lo: int
    hi: int
    tail: int  # local index where the fused tail rule starts (>= hi: never)


def segments_for_range(
    offsets: Sequence[int],
    numels: Sequence[int],
    groups: Sequence[int],
    start: int,
    stop: int,
    impl: str,
    vec_width: int,
    tail_width: int,
) -> list[Segment]:
    """Intersect every parameter's flat extent with ``[start, stop)``."""
    out = []
    for i, (off, n, g) in enumerate(zip(offsets, numels, groups)):
        lo, hi = max(off, start), min(off + n, stop)
        if lo >= hi:
            continue
        out.append(
            Segment(i, g, lo - start, hi - start, off + tail_start(n, impl, vec_width, tail_width) - start)
        )
    return out


def work_items(segments: Sequence[Segment], chunk: int) -> np.ndarray:
    """Split segments into ``(lo, hi, segment)`` items of at most ``chunk`` elements."""
    rows = []
    for s, seg in enumerate(segments):
        for lo in range(seg.lo, seg.hi, chunk):
            rows.append((lo, min(lo + chunk, seg.hi), s))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


class ReplayPlan:
    """Scalar tables for one worker range, refreshed per iteration from the commit."""

    def __init__(self, segments: Sequence[Segment], impl: str, chunk: int, kind: str = "adam") -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown optimizer implementation {impl!r}; expected one of {IMPLS}")
        if kind not in KINDS:
            raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {KINDS}")
        self.segments = list(segments)
        self.impl, self.kind = impl, kind
        self.work = work_items(self.segments, chunk)
        mod = _adam if kind == "adam" else _sgd
        self.seg_f = np.zeros((len(self.segments), mod.N_FSCALARS), dtype=np.float32)
        self.seg_i = np.zeros((len(self.segments), mod.N_ISCALARS), dtype=np.int64)
        tail_col = _adam.I_TAIL_START if kind == "adam" else _sgd.J_TAIL_START
        for s, seg in enumerate(self.segments):
            self.seg_i[s, tail_col] = seg.tail

    def prepare_sgd(self, groups: Sequence[dict], has_state: np.ndarray, skipped: set[int], clip=None,
                    inv_scale=None, grad_scale=None) -> None:
        """Fill the SGD tables for one iteration (``has_state``: momentum buffer exists)."""
        one = np.float32(1.0)
        for s, seg in enumerate(self.segments):
            row_i, row_f = self.seg_i[s], self.seg_f[s]
            if seg.param in skipped:
                row_i[_sgd.J_ACTIVE] = 0
                continue
            grp = groups[seg.group]
            row_f[:4] = _sgd.sgd_scalars(grp)
            row_f[_sgd.S_CLIP] = clip if clip is not None else one
            row_f[_sgd.S_INV_SCALE] = inv_scale if inv_scale is not None else one
            row_f[_sgd.S_GRAD_SCALE] = grad_scale if grad_scale is not None else one
            row_i[_sgd.J_ACTIVE] = 1
            row_i[_sgd.J_FIRST] = int(not has_state[seg.param])
            row_i[_sgd.J_NESTEROV] = int(bool(grp["nesterov"]))
            row_i[_sgd.J_MAXIMIZE] = int(bool(grp["maximize"]))
            row_i[_sgd.J_MOMENTUM] = int(grp["momentum"] != 0)
            row_i[_sgd.J_WD] = int(grp["weight_decay"] != 0)
            row_i[_sgd.J_CLIP] = int(clip is not None)
            row_i[_sgd.J_INV_SCALE] = int(inv_scale is not None)
            row_i[_sgd.J_GRAD_SCALE] = int(grad_scale is not None)

    def apply_sgd(self, param, buf, grad, threads: bool = True) -> None:
        fn = _sgd.sgd_apply if threads else _sgd.sgd_apply_serial
        fn(param, buf, grad, self.work, self.seg_f, self.seg_i)

    def prepare(
        self,
        groups: Sequence[dict],
        steps: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None,
        inv_scale: np.float32 | None = None,
        grad_scale: np.float32 | None = None,
    ) -> None:
        """Fill the tables for one iteration.

        ``groups``: per param group ``lr, betas, eps, weight_decay, amsgrad, maximize,
        decoupled``; ``steps``: per-parameter step count *after* this iteration's
        increment; ``skipped``: parameters the optimizer did not step.
        """
        cache: dict[tuple[int, float], tuple[float, ...]] = {}
        for s, seg in enumerate(self.segments):
            row_i = self.seg_i[s]
            if seg.param in skipped:
                row_i[_adam.I_ACTIVE] = 0
                continue
            grp = groups[seg.group]
            step = float(steps[seg.param])
            key = (seg.group, step)
            if key not in cache:
                beta1, beta2 = grp["betas"]
                cache[key] = adam_scalars(
                    self.impl, grp["lr"], beta1, beta2, grp["eps"], grp["weight_decay"],
                    grp["decoupled"], step,
                )
            sc = cache[key]
            self.seg_f[s, : len(sc)] = sc
            self.seg_f[s, _adam.F_CLIP] = clip if clip is not None else np.float32(1.0)
            self.seg_f[s, _adam.F_INV_SCALE] = inv_scale if inv_scale is not None else np.float32(1.0)
            self.seg_f[s, _adam.F_GRAD_SCALE] = grad_scale if grad_scale is not None else np.float32(1.0)
            row_i[_adam.I_INV_SCALE] = int(inv_scale is not None)
            row_i[_adam.I_GRAD_SCALE] = int(grad_scale is not None)
            row_i[_adam.I_ACTIVE] = 1
            row_i[_adam.I_AMSGRAD] = int(bool(grp["amsgrad"]))
            row_i[_adam.I_MAXIMIZE] = int(bool(grp["maximize"]))
            row_i[_adam.I_LERP_SMALL] = int(abs(sc[_adam.F_W1]) < 0.5)
            wd = grp["weight_decay"]
            row_i[_adam.I_L2] = int(wd != 0 and not grp["decoupled"])
            row_i[_adam.I_DECOUPLED] = int(wd != 0 and grp["decoupled"])
            row_i[_adam.I_CLIP] = int(clip is not None)

    def apply(self, param, exp_avg, exp_avg_sq, max_sq, grad, threads: bool = True) -> None:
        """Run the kernel over this plan's work items (in place); ``threads=False`` keeps
        it on the calling thread."""
        fn = _adam.adam_apply if threads else _adam.adam_apply_serial
        fn(param, exp_avg, exp_avg_sq, max_sq, grad, self.work, self.seg_f, self.seg_i)


def warm_up() -> None:
    """Compile (or load from numba's cache) every replay kernel now, so no JIT happens
    while a worker serves its first iteration."""
    one = np.ones(16, dtype=np.float32)
    segs = segments_for_range([0], [16], [0], 0, 16, "fused", 16, 8)
    adam_group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                  "maximize": False, "decoupled": True}
    plan = ReplayPlan(segs, "fused", 16, "adam")
    plan.prepare([adam_group], np.ones(1), set(), None)
    for threads in (True, False):
        plan.apply(one.copy(), one.copy(), one.copy(), np.zeros(0, np.float32), one, threads=threads)
    plan = ReplayPlan(segs, "fused", 16, "sgd")
    plan.prepare_sgd([{"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                       "maximize": False}], np.zeros(1, dtype=bool), set())
    for threads in (True, False):
        plan.apply_sgd(one.copy(), one.copy(), one, threads=threads)
