"""Where each parameter's shard lies in an FSDP2 group's reduce output (issue 40's first
step; ``attach`` does not take FSDP2 models yet: docs/fsdp.md).

``FSDPModule.set_all_reduce_hook`` hands a rank one flat buffer per FSDP group and
backward: the group's parameters in order, each a dim-0 padded chunk of
``ceil(rows / shards) * row_numel`` elements of which the rank's own rows come first and
the rest is padding (13 rows on 2 ranks: 7 + 6, the second chunk one row of padding).
:func:`fsdp_spans` computes that placement from public API only (the DTensor parameters'
global shape, placements and mesh), so it can be checked against the buffers FSDP hands
out rather than read from FSDP's private state."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard


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
