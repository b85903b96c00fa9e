"""The trainer's view of the canonical layout: optimizer parameters, their names in the
model (DDP-wrapped or not) and tied-weight aliases (the rest of the model's state is
``_extras``')."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from shadow.core.layout import Layout


class LayoutError(ValueError):
    """The model/optimizer cannot be laid out, or does not match a checkpoint."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def build_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Layout, list]:
    """Layout of ``optimizer``'s parameters, named as in ``model`` (without ``module.``)."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    entries: list[tuple[str, tuple[int, ...], int, bool]] = []  # (name, shape, group, requires_grad)
    params: list[torch.nn.Parameter] = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise LayoutError(
                    f"parameter {names.get(id(p), '?')!r} is {p.dtype}; the shadow replays fp32 parameters only "
                    "(keep fp32 master weights and use autocast for mixed precision)"
                )
            if p.is_sparse or not p.is_contiguous():
                raise LayoutError(f"parameter {names.get(id(p), '?')!r} is sparse or non-contiguous; not supported")
            name = names.get(id(p))
            if name is None:
                raise LayoutError(
                    f"optimizer parameter {len(params)} (shape {list(p.shape)}) is not a parameter of the model; "
                    "pass the model whose parameters the optimizer trains"
                )
            entries.append((name, tuple(p.shape), gi, bool(p.requires_grad)))
            params.append(p)
    if not params:
        raise LayoutError("the optimizer has no parameters")
    return Layout.build(entries, len(optimizer.param_groups)), params


def state_dict_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict keys that name an already-named parameter (tied weights), mapped to
    the canonical ``named_parameters`` name."""
    m = unwrap(model)
    canonical = {id(p): n for n, p in m.named_parameters()}
    return {
        k: canonical[id(t)]
        for k, t in m.state_dict(keep_vars=True).items()
        if id(t) in canonical and canonical[id(t)] != k
    }
