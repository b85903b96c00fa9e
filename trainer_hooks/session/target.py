"""What one attachment streams: the DDP (or FSDP2) model and its optimizer as laid out in
the flat space when it attached (a new one with every attach: ``add_param_group`` changes
it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shadow.core.layout import Layout
from trainer_hooks.capture import fsdp as _fsdp
from trainer_hooks.capture.model import build_layout, state_dict_aliases
from trainer_hooks.optim import describe as _optim
from trainer_hooks.session import device


@dataclass(frozen=True)
class Target:
    """The model, the optimizer and what was derived from them at attach (never changed)."""

    model: torch.nn.Module  # DistributedDataParallel, or an FSDP2 root module
    optimizer: torch.optim.Optimizer
    pg: Any  # the model's process group (FSDP2: the default group)
    rank: int
    world: int
    layout: Layout
    params: list  # the optimizer's parameters, in layout order
    index: dict[int, int]  # id(param) -> its position in ``params``
    aliases: dict[str, str]  # tied weights: state-dict name -> the laid-out name
    device: torch.device  # the one device of ``params``
    optim_desc: dict  # the replay descriptor (``_optim.describe``)
    views: bool  # DDP's ``gradient_as_bucket_view``: the gradients are the buckets
    fsdp: _fsdp.LocalShards | None = None  # FSDP2/HSDP: this rank's rows of each parameter

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, exact: bool) -> Target:
        """Lay out ``optimizer``'s parameters, find their device and describe the optimizer
        for the replay (``exact``: refuse one the replay cannot match bit for bit)."""
        layout, params = build_layout(model, optimizer)
        dev = device.device_of(layout, params)
        desc = _optim.describe(optimizer, exact=exact)
        shards = None
        if isinstance(model, DistributedDataParallel):
            pg = model.process_group
        else:  # an FSDP2 root (Session checked it): each rank streams its own rows
            pg = None
            shards = _fsdp.local_shards(layout, params)
            _fsdp.check_outside_optimizer(model, params)
            desc = dict(desc, dim0_shards=shards.shards)  # the optimizer steps each rank's rows as a tensor
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
        )
