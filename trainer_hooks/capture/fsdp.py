"""Sharded models (FSDP2, HSDP, tensor parallel, and FSDP2 over tensor parallel): where
this rank's part of each laid-out parameter lies in the flat space (:class:`LocalShards`,
what ``attach`` streams and bootstraps from; :class:`Rows`, what a restore copies into),
and where each parameter's shard lies in an FSDP group's reduce output
(:func:`fsdp_spans`). docs/fsdp.md has the design.

Every parameter is a DTensor whose local tensor is a *box* of the full tensor
(:mod:`trainer_hooks.capture.placement`). The ranks that hold the same box (replicas: a
``Replicate()`` mesh dimension, HSDP's, or tensor parallel's for a norm) each stream their
own stripe of it, so every element leaves one rank.

``FSDPModule.set_all_reduce_hook`` hands a rank one flat buffer per FSDP group and
backward: the group's parameters in order, each a dim-0 padded chunk of
``ceil(rows / shards) * row_numel`` elements of which the rank's own rows come first and
the rest is padding (13 rows on 2 ranks: 7 + 6, the second chunk one row of padding).
:func:`fsdp_spans` computes that placement from public API only (the DTensor parameters'
global shape, placements and mesh), so it can be checked against the buffers FSDP hands
out rather than read from FSDP's private state."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shadow.core.errors import ShadowUsageError
from shadow.core.layout import Layout, stripe_bounds
from shadow.core.split import Box, box_numel, box_runs
from trainer_hooks.capture import placement as _placement
from trainer_hooks.capture.stages import Stages, gather_device

#: the most flat ranges a restore asks of the cluster's memory (``shadow.transport.fetch``'s bound)
MAX_RANGES = 1 << 16


def is_fsdp(model: torch.nn.Module) -> bool:
    """``model`` is sharded with FSDP2 (``fully_shard``, with or without an HSDP mesh)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """``model`` holds DTensor parameters: FSDP2 (``fully_shard``), tensor parallel
    (``parallelize_module``), or both."""
    return is_fsdp(model) or any(isinstance(p, DTensor) for p in model.parameters())


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """``params`` are DTensors: each rank holds a box of each, on any mesh."""
    return any(isinstance(p, DTensor) for p in params)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local tensor; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def boxes(layout: Layout, params: Sequence[torch.Tensor], plain: bool = False) -> list[Box]:
    """This rank's box of each parameter of ``layout`` (``params``: the optimizer's DTensor
    parameters in layout order), checked against its local tensor; anything the shadow
    cannot place is a :class:`ShadowUsageError` naming the parameter and the fix.
    ``plain``: a plain tensor is whole (a pipeline stage's, without data parallelism)."""
    out = []
    for spec, p in zip(layout.params, params, strict=True):
        if plain and not isinstance(p, DTensor):
            out.append(tuple((0, int(n)) for n in spec.shape))
            continue
        if not isinstance(p, DTensor):
            raise ShadowUsageError(
                f"parameter {spec.name!r} is a plain tensor in a model of DTensors: fully_shard the module that "
                "holds it (or the root module), or place it with parallelize_module or distribute_tensor "
                "(Replicate() where it is not split), so every parameter is a DTensor"
            )
        _placement.check(spec.name, p)
        b = _placement.box_of(p)
        mine = local(p)
        if tuple(mine.shape) != tuple(hi - lo for lo, hi in b):
            raise ShadowUsageError(
                f"parameter {spec.name!r}: this rank holds a local tensor of shape {list(mine.shape)}, its "
                f"placements {tuple(p.placements)} on a mesh of {tuple(p.device_mesh.shape)} give "
                f"{[hi - lo for lo, hi in b]}"
            )
        out.append(b)
    return out


