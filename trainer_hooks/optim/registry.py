"""The trainer's side of the optimizer registry (:mod:`shadow.core.optimizers`): which spec
replays a torch optimizer, its param groups' replay settings, the refusal that names what
the shadow replays, and the state tensor of a field."""

from __future__ import annotations

import torch

from shadow.core import optimizers
from shadow.core.optimizers.spec import OptimSpec
from shadow.wire.frames import Field


class UnsupportedOptimizerError(TypeError):
    """The shadow cannot replay this optimizer (or this configuration of it)."""


def supported() -> list[str]:
    """The torch optimizers the shadow replays, as people name them."""
    return [f"torch.optim.{c}" for c in optimizers.class_names()]


def unsupported(what: str) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(
        f"{what}; the shadow replays: {', '.join(supported())} "
        "(fp32, lr/betas as Python floats, capturable=False, differentiable=False)"
    )


def spec_for(optimizer: torch.optim.Optimizer) -> OptimSpec:
    """The spec replaying ``optimizer``'s exact class (a subclass may step otherwise)."""
    cls = type(optimizer)
    spec = optimizers.for_class(cls.__name__)
    if spec is None or getattr(torch.optim, cls.__name__, None) is not cls:
        raise unsupported(f"{cls.__module__}.{cls.__qualname__} is not supported")
    return spec


def replay_groups(optimizer: torch.optim.Optimizer) -> list:
    """Per-group hyperparameters exactly as the next/last step uses them (``to_wire()``
    gives each group's map in a commit record); refuses settings given as tensors."""
    spec = spec_for(optimizer)
    name = type(optimizer).__name__
    out = []
    for g in optimizer.param_groups:
        for key in spec.tensor_refused:
            v = g.get(key)
            if isinstance(v, torch.Tensor) or (
                isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)
            ):
                raise unsupported(f"{' and '.join(spec.tensor_refused)} given as tensors are not replayed")
        out.append(spec.group_from_torch(g, name))
    return out


def state_tensor(optimizer: torch.optim.Optimizer, p: torch.Tensor, f: Field, spec: OptimSpec) -> torch.Tensor | None:
    """``p`` itself for PARAM, else its state tensor in slot ``f`` (None: no state yet)."""
    key = spec.torch_key(f)
    return p.detach() if key is None else optimizer.state.get(p, {}).get(key)
