"""FSDP2 and HSDP models: where this rank's shard of each laid-out parameter lies in the
flat space (:class:`LocalShards`, what ``attach`` streams and bootstraps from and what a
restore copies into), and where each parameter's shard lies in an FSDP group's reduce
output (:func:`fsdp_spans`). docs/fsdp.md has the design.

``FSDPModule.set_all_reduce_hook`` hands a rank one flat buffer per FSDP group and
backward: the group's parameters in order, each a dim-0 padded chunk of
``ceil(rows / shards) * row_numel`` elements of which the rank's own rows come first and
the rest is padding (13 rows on 2 ranks: 7 + 6, the second chunk one row of padding).
:func:`fsdp_spans` computes that placement from public API only (the DTensor parameters'
global shape, placements and mesh), so it can be checked against the buffers FSDP hands
out rather than read from FSDP's private state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shadow.core.errors import ShadowUsageError
from shadow.core.layout import Layout, bucket_runs, stripe_bounds


def is_fsdp(model: torch.nn.Module) -> bool:
    """``model`` is sharded with FSDP2 (``fully_shard``, with or without an HSDP mesh)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """``params`` are FSDP2's (DTensors): each rank holds its rows, on any mesh."""
    return any(isinstance(p, DTensor) for p in params)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local tensor; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class LocalShards:
    """This rank's rows of every laid-out parameter under FSDP2 (``shards`` ranks split
    each parameter on dim 0, ``ceil(rows / shards)`` rows each) or HSDP (``replicas``
    copies of that split; this rank is copy ``replica``).

    ``slots[i]`` is parameter ``i``'s local part as ``(offset in the concatenation of the
    local parts, flat offset of its first element, elements)``: the rows are contiguous in
    the flat space. Under HSDP every replica holds the same shard: each streams its own
    :meth:`stripe` of the concatenation, so every element leaves one rank."""

    shards: int
    replicas: int
    replica: int
    slots: tuple[tuple[int, int, int], ...]
    total: int

    def stripe(self) -> tuple[int, int]:
        """The part ``[lo, hi)`` of the concatenation this rank streams."""
        return stripe_bounds(self.total, self.replicas)[self.replica]

    def runs(self, present: Sequence[bool], workers: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """Per worker, the runs ``(src relative to the stripe, flat dst, n)`` of the stripe,
        over the parameters ``present`` marks (those with a gradient)."""
        stripe = self.stripe()
        slots = [s for s, keep in zip(self.slots, present, strict=True) if keep and s[2]]
        per_worker = bucket_runs(slots, stripe, workers)
        return [[(r.src - stripe[0], r.dst, r.nelem) for r in rs] for rs in per_worker]

    def pieces(self, lo: int, hi: int):
        """``(param index, start in the local part, start in [lo, hi), n)`` of every local
        part that meets ``[lo, hi)`` of the concatenation."""
        for i, (off, _, n) in enumerate(self.slots):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                yield i, a - off, a - lo, b - a


def check_outside_optimizer(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
    """Sharded tensors the optimizer does not hold (a frozen parameter of an FSDP2 model)
    would travel as the model state outside the optimizer, which is rank 0's and whole:
    refused, naming them, with the fix."""
    held = {id(p) for p in params}
    names = [n for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, DTensor) and id(t) not in held]
    if names:
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ShadowUsageError(
            f"the FSDP2 model has sharded tensors the optimizer does not hold ({shown}); the shadow keeps sharded "
            "state through the optimizer only: add them to the optimizer in a param group of their own (a "
            "parameter without a gradient is never stepped)"
        )


class Rows:
    """This rank's rows of full tensors laid out as ``layout`` (a restore into an FSDP2
    model of any mesh: every rank takes its rows of the checkpoint's full tensors)."""

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], shards: LocalShards) -> None:
        self.layout, self.params, self.shards = layout, list(params), shards

    @classmethod
    def of(cls, layout: Layout, params: Sequence[torch.Tensor]) -> Rows | None:
        """None unless ``params`` are DTensors (FSDP2); :class:`ShadowUsageError` when they
        are not placed as FSDP2 places them."""
        if not any(isinstance(p, DTensor) for p in params):
            return None
        return cls(layout, params, local_shards(layout, params))

    def within(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Every one of this rank's rows lies inside ``ranges`` (what a fetch read)."""
        import bisect

        starts = [a for a, _ in ranges]
        for _, flat, n in self.shards.slots:
            if n:
                j = bisect.bisect_right(starts, flat) - 1
                if j < 0 or not ranges[j][0] <= flat < flat + n <= ranges[j][1]:
                    return False
        return True

    def take(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s rows of ``full`` (a tensor of its global shape), shaped as its
        local tensor."""
        spec, (_, flat, n) = self.layout.params[i], self.shards.slots[i]
        start = flat - spec.offset
        return full.reshape(-1)[start : start + n].view(local(self.params[i]).shape)

    def place(self, i: int, full: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """``full`` as a DTensor placed as parameter ``i`` is, holding this rank's rows:
        ``live`` (a DTensor of that placement) filled in place when it is one, else a new one."""
        p, part = self.params[i], self.take(i, full)
        assert isinstance(p, DTensor)  # Rows.of: FSDP2 parameters (local_shards checked each)
        if isinstance(live, DTensor) and live.placements == p.placements and live.shape == p.shape:
            mine = local(live)
            if mine.shape == part.shape:
                mine.copy_(part)
                return live
        mine = part.to(device=local(p).device, dtype=local(p).dtype, copy=True)
        return DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def rows_ranges(layout: Layout, params: Sequence[torch.Tensor]) -> tuple[int, list[tuple[int, int]]] | None:
    """``(layout hash, the flat ranges of this rank's rows)`` of FSDP2 ``params`` (what a
    restore fetches: a fetch from memory reads those only when the checkpoint has this
    layout); None for plain tensors, or parameters not placed as FSDP2 places them (the
    restore then reads everything and says what does not match)."""
    if not any(isinstance(p, DTensor) for p in params):
        return None
    try:
        shards = local_shards(layout, params)
    except ShadowUsageError:
        return None
    out: list[tuple[int, int]] = []
    for _, flat, n in shards.slots:
        if not n:
            continue
        if out and out[-1][1] == flat:
            out[-1] = (out[-1][0], flat + n)
        else:
            out.append((flat, flat + n))
    return layout.hash, out


def _mesh_split(name: str, p: torch.Tensor) -> tuple[int, int, int, int]:
    """``(shards, this rank's shard, replicas, this rank's replica)`` of a DTensor
    parameter placed as FSDP2 places it: ``(Shard(0),)``, or HSDP's ``(Replicate(),
    Shard(0))``."""
    if not isinstance(p, DTensor):
        raise ShadowUsageError(
            f"parameter {name!r} is not sharded (a plain tensor in an FSDP2 model): fully_shard the module "
            "that holds it, or the root module, so every parameter is a DTensor"
        )
    mesh, places = p.device_mesh, p.placements
    shard_dims = [d for d, pl in enumerate(places) if isinstance(pl, Shard)]
    others = [d for d, pl in enumerate(places) if not isinstance(pl, Shard)]
    if (
        len(shard_dims) != 1
        or places[shard_dims[0]] != Shard(0)
        or any(not isinstance(places[d], Replicate) for d in others)
        or len(others) > 1
    ):
        raise ShadowUsageError(
            f"parameter {name!r} is placed {places}; the shadow follows FSDP2's dim-0 sharding, "
            "(Shard(0),), and HSDP's (Replicate(), Shard(0))"
        )
    sd = shard_dims[0]
    if not others:
        return mesh.size(sd), mesh.get_local_rank(sd), 1, 0
    rd = others[0]
    return mesh.size(sd), mesh.get_local_rank(sd), mesh.size(rd), mesh.get_local_rank(rd)


def local_shards(layout: Layout, params: Sequence[torch.Tensor]) -> LocalShards:
    """Where this rank's rows of each parameter of ``layout`` lie (``params``: the
    optimizer's DTensor parameters in layout order). Every parameter must be split the
    same way (one mesh shape); anything else is a :class:`ShadowUsageError` naming it."""
    split = None
    slots, at = [], 0
    for spec, p in zip(layout.params, params, strict=True):
        mine = _mesh_split(spec.name, p)
        if split is None:
            split = mine
        elif (mine[0], mine[2]) != (split[0], split[2]):
            raise ShadowUsageError(
                f"parameter {spec.name!r} is split over {mine[0]} ranks with {mine[2]} replicas, the first "
                f"over {split[0]} with {split[2]}; the shadow needs one mesh for the whole model"
            )
        shards, rank = mine[0], mine[1]
        rows = spec.shape[0] if spec.shape else 1
        row = spec.numel // rows if rows else 0
        per = -(-rows // shards)
        lo, hi = min(rows, rank * per), min(rows, (rank + 1) * per)
        n = (hi - lo) * row
        if local(p).numel() != n:
            raise ShadowUsageError(
                f"parameter {spec.name!r}: this rank holds {local(p).numel()} elements, FSDP2's dim-0 split "
                f"over {shards} ranks gives it {n}"
            )
        slots.append((at, spec.offset + lo * row, n))
        at += n
    assert split is not None  # a layout has parameters
    return LocalShards(split[0], split[2], split[3], tuple(slots), at)


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