def replicas(layout: Layout, mine: Sequence[Box], stages: Stages | None = None) -> list[tuple[int, int]]:
    """Per parameter, ``(ranks holding this rank's box, this rank's index among them)``
    over the default group: one all-gather of every rank's boxes, each at its parameter's
    index in the whole model (``stages``: this rank holds a pipeline stage's part). Without
    stages every rank must lay out the same model, else a :class:`ShadowUsageError` on all."""
    world, me = dist.get_world_size(), dist.get_rank()
    dev = gather_device()
    whole, first = (layout, 0) if stages is None else (stages.layout, stages.param0)
    h = whole.hash
    head = torch.tensor([h & 0xFFFFFFFF, h >> 32, len(whole.params)], dtype=torch.int64, device=dev)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head)
    if any(not torch.equal(x, heads[0]) for x in heads):
        raise ShadowUsageError(
            "the ranks lay out different models (another set of parameters, shapes or param groups): under "
            "FSDP2 and tensor parallelism every rank's optimizer holds every parameter, as a DTensor"
        )
    width = 2 * max((len(p.shape) for p in whole.params), default=0) or 1
    flat = torch.full((len(whole.params), width), -2, dtype=torch.int64)  # -2: a parameter this rank does not hold
    for i, b in enumerate(mine):
        flat[first + i, : 2 * len(b)] = -1
        for d, (lo, hi) in enumerate(b):
            flat[first + i, 2 * d], flat[first + i, 2 * d + 1] = lo, hi
    flat = flat.to(dev)
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    stacked = torch.stack([x.cpu() for x in every])  # [rank, param, bounds]
    out = []
    for i in range(first, first + len(mine)):
        same = (stacked[:, i, :] == stacked[me, i, :]).all(dim=1).nonzero().flatten().tolist()
        out.append((len(same), same.index(me)))
    return out


@dataclass(frozen=True)
class LocalShards:
    """What this rank streams of a sharded model: per parameter, a stripe of its local
    tensor (all of it unless other ranks hold the same box: then the ``replicas`` split
    it, 1024-element aligned), laid end to end in a *stream*.

    ``slots[i]`` is parameter ``i``'s stripe as ``(offset in the stream, start in the
    local tensor, elements)``; ``flat`` lists the stream's runs in the flat space as rows
    ``(parameter, offset in the stream, flat offset, elements)`` (one per row of a box
    that cuts its last dimension). ``split`` is every rank's boxes, for the optimizer's
    descriptor (:func:`shadow.core.split.replay_runs`)."""

    boxes: tuple[Box, ...]
    slots: tuple[tuple[int, int, int], ...]
    flat: np.ndarray
    total: int
    split: list
    replicas: tuple[int, ...]

    def stripe(self) -> tuple[int, int]:
        """The part ``[lo, hi)`` of the stream this rank sends: all of it."""
        return 0, self.total

    def runs(self, present: Sequence[bool], workers: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """Per worker, the runs ``(src in the stream, flat dst, n)`` of the stream over the
        parameters ``present`` marks (those with a gradient)."""
        keep = np.asarray(present, dtype=bool)[self.flat[:, 0]] if len(self.flat) else np.zeros(0, dtype=bool)
        rows = self.flat[keep]
        return [_cut(rows, a, b) for a, b in workers]

    def pieces(self, lo: int, hi: int):
        """``(param index, start in the local tensor, start in [lo, hi), n)`` of every
        stripe that meets ``[lo, hi)`` of the stream."""
        for i, (off, start, n) in enumerate(self.slots):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                yield i, start + a - off, a - lo, b - a


def _cut(rows: np.ndarray, a: int, b: int) -> list[tuple[int, int, int]]:
    """The runs ``(src, dst, n)`` of ``rows`` (``(param, src, dst, n)``, in order) inside
    flat ``[a, b)``, neighbours in both merged."""
    if not len(rows):
        return []
    src, dst, n = rows[:, 1], rows[:, 2], rows[:, 3]
    lo, hi = np.maximum(dst, a), np.minimum(dst + n, b)
    keep = lo < hi
    src, lo, hi = (src + lo - dst)[keep], lo[keep], hi[keep]
    if not len(lo):
        return []
    joins = np.zeros(len(lo), dtype=bool)
    joins[1:] = (src[:-1] + hi[:-1] - lo[:-1] == src[1:]) & (hi[:-1] == lo[1:])
    first = np.flatnonzero(~joins)
    last = np.append(first[1:] - 1, len(lo) - 1)
    return list(zip(src[first].tolist(), lo[first].tolist(), (hi[last] - lo[first]).tolist(), strict=True))


def split_of(params: Sequence[torch.Tensor]) -> list:
    """Every rank's boxes of ``params`` as a split (``shadow.core.split``): per DTensor
    parameter chunked somewhere, its index and the cut points of each dimension."""
    split = []
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            cuts = _placement.cuts(p)
            if any(len(c) > 2 for c in cuts):
                split.append([i, cuts])
    return split


def local_shards(layout: Layout, params: Sequence[torch.Tensor], stages: Stages | None = None) -> LocalShards:
    """What this rank streams of DTensor ``params`` (the optimizer's, in layout order; with
    ``stages``, a pipeline stage's, plain tensors whole): a collective over the default
    group (:func:`replicas`). Flat offsets and the split are the whole model's."""
    mine = boxes(layout, params, plain=stages is not None)
    reps = replicas(layout, mine, stages)
    shift = 0 if stages is None else stages.offset
    slots, rows, at = [], [], 0
    for i, (spec, b, (k, r)) in enumerate(zip(layout.params, mine, reps, strict=True)):
        n = box_numel(b)
        lo, hi = stripe_bounds(n, k)[r] if n else (0, 0)
        slots.append((at, lo, hi - lo))
        if hi > lo:
            starts, lens = box_runs(spec.shape, spec.offset, b)
            local_at = np.concatenate(([0], np.cumsum(lens)[:-1]))
            a, z = np.maximum(local_at, lo), np.minimum(local_at + lens, hi)
            keep = a < z
            part = np.empty((int(keep.sum()), 4), dtype=np.int64)
            part[:, 0], part[:, 1] = i, at + a[keep] - lo
            part[:, 2], part[:, 3] = starts[keep] + a[keep] - local_at[keep] + shift, z[keep] - a[keep]
            rows.append(part)
        at += hi - lo
    split = split_of(params) if stages is None else stages.split
    flat = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64)
    return LocalShards(tuple(mine), tuple(slots), flat, at, split, tuple(k for k, _ in reps))


