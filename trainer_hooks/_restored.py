"""What each optimizer was last restored to: where its next attach starts."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RestorePoint:
    """The checkpoint an optimizer was last restored to. The next attach starts there and
    tells the coordinator, which lets a run that restored from its own memory or tiers go
    on from an older iteration than it holds (e.g. after a restore fell back past a
    damaged checkpoint): what was newer is superseded."""

    iteration: int
    job: str
    generation: int
    tier: str
    source: str


#: what each optimizer was last restored to (default start of the next attach)
RESTORED: weakref.WeakKeyDictionary[torch.optim.Optimizer, RestorePoint] = weakref.WeakKeyDictionary()
