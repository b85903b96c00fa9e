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

from shadow.core import optimizers
from shadow.core.sqrttab import SqrtTable
from shadow.kernels.powtab import PowTable

#: torch's CPU implementations, then the same on CUDA (whose kernels round differently)
IMPLS = ("fused", "foreach", "single", "cuda_fused", "cuda_foreach", "cuda_single")


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

    Returned in the column order of ``adam.F_*`` except the clip column. CUDA's fused
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


def segments_for_runs(
    runs: np.ndarray,
    groups: Sequence[int],
    start: int,
    stop: int,
    impl: str,
    vec_width: int,
    tail_width: int,
) -> list[Segment]:
    """The segments of ``[start, stop)`` over replay runs (``shadow.core.split.replay_runs``:
    rows ``(flat, n, param, origin, tensor elements)`` in flat order; ``groups[param]`` is
    each parameter's group). Neighbouring runs of one parameter become one segment when
    the kernels cannot tell them apart: none takes the fused tail rule, and (CUDA's fused
    kernel, whose L2 rule reads them) their tensors' element indices agree modulo 4, so
    a parameter split by rows (``Shard(1)``) replays in one pass, not one per row."""
    if not len(runs):
        return []
    flat, n, param, origin, numel = (runs[:, k] for k in range(5))
    lo, hi = np.maximum(flat, start), np.minimum(flat + n, stop)
    keep = lo < hi
    lo, hi, param, origin, numel = lo[keep], hi[keep], param[keep], origin[keep], numel[keep]
    if not len(lo):
        return []
    if impl == "fused":
        rem = numel % vec_width
        tail = origin + numel - rem + (rem // tail_width) * tail_width
    else:
        tail = origin + numel
    plain = tail >= hi
    joins = np.zeros(len(lo), dtype=bool)
    joins[1:] = (hi[:-1] == lo[1:]) & (param[:-1] == param[1:]) & plain[:-1] & plain[1:]
    if impl == "cuda_fused":
        joins[1:] &= (origin[1:] - origin[:-1]) % 4 == 0
    first = np.flatnonzero(~joins)
    last = np.append(first[1:] - 1, len(lo) - 1)
    return [
        Segment(
            int(param[a]),
            int(groups[param[a]]),
            int(lo[a] - start),
            int(hi[b] - start),
            int(tail[b] - start),
            int(origin[a] - start),
        )
        for a, b in zip(first.tolist(), last.tolist(), strict=True)
    ]


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
    """Scalar tables for one worker range, refreshed per iteration from the commit; the
    optimizer's :class:`~shadow.kernels.base.KernelSet` (from its spec in
    :mod:`shadow.core.optimizers`) sizes and fills them and runs its kernel."""

    def __init__(
        self,
        segments: Sequence[Segment],
        impl: str,
        chunk: int,
        kind: str = optimizers.ADAM.kind,
        powers: PowTable | None = None,
        sqrt: SqrtTable | None = None,
    ) -> None:
        """``kind``: the descriptor's optimizer kind; ``sqrt``: the trainer's square root
        (the implementations its spec lists in ``sqrt_impls``); None: IEEE ``sqrt``."""
        if impl not in IMPLS:
            raise ValueError(f"unknown optimizer implementation {impl!r}; expected one of {IMPLS}")
        if kind not in optimizers.SPECS:
            raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {optimizers.kinds()}")
        spec = optimizers.spec(kind)
        if sqrt is not None and impl not in spec.sqrt_impls:
            raise ValueError(
                f"a square root table replays {spec.label}'s {spec.sqrt_impls} paths only, not {kind} {impl!r}"
            )
        self.segments = list(segments)
        self.impl, self.kind, self.spec = impl, kind, spec
        self.powers = powers or PowTable()
        self.sqrt = sqrt
        self.kernels = spec.kernels()  # a shadow.kernels.base.KernelSet
        self.rule = self.kernels.rule(impl, sqrt)
        self.work = work_items(self.segments, chunk)
        self.chunk = chunk
        self.seg_len = np.asarray([g.hi - g.lo for g in self.segments], dtype=np.int64)
        self._parts_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.seg_f = np.zeros((len(self.segments), self.kernels.n_f), dtype=np.float32)
        self.seg_i = np.zeros((len(self.segments), self.kernels.n_i), dtype=np.int64)
        self.kernels.setup(self)

    def fill(
        self,
        groups: Sequence[Any],
        steps: np.ndarray,
        has_state: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None = None,
        inv_scale: np.float32 | None = None,
        grad_scale: np.float32 | None = None,
    ) -> None:
        """Fill the tables for one iteration. ``groups``: per param group, its settings
        (the spec's group type); ``steps``: per-parameter step count *after* this
        iteration's increment; ``has_state``: per parameter, whether it had state before
        it; ``skipped``: parameters the optimizer did not step."""
        self.kernels.fill(self, groups, steps, has_state, skipped, clip, inv_scale, grad_scale)

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
        self, arrays: tuple, parts: Sequence[tuple[int, np.ndarray]], snap: tuple = (), threads: bool = True
    ) -> np.ndarray:
        """Run the kernel on ``arrays`` (the spec's fields in order: PARAM, then its slots;
        one not kept is empty) with gradients taken from ``parts`` where they lie;
        ``snap``: arrays of the same shapes that receive the new values too. Returns the
        work rows used."""
        work = self.work_for(parts)
        arrs = [a for _, a in parts]
        addr, length = grad_parts(arrs)
        snaps = tuple(snap) if snap else (_EMPTY,) * len(arrays)
        self.kernels.run(self, tuple(arrays), addr, length, work, snaps, threads)
        del arrs  # alive until the kernel returned
        return work

    def prepare(
        self,
        groups: Sequence[Any],
        steps: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None,
        inv_scale: np.float32 | None = None,
        grad_scale: np.float32 | None = None,
    ) -> None:
        """:meth:`fill` of an optimizer whose state follows the step counts alone."""
        self.fill(groups, steps, np.ones(len(steps), dtype=bool), skipped, clip, inv_scale, grad_scale)

    def apply(self, *arrays_grad: np.ndarray, threads: bool = True) -> None:
        """Run the kernel over a contiguous gradient of the whole range (in place): the
        arrays as for :meth:`run`, then the gradient; ``threads=False`` keeps it on the
        calling thread."""
        *arrays, grad = arrays_grad
        self.run(tuple(arrays), [(0, grad)], threads=threads)


def warm_up(threads: tuple[bool, ...] = (True,)) -> int:
    """Compile (or load from numba's cache) every optimizer's replay kernels now, so no
    JIT happens while a worker serves its first iteration: the multi-threaded ones by
    default (a worker's; trainers run the single-threaded ones, ``threads=(False,)``,
    compiled on first use). Returns how many kernels had to be compiled (0: all came from
    the cache)."""
    kernels: list[Any] = []  # numba dispatchers
    for spec in optimizers.SPECS.values():
        kernels += spec.kernels().warm_up(threads)
    return sum(len(k.stats.cache_misses) for k in kernels)
