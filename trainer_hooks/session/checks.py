"""Checks at the optimizer step that keep the shadow honest: the parameters are the ones
laid out at attach, and the gradients are the all-reduced ones (times the recorded
transforms) -- anything else would make the replay diverge. The gradient check runs on
the sender thread, off the step."""

from __future__ import annotations

import numpy as np

from shadow.core.errors import ShadowError


def check_layout(optimizer, layout, laid_out: list) -> None:
    """The optimizer's parameters are still ``laid_out`` (what ``layout`` was built from)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if (
        len(optimizer.param_groups) != layout.num_groups
        or len(params) != len(laid_out)
        or any(a is not b for a, b in zip(params, laid_out, strict=True))
    ):
        raise ShadowError(
            "the optimizer's parameters changed after attach (optimizer.add_param_group?); call "
            "session.add_param_group(group) instead, which re-lays out the shadow at this iteration"
        )


def check_samples(kept: list, grads, staged: dict, factors: list[float], layout, iteration: int) -> None:
    """The gradients the optimizer used must be the all-reduced ones (times the recorded
    unscale and clip ``factors``, in order): anything else would make the shadow diverge.
    Runs on the sender thread, once the copies landed. ``kept``: the probed ``(param
    index, element)``; ``grads``: their gradients as read before the step (float32, same
    order); ``staged``: ``{(param index, element): reduced value}`` as staged."""
    fs = [np.float32(f) for f in factors]
    for (pidx, elem), got in zip(kept, np.asarray(grads, dtype=np.float32).reshape(-1), strict=True):
        value = staged.get((pidx, elem))
        if value is None:
            continue  # its bucket was not staged
        want = np.float32(value)
        for f in fs:
            want = np.float32(want * f)
        if want.view(np.int32) != got.view(np.int32) and not (np.isnan(want) and np.isnan(got)):
            name = layout.params[pidx].name
            raise ShadowError(
                f"gradient of {name!r} changed between DDP's all-reduce and optimizer.step() in iteration "
                f"{iteration} ({float(want)!r} -> {float(got)!r}); the shadow cannot replay that. Clip with "
                "torch.nn.utils.clip_grad_norm_ (or session.clip_grad_norm_), once per iteration; do not scale, "
                "clamp (clip_grad_value_) or replace gradients by hand; nothing from this iteration was "
                "checkpointed"
            )
