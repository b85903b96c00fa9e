"""Model state outside the optimizer's flat space ("extras"): which state-dict entries
they are (:func:`collect`), and, at a restore, which live tensor takes which checkpointed
one (:func:`load_plan`). Capturing and sending them each commit is
:mod:`trainer_hooks.session.extras`; reading them out of a snapshot is
:mod:`shadow.export.extras`."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from shadow.core.errors import LayoutMismatchError
from trainer_hooks.capture.model import unwrap

logger = logging.getLogger(__name__)


def collect(model: torch.nn.Module, layout_params) -> tuple[OrderedDict, dict, list]:
    """``(name -> tensor, alias -> name, state-dict order)`` of ``model``'s state-dict
    entries that the flat space does not hold (layout parameters and their aliases are
    left out). Entries that cannot travel (not a strided tensor) are logged, not sent."""
    m = unwrap(model)
    held = {id(p) for p in layout_params}
    seen: dict[int, str] = {}
    out: OrderedDict = OrderedDict()
    aliases: dict[str, str] = {}
    order = []
    for name, t in m.state_dict(keep_vars=True).items():
        order.append(name)
        if isinstance(t, torch.Tensor) and id(t) in held:
            continue
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
            logger.warning(
                "state-dict entry %r (%s) is not a dense tensor: the shadow does not checkpoint it",
                name,
                type(t).__name__,
            )
            continue
        if id(t) in seen:
            aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        out[name] = t
    return out, aliases, order


def load_plan(model: torch.nn.Module, layout_params, sd_model: dict, recorded) -> list[tuple]:
    """``(live tensor, checkpointed tensor)`` for every extra of ``model``; raises
    :class:`LayoutMismatchError` (before anything is changed) when the checkpoint's
    extras (``recorded``: their names) do not match the model's. A checkpoint taken
    without extras (``recorded`` None) restores the buffers it has."""
    mine, aliases, _ = collect(model, layout_params)
    plan, problems = [], []
    if recorded is not None:
        problems += [f"{n!r} is not in this model" for n in recorded if n not in mine and n not in aliases]
    for name, t in mine.items():
        src = sd_model.get(name)
        if src is None:
            if recorded is not None:
                problems.append(f"{name!r} is missing")
            continue
        if tuple(src.shape) != tuple(t.shape) or src.dtype != t.dtype:
            problems.append(f"{name!r} is {src.dtype} {list(src.shape)} there, {t.dtype} {list(t.shape)} here")
            continue
        plan.append((t, src))
    if problems:
        raise LayoutMismatchError(
            f"the checkpoint's model state outside the optimizer does not match this model: "
            f"{'; '.join(problems[:5])}; nothing was changed"
        )
    return plan
