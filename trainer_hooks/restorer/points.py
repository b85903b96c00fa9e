"""What each optimizer was last restored to: where its next attach starts."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RestorePoint:
    """The checkpoint an optimizer was last restored to. The next attach starts there and
    tells the coordinator, which lets a run that restored from its own memory or tiers go
    on from an older iteration than it holds (e.g. after a restore fell back past a
    damaged checkpoint): what was newer is superseded. ``rng`` and ``extra_state`` are this
    rank's as checkpointed: the next attach's bootstrap records them for that iteration
    (not what the process holds then, which after ``restore(defer_rng=True)`` is not yet
    the checkpoint's)."""

    iteration: int
    job: str
    generation: int
    tier: str
    source: str
    rng: dict | None = field(default=None, compare=False, repr=False)
    extra_state: Any = field(default=None, compare=False, repr=False)
    world: int = 0  #: the ranks the checkpoint was taken with (0: not known)
    resized: bool = False  #: restored onto another world size on purpose (``resize=True``)

    def wire(self) -> dict:
        """What an attach tells the coordinator of it (``restored``)."""
        return {
            "iteration": self.iteration,
            "job": self.job,
            "generation": self.generation,
            "tier": self.tier,
            "source": self.source,
        }


#: what each optimizer was last restored to (default start of the next attach)
RESTORED: weakref.WeakKeyDictionary[torch.optim.Optimizer, RestorePoint] = weakref.WeakKeyDictionary()
