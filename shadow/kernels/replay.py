"""Per-range replay plan: which parameter slices a worker owns and their scalars.

Pure helpers (``segments_for_range``, ``adam_scalars``, ``tail_start``) are kept apart
from :class:`ReplayPlan`, which turns a commit record into the kernel's scalar tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from shadow.core.optim_groups import AdamGroup, SgdGroup
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import adam as _adam
from shadow.kernels import adam_columns as _cols
from shadow.kernels import adam_cpu_table as _table
from shadow.kernels import sgd as _sgd
from shadow.kernels.powtab import PowTable

#: torch's CPU implementations, then the same on CUDA (whose kernels round differently)
IMPLS = ("fused", "foreach", "single", "cuda_fused", "cuda_foreach", "cuda_single")
#: the rounding rule of each implementation (``adam_columns.I_RULE``)
RULES = {
    "fused": _cols.RULE_CPU,
    "foreach": _cols.RULE_CPU,
    "single": _cols.RULE_CPU,
    "cuda_fused": _cols.RULE_CUDA_FUSED,
    "cuda_foreach": _cols.RULE_CUDA_FOREACH,
    "cuda_single": _cols.RULE_CUDA_FOREACH,
}
KINDS = ("adam", "sgd")
#: the implementations whose square root is the trainer's library's (a :class:`SqrtTable`)
TABLE_IMPLS = ("single", "foreach")


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
    powers: PowTable | None = None,
) -> tuple[float, ...]:
    """The float32 scalars torch derives (in double) for one Adam step at ``step``.

    Returned in the column order of ``adam_columns.F_*`` except the clip column. CUDA's fused
    kernel computes them in float32 instead (:func:`cuda_fused_scalars`); its
    single-tensor path multiplies by ``1/bc2_sqrt`` (``F_BC2S`` holds the reciprocal).
    """
    if impl == "cuda_fused":
        return cuda_fused_scalars(lr, beta1, beta2, eps, weight_decay, step, powers or PowTable())
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
        f32(1.0 / bc2_sqrt) if impl == "cuda_single" else f32(bc2_sqrt),
        f32(eps),
        f32(-step_size),
        f32(1 - lr * weight_decay),
        f32(weight_decay),
    )


def cuda_fused_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float, powers: PowTable
) -> tuple[float, ...]:
    """CUDA's fused Adam: every hyperparameter and the step count rounded to float32
    first, the bias corrections computed in float32 (``beta ** k`` as the trainer's
    device computes it: ``powers``; ``sqrtf``). Columns as :func:`adam_scalars`:
    ``F_W1`` holds beta1, ``F_NSTEP`` ``-(lr / bc1)``, ``F_DECAY`` ``-(lr * wd)``."""
    f32 = np.float32
    lr32, b1, b2, wd = f32(lr), f32(beta1), f32(beta2), f32(weight_decay)
    one = f32(1.0)
    bc1 = one - powers.pow(b1, step)
    bc2s = f32(np.sqrt(one - powers.pow(b2, step)))
    step_size = f32(lr32 / bc1)
    return (b1, b2, one - b2, bc2s, f32(eps), -step_size, -f32(lr32 * wd), wd)


def exact_reciprocal(x) -> np.float32 | None:
    """``1 / x`` in float32 when it is exact (``x`` a power of two whose reciprocal is
    representable): then ``g * (1 / x)`` and ``g / x`` round alike for every ``g``, both
    being the exact ``g * 2**-k`` rounded once. None otherwise."""
    x = np.float32(x)
    if not np.isfinite(x) or x == 0:
        return None
    mant, _ = np.frexp(x)
    if abs(mant) != 0.5:
        return None
    with np.errstate(over="ignore", under="ignore"):
        r = np.float32(1.0) / x
    if r == 0 or not np.isfinite(r) or r * x != 1:
        return None
    return r


@dataclass(frozen=True)
class Segment:
    """A slice of parameter ``param`` held at local ``[lo, hi)`` of a worker's range."""

    param: int
    group: int
    lo: int
    hi: int
    tail: int  # local index where the fused tail rule starts (>= hi: never)
    start: int = 0  # local index of the parameter's element 0 (negative: it began before the range)


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
    for i, (off, n, g) in enumerate(zip(offsets, numels, groups, strict=True)):
        lo, hi = max(off, start), min(off + n, stop)
        if lo >= hi:
            continue
        out.append(
            Segment(i, g, lo - start, hi - start, off + tail_start(n, impl, vec_width, tail_width) - start, off - start)
        )
    return out


