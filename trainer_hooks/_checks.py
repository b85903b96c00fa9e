"""Checks at the optimizer step that keep the shadow honest: the parameters are the ones
laid out at attach, and the gradients are the all-reduced ones (times the recorded
transforms) -- anything else would make the replay diverge."""
from __future__ import annotations

import torch

from shadow.errors import ShadowError


def check_layout(session) -> None:
    params = [p for g in session.optimizer.param_groups for p in g["params"]]
    if len(session.optimizer.param_groups) != session.layout.num_groups or len(params) != len(session.params) or \
            any(a is not b for a, b in zip(params, session.params)):
        raise ShadowError(
            "the optimizer's parameters changed after attach (optimizer.add_param_group?); call "
            "session.add_param_group(group) instead, which re-lays out the shadow at this iteration")



def check_samples(session) -> None:
    """The gradients the optimizer is about to use must be the all-reduced ones (times
    the recorded clip coefficient): anything else would make the shadow diverge."""
    with session._lock:
        samples, session._samples = session._samples, []
    factors = [torch.tensor(f, dtype=torch.float32) for f in (session._inv_scale, session._clip) if f is not None]
    for pidx, elem, value in samples:
        grad = session.params[pidx].grad
        if grad is None:
            continue
        want = torch.tensor(value, dtype=torch.float32)
        for f in factors:
            want = want * f
        got = grad.detach().reshape(-1)[elem].to("cpu", torch.float32)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)) and not (got.isnan() and want.isnan()):
            name = session.layout.params[pidx].name
            raise ShadowError(
                f"gradient of {name!r} changed between DDP's all-reduce and optimizer.step() in iteration "
                f"{session._next} ({want.item()!r} -> {got.item()!r}); the shadow cannot replay that. Clip with "
                "session.clip_grad_norm_(...) instead of torch.nn.utils.clip_grad_norm_, and do not scale "
                "gradients by hand; nothing from this iteration was checkpointed")

