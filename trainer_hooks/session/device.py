"""Where the trainer's tensors live, and what the shadow refuses about it: parameters
spread over several devices (the hook stages one device's reduced buckets) and a step
captured into a CUDA graph (the hook and the step hooks run host code each iteration)."""

from __future__ import annotations

from collections import defaultdict

import torch

from shadow.core.errors import ShadowUsageError

_NAMES_SHOWN = 4


def device_of(layout, params: list) -> torch.device:
    """The one device of ``params`` (named as in ``layout``); several is an error that names
    the parameters on each."""
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for spec, p in zip(layout.params, params, strict=True):
        by_device[p.device].append(spec.name)
    if len(by_device) > 1:
        parts = []
        for dev, names in sorted(by_device.items(), key=lambda kv: str(kv[0])):
            more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            parts.append(f"{dev}: {', '.join(names[:_NAMES_SHOWN])}{more}")
        raise ShadowUsageError(
            f"the optimizer's parameters are on {len(by_device)} devices ({'; '.join(parts)}); the shadow "
            "stages the reduced gradients of one device per rank: move the whole model to this rank's device "
            "(model.to(device)) before wrapping it in DistributedDataParallel and attaching"
        )
    return next(iter(by_device), torch.device("cpu"))


def capturing() -> bool:
    """Is the current CUDA stream capturing a graph (``torch.cuda.graph``)?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


CAPTURE_ERROR = (
    "the training step is being captured into a CUDA graph; the shadow runs host code at every "
    "bucket and step (staging, the commit record), which a replayed graph would skip, so nothing "
    "would be checkpointed: capture only the forward/backward of a model that is not attached, or "
    "run the attached step eagerly"
)