def align_grads(params: Sequence[torch.Tensor]) -> None:
    """Place each DTensor gradient as its parameter is, in place of ``p.grad``: a norm's
    gradient under ``SequenceParallel`` is ``Partial()``, a row-wise embedding's is
    ``Replicate()``, and the optimizer's DTensor ops would redistribute them to the
    parameter's placements themselves (an all-reduce for ``Partial``). Done here once, the
    optimizer reads the same values without redistributing again, and the local tensors
    the shadow streams are the ones it steps with. A collective: every rank calls it, at
    every step, in the same order."""
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def check_outside_optimizer(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
    """Sharded tensors the optimizer does not hold (a frozen parameter of an FSDP2 model)
    would travel as the model state outside the optimizer, which is rank 0's and whole:
    refused, naming them, with the fix."""
    held = {id(p) for p in params}
    names = [n for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, DTensor) and id(t) not in held]
    if names:
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ShadowUsageError(
            f"the model has sharded tensors the optimizer does not hold ({shown}); the shadow keeps sharded "
            "state through the optimizer only: add them to the optimizer in a param group of their own (a "
            "parameter without a gradient is never stepped)"
        )


class Rows:
    """This rank's boxes of full tensors laid out as ``layout`` (a restore into a sharded
    model of any mesh: every rank takes its boxes of the checkpoint's full tensors)."""

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], mine: Sequence[Box]) -> None:
        self.layout, self.params, self.boxes = layout, list(params), list(mine)

    @classmethod
    def of(cls, layout: Layout, params: Sequence[torch.Tensor]) -> Rows | None:
        """None unless ``params`` are DTensors; :class:`ShadowUsageError` when one is
        placed as the shadow cannot place it."""
        if not is_sharded(params):
            return None
        return cls(layout, params, boxes(layout, params))

    def ranges(self) -> list[tuple[int, int]]:
        """The flat ranges of this rank's boxes, in order, neighbours merged."""
        out: list[tuple[int, int]] = []
        for spec, b in zip(self.layout.params, self.boxes, strict=True):
            starts, lens = box_runs(spec.shape, spec.offset, b)
            for a, n in zip(starts.tolist(), lens.tolist(), strict=True):
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], a + n)
                else:
                    out.append((a, a + n))
        return out

    def within(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Every one of this rank's elements lies inside ``ranges`` (what a fetch read)."""
        starts = [a for a, _ in ranges]
        for a, b in self.ranges():
            j = bisect.bisect_right(starts, a) - 1
            if j < 0 or not ranges[j][0] <= a < b <= ranges[j][1]:
                return False
        return True

    def take(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s box of ``full`` (a tensor of its global shape), shaped as its
        local tensor."""
        return _placement.take(full.reshape(self.layout.params[i].shape), self.boxes[i])

    def place(self, i: int, full: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """``full`` as a DTensor placed as parameter ``i`` is, holding this rank's box:
        ``live`` (a DTensor of that placement) filled in place when it is one, else a new one."""
        p, part = self.params[i], self.take(i, full)
        assert isinstance(p, DTensor)  # Rows.of: DTensor parameters (boxes checked each)
        if isinstance(live, DTensor) and live.placements == p.placements and live.shape == p.shape:
            mine = local(live)
            if mine.shape == part.shape:
                mine.copy_(part)
                return live
        mine = part.to(device=local(p).device, dtype=local(p).dtype, copy=True).contiguous()
        return DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def rows_ranges(layout: Layout, params: Sequence[torch.Tensor]) -> tuple[int, list[tuple[int, int]]] | None:
    """``(layout hash, the flat ranges of this rank's boxes)`` of DTensor ``params`` (what
    a restore fetches: a fetch from memory reads those only when the checkpoint has this
    layout; beyond :data:`MAX_RANGES` ranges, each parameter's span instead); None for
    plain tensors, or parameters the shadow cannot place (the restore then reads
    everything and says what does not match)."""
    if not is_sharded(params):
        return None
    try:
        rows = Rows.of(layout, params)
    except ShadowUsageError:
        return None
    assert rows is not None
    out = rows.ranges()
    if len(out) > MAX_RANGES:
        spans: list[tuple[int, int]] = []
        for spec, b in zip(layout.params, rows.boxes, strict=True):
            starts, lens = box_runs(spec.shape, spec.offset, b)
            if len(starts):
                a, z = int(starts[0]), int(starts[-1] + lens[-1])
                spans[-1:] = [(spans[-1][0], z)] if spans and spans[-1][1] == a else spans[-1:] + [(a, z)]
        out = spans
    if len(out) > MAX_RANGES:
        return None
    return layout.hash, out


@dataclass(frozen=True)
class ShardSpan:
    """One parameter's shard on this rank: ``fqn``; its FSDP group (``group``, the index
    of its ``fully_shard``ed module in ``model.modules()`` order); its chunk in that group's
    reduce output (``offset``, ``padded`` elements, of which the first ``numel`` are this
    rank's rows); and ``global_offset``, where those rows start in the full parameter,
    flattened row-major."""

    fqn: str
    group: int
    offset: int
    numel: int
    padded: int
    global_offset: int


def fsdp_groups(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]]:
    """The FSDP groups of ``model``: each ``fully_shard``ed module that manages parameters
    of its own (those of no nested ``fully_shard``ed module), with its name and those
    parameters by fully qualified name, in ``model.modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    sharded = {id(m) for m in model.modules() if isinstance(m, FSDPModule)}
    groups = []
    for name, module in model.named_modules():
        if id(module) not in sharded:
            continue
        own = []
        for pname, p in _own_parameters(module, sharded):
            own.append((f"{name}.{pname}" if name else pname, p))
        if own:
            groups.append((name, module, own))
    return groups


def _own_parameters(module: torch.nn.Module, sharded: set[int]):
    """``module``'s parameters that no nested ``fully_shard``ed module manages, in
    ``named_parameters`` order (shared parameters once)."""
    seen: set[int] = set()

    def walk(m: torch.nn.Module, prefix: str):
        for n, p in m.named_parameters(recurse=False):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield (f"{prefix}{n}", p)
        for cn, child in m.named_children():
            if id(child) in sharded:
                continue
            yield from walk(child, f"{prefix}{cn}.")

    yield from walk(module, "")


def fsdp_spans(model: torch.nn.Module) -> list[list[ShardSpan]]:
    """Per FSDP group (:func:`fsdp_groups`), where each parameter's shard lies in the
    group's reduce output on this rank. Only dim-0 sharding (``Shard(0)``, FSDP2's default,
    with or without an HSDP replicate dimension) is placed; anything else is a
    ``ValueError`` naming the parameter."""
    out = []
    for gi, (_, _, params) in enumerate(fsdp_groups(model)):
        spans, offset = [], 0
        for fqn, p in params:
            shards, rank = _shard_dim(fqn, p)
            rows = p.shape[0] if p.dim() else 1
            row_numel = p.numel() // rows if rows else 0
            per_rank = -(-rows // shards)  # dim 0 padded to a multiple of the shard count
            mine = max(0, min(rows, (rank + 1) * per_rank) - rank * per_rank)
            padded = per_rank * row_numel
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.numel() != mine * row_numel:
                raise ValueError(
                    f"{fqn}: this rank holds {local.numel()} elements, dim-0 sharding over {shards} gives "
                    f"{mine * row_numel}"
                )
            spans.append(ShardSpan(fqn, gi, offset, mine * row_numel, padded, rank * per_rank * row_numel))
            offset += padded
        out.append(spans)
    return out


def _shard_dim(fqn: str, p: torch.Tensor) -> tuple[int, int]:
    """(how many shards, this rank's index among them) of a parameter sharded on dim 0."""
    if not isinstance(p, DTensor):
        return 1, 0
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if not dims:
        return 1, 0
    if len(dims) > 1 or p.placements[dims[0]] != Shard(0):
        raise ValueError(f"{fqn}: placements {p.placements} are not FSDP2's dim-0 sharding")
    mesh = p.device_mesh
    return mesh.size(dims[0]), mesh.get_local_rank(dims[0])
