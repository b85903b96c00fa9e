"""Checks at the optimizer step that keep the shadow honest: the parameters are the ones
laid out at attach, and the gradients are the all-reduced ones (times the recorded
transforms) -- anything else would make the replay diverge."""
from __future__ import annotations

import torch

from shadow.errors import ShadowError


def check_layout(optimizer, layout, laid_out: list) -> None:
    """The optimizer's parameters are still ``laid_out`` (what ``layout`` was built from)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(optimizer.param_groups) != layout.num_groups or len(params) != len(laid_out) or \
            any(a is not b for a, b in zip(params, laid_out)):
        raise ShadowError(
            "the optimizer's parameters changed after attach (optimizer.add_param_group?); call "
            "session.add_param_group(group) instead, which re-lays out the shadow at this iteration")



def check_samples(samples: list, factors: list[float], params: list, layout, iteration: int) -> None:
    """The gradients the optimizer is about to use must be the all-reduced ones (times
    the recorded unscale and clip ``factors``, in order): anything else would make the
    shadow diverge. ``samples``: ``(param index, element, reduced value)``."""
    factors = [torch.tensor(f, dtype=torch.float32) for f in factors]
    for pidx, elem, value in samples:
        grad = params[pidx].grad
        if grad is None:
            continue
        want = torch.tensor(value, dtype=torch.float32)
        for f in factors:
            want = want * f
        got = grad.detach().reshape(-1)[elem].to("cpu", torch.float32)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)) and not (got.isnan() and want.isnan()):
            name = layout.params[pidx].name
            raise ShadowError(
                f"gradient of {name!r} changed between DDP's all-reduce and optimizer.step() in iteration "
                f"{iteration} ({want.item()!r} -> {got.item()!r}); the shadow cannot replay that. Clip with "
                "session.clip_grad_norm_(...) instead of torch.nn.utils.clip_grad_norm_, and do not scale "
                "gradients by hand; nothing from this iteration was checkpointed")

