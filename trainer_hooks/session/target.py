"""What one attachment streams: the DDP (or sharded: FSDP2, tensor parallel) model and its
optimizer as laid out in the flat space when it attached (a new one with every attach:
``add_param_group`` changes it)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shadow.core.layout import Layout
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.capture import stages as _stages
from trainer_hooks.capture.model import build_layout, state_dict_aliases
from trainer_hooks.optim import describe as _optim
from trainer_hooks.session import device


@dataclass(frozen=True)
class Target:
    """The model, the optimizer and what was derived from them at attach (never changed)."""

    model: torch.nn.Module  # DistributedDataParallel, or a model of DTensors (FSDP2, tensor parallel)
    optimizer: torch.optim.Optimizer
    pg: Any  # the model's process group (sharded: the default group)
    rank: int
    world: int
    layout: Layout
    params: list  # the optimizer's parameters, in layout order
    index: dict[int, int]  # id(param) -> its position in ``params``
    aliases: dict[str, str]  # tied weights: state-dict name -> the laid-out name
    device: torch.device  # the one device of ``params``
    optim_desc: dict  # the replay descriptor (``_optim.describe``)
    views: bool  # DDP's ``gradient_as_bucket_view``: the gradients are the buckets
    fsdp: _fsdp.LocalShards | None = None  # sharded: what this rank streams of each parameter
    stages: _stages.Stages | None = None  # pipeline stages: the whole model, and this rank's part of it

    @property
    def wire_layout(self) -> Layout:
        """The layout the cluster holds: the whole model's (every pipeline stage's)."""
        return self.layout if self.stages is None else self.stages.layout

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, exact: bool) -> Target:
        """Lay out ``optimizer``'s parameters, find their device and describe the optimizer
        for the replay (``exact``: refuse one the replay cannot match bit for bit)."""
        layout, params = build_layout(model, optimizer)
        dev = device.device_of(layout, params)
        desc = _optim.describe(optimizer, exact=exact)
        shards, stages = None, None
        if isinstance(model, DistributedDataParallel):
            pg = model.process_group
        else:  # a model of DTensors, or a pipeline stage: each rank streams its own boxes
            pg = None
            stages, shards = _shards(model, layout, params, optimizer, desc)
            _fsdp.check_outside_optimizer(model, params)
            if shards.split:  # the optimizer steps each rank's box as a tensor
                desc = dict(desc, split=shards.split)
        return cls(
            model=model,
            optimizer=optimizer,
            pg=pg,
            rank=dist.get_rank(pg),
            world=dist.get_world_size(pg),
            layout=layout,
            params=params,
            index={id(p): i for i, p in enumerate(params)},
            aliases=state_dict_aliases(model),
            device=dev,
            optim_desc=desc,
            views=bool(getattr(model, "gradient_as_bucket_view", False)),
            fsdp=shards,
            stages=stages,
        )


#: per optimizer, the last layout's stages and :class:`~trainer_hooks.capture.fsdp.LocalShards`
#: (a resync re-attaches with the same ones, without a collective)
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shards(
    model: torch.nn.Module, layout: Layout, params: list, optimizer: torch.optim.Optimizer, desc: dict
) -> tuple[_stages.Stages | None, _fsdp.LocalShards]:
    """The pipeline stages (None: every rank holds the whole model) and what this rank
    streams of ``params``: computed once per layout (collectives over the default group,
    which every rank runs at attach), then kept."""
    key = (layout.hash, tuple(id(p) for p in params))
    known = _SHARDS.get(optimizer)
    if known is not None and known[0] == key:
        return known[1]
    stages = _stages.gather(layout, _fsdp.split_of(params), desc)
    if stages is None and not _fsdp.is_sharded(params):
        raise TypeError(
            "attach() takes the DistributedDataParallel-wrapped model (the shadow streams DDP's reduced gradient "
            "buckets), a model of DTensors (FSDP2's fully_shard, tensor parallel's parallelize_module, or both) or "
            f"a pipeline stage's module; got a {type(model).__name__} that every rank holds whole: wrap it in DDP"
        )
    shards = _fsdp.local_shards(layout, params, stages)
    _SHARDS[optimizer] = (key, (stages, shards))
    return stages, shards
