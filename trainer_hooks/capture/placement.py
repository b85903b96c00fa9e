"""Where a DTensor's local tensor lies in its full tensor, from its placements alone.

A parameter sharded by FSDP2, tensor parallelism or both holds, on each rank, a *box* of
the full tensor: one contiguous index range per dimension. Each mesh dimension either
leaves the tensor whole (``Replicate()``) or chunks one tensor dimension as
``torch.chunk`` does (``Shard(d)``: ``ceil(size / n)`` per chunk, the last ones shorter
or empty). Several mesh dimensions may chunk the same tensor dimension: ``Shard``
placements apply left to right, and a ``_StridedShard(d, split_factor=k)`` (FSDP2 over
a tensor-parallel model: ``(_StridedShard(0, sf=tp), Shard(0))``) applies *after* the
shards to its right whose sizes multiply to ``k``, as if the sharding ran right to left.
Chunking the current range at each step is what FSDP2 does to a tensor-parallel local
tensor, so uneven splits (70 rows on tp 2 then dp 2: 18 + 17 and 18 + 17) come out as
FSDP2 holds them.

Pure functions of the global shape, the placements, the mesh's shape and a coordinate:
no collective runs, so a restore (or a worker's split) can compute every rank's box."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shadow.core.errors import ShadowUsageError
from shadow.core.split import Box

try:  # torch's placement for FSDP2 over tensor parallel (private, in every torch with DTensor)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - a torch without it has no such placement to meet
    _StridedShard = ()  # type: ignore[assignment,misc]


def _strided(pl) -> bool:
    return bool(_StridedShard) and isinstance(pl, _StridedShard)


def _dim(pl) -> int:
    """The tensor dimension a ``Shard`` or ``_StridedShard`` chunks."""
    return int(pl.dim)


def check(name: str, p: DTensor) -> None:
    """Every placement of ``p`` is one the shadow places: ``Shard``, ``_StridedShard`` or
    ``Replicate`` (a ``Partial`` parameter has no values of its own to checkpoint)."""
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)) and not _strided(pl):
            raise ShadowUsageError(
                f"parameter {name!r} is placed {tuple(p.placements)}; the shadow checkpoints parameters "
                "placed Shard(d) or Replicate() on each mesh dimension (a Partial parameter is not yet summed): "
                "redistribute it to Replicate() or Shard(d) before attaching"
            )
    _order(name, p.placements, tuple(p.device_mesh.shape))


def _order(name: str, placements: Sequence, mesh_shape: Sequence[int]) -> dict[int, list[int]]:
    """Per tensor dimension, the mesh dimensions that chunk it, in the order they apply."""
    per_dim: dict[int, list[int]] = {}
    for m, pl in enumerate(placements):
        if isinstance(pl, Shard) or _strided(pl):
            per_dim.setdefault(pl.dim, []).append(m)
    return {d: _applied(name, placements, mesh_shape, mesh_dims) for d, mesh_dims in per_dim.items()}


def _applied(name: str, placements: Sequence, mesh_shape: Sequence[int], mesh_dims: list[int]) -> list[int]:
    """The order in which ``mesh_dims`` (those chunking one tensor dimension, in mesh
    order) apply: a ``_StridedShard`` waits for the shards after it that make up its split
    factor."""
    order: list[int] = []
    deferred: list[list[int]] = []  # [mesh dim, factor still to see]
    ready: list[int] = []
    for m in mesh_dims:
        pl = placements[m]
        if _strided(pl) and int(pl.split_factor) > 1:
            deferred.append([m, int(pl.split_factor)])
            continue
        ready.append(m)
        while ready:
            done = ready.pop()
            order.append(done)
            for entry in deferred:
                if entry[0] < done:
                    if entry[1] % mesh_shape[done]:
                        raise ShadowUsageError(
                            f"parameter {name!r} is placed {tuple(placements)}: a _StridedShard's split factor "
                            f"{placements[entry[0]].split_factor} is not a product of the shards after it"
                        )
                    entry[1] //= mesh_shape[done]
            if deferred and deferred[-1][1] == 1:
                ready.append(deferred.pop()[0])
    if deferred:
        raise ShadowUsageError(
            f"parameter {name!r} is placed {tuple(placements)}: a _StridedShard's split factor is not the "
            "product of the shards after it on the same dimension (FSDP2 over tensor parallel places "
            "(_StridedShard(0, sf=tp), Shard(0))); the shadow cannot tell where its rows lie"
        )
    return order


def box(shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int], coord: Sequence[int]) -> Box:
    """The box of a tensor of ``shape`` that the rank at ``coord`` of a mesh of
    ``mesh_shape`` holds under ``placements`` (checked by :func:`check`)."""
    ranges = [(0, int(s)) for s in shape]
    for d, order in _order("", placements, mesh_shape).items():
        lo, hi = ranges[d]
        for m in order:
            n, c = mesh_shape[m], coord[m]
            per = -(-(hi - lo) // n)
            lo, hi = lo + min(hi - lo, c * per), lo + min(hi - lo, (c + 1) * per)
        ranges[d] = (lo, hi)
    return tuple(ranges)


def box_of(p: DTensor) -> Box:
    """This rank's box of DTensor ``p``."""
    coord = p.device_mesh.get_coordinate()
    if coord is None:  # not on the mesh: holds nothing
        return tuple((0, 0) for _ in p.shape)
    return box(tuple(p.shape), p.placements, tuple(p.device_mesh.shape), coord)


def cuts(p: DTensor) -> list[list[int]]:
    """Per dimension of ``p``, the cut points of every rank's chunk (``[0, ..., size]``,
    empty chunks left out): every box any rank holds is one chunk per dimension."""
    shape, mesh_shape = tuple(p.shape), tuple(p.device_mesh.shape)
    out = []
    for d, size in enumerate(shape):
        mesh_dims = [
            m for m, pl in enumerate(p.placements) if (isinstance(pl, Shard) or _strided(pl)) and _dim(pl) == d
        ]
        points = {0, int(size)}
        for combo in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
            coord = [0] * len(mesh_shape)
            for m, c in zip(mesh_dims, combo, strict=True):
                coord[m] = c
            points.update(box(shape, p.placements, mesh_shape, coord)[d])
        out.append(sorted(points))
    return out


def take(full: torch.Tensor, b: Box) -> torch.Tensor:
    """Box ``b`` of ``full`` (a view, shaped as the local tensor)."""
    for d, (lo, hi) in enumerate(b):
        full = full.narrow(d, lo, hi - lo)
    return full