def work_items(segments: Sequence[Segment], chunk: int) -> np.ndarray:
    """Split segments into ``(lo, hi, segment)`` items of at most ``chunk`` elements."""
    rows = []
    for s, seg in enumerate(segments):
        for lo in range(seg.lo, seg.hi, chunk):
            rows.append((lo, min(lo + chunk, seg.hi), s))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def part_work(
    segments: Sequence[Segment], parts: Sequence[tuple[int, int]], chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Work items over gradient *parts* (received payloads, applied where they lie).

    ``parts`` are ``(local_dst, nelem)`` sorted by ``local_dst``; part ``j`` holds the
    gradient of local elements ``[dst, dst + nelem)``. Returns ``(work, covered)``:
    ``work`` int64 ``[n, 5]`` rows ``(lo, hi, segment, part, goff)`` of at most ``chunk``
    elements, ``covered[s]`` the elements of segment ``s`` that some part covers.
    Raises ``ValueError`` when two parts overlap.
    """
    rows, covered = [], np.zeros(len(segments), dtype=np.int64)
    seg_lo = np.asarray([g.lo for g in segments], dtype=np.int64)
    prev_end = None
    for j, (a, n) in enumerate(parts):
        b = a + n
        if prev_end is not None and a < prev_end:
            raise ValueError(f"gradient parts overlap at local element {a}")
        prev_end = b
        s = max(int(np.searchsorted(seg_lo, a, side="right")) - 1, 0)
        while s < len(segments) and segments[s].lo < b:
            lo, hi = max(a, segments[s].lo), min(b, segments[s].hi)
            if lo < hi:
                covered[s] += hi - lo
                for x in range(lo, hi, chunk):
                    rows.append((x, min(x + chunk, hi), s, j, x - a))
            s += 1
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5), covered


def untouched(work: np.ndarray, active: np.ndarray, size: int) -> list[tuple[int, int]]:
    """Local ranges of ``[0, size)`` that no active work row writes (``active`` is per
    segment): what a snapshot folded into the apply pass still has to copy."""
    rows = work[active[work[:, 2]]] if len(work) else work
    rows = rows[np.argsort(rows[:, 0], kind="stable")] if len(rows) else rows
    out, at = [], 0
    for lo, hi in rows[:, :2].tolist() if len(rows) else ():
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < size:
        out.append((at, size))
    return out


def grad_parts(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' view of gradient parts: int64 addresses and lengths (the caller keeps
    the arrays alive while a kernel runs)."""
    addr = np.empty(len(arrays), dtype=np.int64)
    length = np.empty(len(arrays), dtype=np.int64)
    for i, a in enumerate(arrays):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(
                f"gradient part {i} is {a.dtype}, contiguous={a.flags.c_contiguous}; "
                "the kernels read C-contiguous float32"
            )
        addr[i] = a.__array_interface__["data"][0]
        length[i] = a.shape[0]
    return addr, length


_EMPTY = np.zeros(0, dtype=np.float32)


def interleave(work: np.ndarray, threads: int) -> np.ndarray:
    """Work rows reordered for numba's static schedule, which gives thread ``t`` the
    ``t``-th contiguous block of rows: thread ``t`` then runs rows ``t, t + T, t + 2T``
    of the original order, so the threads stream through neighbouring memory together
    (one region of DRAM pages at a time, as torch's per-tensor ``parallel_for`` does)
    instead of ``T`` far-apart regions, and uneven rows spread evenly."""
    n = len(work)
    if threads <= 1 or n <= threads:
        return work
    return work[np.concatenate([np.arange(t, n, threads) for t in range(threads)])]


class ReplayPlan:
    """Scalar tables for one worker range, refreshed per iteration from the commit."""

    def __init__(
        self,
        segments: Sequence[Segment],
        impl: str,
        chunk: int,
        kind: str = "adam",
        powers: PowTable | None = None,
        sqrt: SqrtTable | None = None,
    ) -> None:
        """``sqrt``: the trainer's square root (torch's single-tensor and foreach CPU Adam);
        None: IEEE ``sqrt``."""
        if impl not in IMPLS:
            raise ValueError(f"unknown optimizer implementation {impl!r}; expected one of {IMPLS}")
        if kind not in KINDS:
            raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {KINDS}")
        if sqrt is not None and (kind != "adam" or impl not in TABLE_IMPLS):
            raise ValueError(f"a square root table replays Adam's {TABLE_IMPLS} paths only, not {kind} {impl!r}")
        self.segments = list(segments)
        self.impl, self.kind = impl, kind
        self.powers = powers or PowTable()
        self.sqrt = sqrt
        self.rule = _cols.RULE_CPU_TABLE if sqrt is not None else RULES[impl]
        self.work = work_items(self.segments, chunk)
        self.chunk = chunk
        self.seg_len = np.asarray([g.hi - g.lo for g in self.segments], dtype=np.int64)
        self._parts_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        mod = _cols if kind == "adam" else _sgd
        self.seg_f = np.zeros((len(self.segments), mod.N_FSCALARS), dtype=np.float32)
        self.seg_i = np.zeros((len(self.segments), mod.N_ISCALARS), dtype=np.int64)
        tail_col = _cols.I_TAIL_START if kind == "adam" else _sgd.J_TAIL_START
        for s, seg in enumerate(self.segments):
            self.seg_i[s, tail_col] = seg.tail
            if kind == "adam":
                self.seg_i[s, _cols.I_RULE] = self.rule
                self.seg_i[s, _cols.I_PARAM_START] = seg.start
                self.seg_i[s, _cols.I_RECIP] = int(impl == "cuda_single")

    def prepare_sgd(
        self,
        groups: Sequence[SgdGroup],
        has_state: np.ndarray,
        skipped: set[int],
        clip=None,
        inv_scale=None,
        grad_scale=None,
    ) -> None:
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
            row_i[_sgd.J_NESTEROV] = int(bool(grp.nesterov))
            row_i[_sgd.J_MAXIMIZE] = int(bool(grp.maximize))
            row_i[_sgd.J_MOMENTUM] = int(grp.momentum != 0)
            row_i[_sgd.J_WD] = int(grp.weight_decay != 0)
            row_i[_sgd.J_CLIP] = int(clip is not None)
            row_i[_sgd.J_INV_SCALE] = int(inv_scale is not None)
            row_i[_sgd.J_GRAD_SCALE] = int(grad_scale is not None)

    def apply_sgd(self, param, buf, grad, threads: bool = True) -> None:
        """SGD over a contiguous gradient of the whole range."""
        self.run(_sgd, (param, buf), [(0, grad)], threads=threads)

    def work_for(self, parts: Sequence[tuple[int, np.ndarray]]) -> np.ndarray:
        """Work rows over ``parts`` (sorted ``(local_dst, array)``), cached by their
        geometry (the same every iteration of a run); checks that every active segment
        is covered."""
        key = tuple((dst, len(a)) for dst, a in parts)
        threads = numba.get_num_threads()
        hit = self._parts_cache.get((threads, key))
        if hit is None:
            if len(self._parts_cache) > 16:
                self._parts_cache.clear()
            work, covered = part_work(self.segments, key, self.chunk)
            hit = self._parts_cache[(threads, key)] = (interleave(work, threads), covered)
        work, covered = hit
        active = self.seg_i[:, 0] != 0  # I_ACTIVE and J_ACTIVE are column 0
        short = np.flatnonzero(active & (covered != self.seg_len))
        if len(short):
            seg = self.segments[int(short[0])]
            raise ValueError(
                f"{len(short)} updated parameter slices lack gradient elements (first: parameter "
                f"{seg.param}, {int(covered[short[0]])} of {seg.hi - seg.lo} covered)"
            )
        return work

    def run(
        self, mod, arrays: tuple, parts: Sequence[tuple[int, np.ndarray]], snap: tuple = (), threads: bool = True
    ) -> np.ndarray:
        """Run ``mod``'s kernel (:mod:`adam` with ``(param, exp_avg, exp_avg_sq, max_sq)``,
        :mod:`sgd` with ``(param, momentum_buf)``) with gradients taken from ``parts``
        where they lie; ``snap``: arrays of the same shapes that receive the new values
        too. Returns the work rows used."""
        work = self.work_for(parts)
        arrs = [a for _, a in parts]
        addr, length = grad_parts(arrs)
        snaps = tuple(snap) if snap else (_EMPTY,) * len(arrays)
        if mod is _adam:
            fn = _adam.KERNELS[self.rule][0 if threads else 1]
            sq = (self.sqrt.words, self.sqrt.emap32) if self.sqrt is not None else (_table.NO_TABLE, _table.NO_MAP)
            fn(*arrays, addr, length, work, self.seg_f, self.seg_i, *snaps, *sq)
        else:
            fn = _sgd.sgd_apply if threads else _sgd.sgd_apply_serial
            fn(*arrays, addr, length, work, self.seg_f, self.seg_i, *snaps)
        del arrs  # alive until the kernel returned
        return work

    def prepare(
        self,
        groups: Sequence[AdamGroup],
        steps: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None,
        inv_scale: np.float32 | None = None,
        grad_scale: np.float32 | None = None,
    ) -> None:
        """Fill the tables for one iteration.

        ``groups``: per param group, its settings (:class:`shadow.core.optim_groups.AdamGroup`);
        ``steps``: per-parameter step count *after* this iteration's
        increment; ``skipped``: parameters the optimizer did not step.
        """
        cache: dict[tuple[int, float], tuple[float, ...]] = {}
        rgs = exact_reciprocal(grad_scale) if grad_scale is not None else None
        for s, seg in enumerate(self.segments):
            row_i = self.seg_i[s]
            if seg.param in skipped:
                row_i[_cols.I_ACTIVE] = 0
                continue
            grp = groups[seg.group]
            step = float(steps[seg.param])
            key = (seg.group, step)
            if key not in cache:
                beta1, beta2 = grp.betas
                cache[key] = adam_scalars(
                    self.impl,
                    grp.lr,
                    beta1,
                    beta2,
                    grp.eps,
                    grp.weight_decay,
                    grp.decoupled,
                    step,
                    self.powers,
                )
            sc = cache[key]
            self.seg_f[s, : len(sc)] = sc
            self.seg_f[s, _cols.F_CLIP] = clip if clip is not None else np.float32(1.0)
            self.seg_f[s, _cols.F_INV_SCALE] = inv_scale if inv_scale is not None else np.float32(1.0)
            self.seg_f[s, _cols.F_GRAD_SCALE] = grad_scale if grad_scale is not None else np.float32(1.0)
            self.seg_f[s, _cols.F_RGRAD_SCALE] = rgs if rgs is not None else np.float32(1.0)
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

    def apply(self, param, exp_avg, exp_avg_sq, max_sq, grad, threads: bool = True) -> None:
        """Run the kernel over a contiguous gradient of the whole range (in place);
        ``threads=False`` keeps it on the calling thread."""
        self.run(_adam, (param, exp_avg, exp_avg_sq, max_sq), [(0, grad)], threads=threads)


def warm_up(threads: tuple[bool, ...] = (True,)) -> int:
    """Compile (or load from numba's cache) the replay kernels now, so no JIT happens
    while a worker serves its first iteration: the multi-threaded ones by default (a
    worker's; trainers run the single-threaded ones, ``threads=(False,)``, compiled on
    first use). Returns how many kernels had to be compiled (0: all came from the cache)."""
    one = np.ones(16, dtype=np.float32)
    segs = segments_for_range([0], [16], [0], 0, 16, "fused", 16, 8)
    adam_group = AdamGroup(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, decoupled=True
    )
    table = SqrtTable.build(np.zeros(2 * (1 << 20), dtype=np.uint8), [-1] + [(e - 127) & 1 for e in range(1, 255)])
    for impl, sqrt in (("fused", None), ("cuda_fused", None), ("cuda_foreach", None), ("single", table)):
        plan = ReplayPlan(segs, impl, 16, "adam", sqrt=sqrt)  # one kernel per rounding rule
        plan.prepare([adam_group], np.ones(1), set(), None)
        for t in threads:
            plan.apply(one.copy(), one.copy(), one.copy(), np.zeros(0, np.float32), one, threads=t)
    plan = ReplayPlan(segs, "fused", 16, "sgd")
    plan.prepare_sgd(
        [SgdGroup(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)],
        np.zeros(1, dtype=bool),
        set(),
    )
    for t in threads:
        plan.apply_sgd(one.copy(), one.copy(), one, threads=t)
    pairs = (*_adam.KERNELS.values(), (_sgd.sgd_apply, _sgd.sgd_apply_serial))
    kernels: list[Any] = [pair[0 if t else 1] for pair in pairs for t in threads]  # numba dispatchers
    return sum(len(k.stats.cache_misses) for k in kernels)
