"""A complete checkpoint in flat form: what every restore path produces and every
exporter consumes.

A :class:`Snapshot` holds the flat parameter and moment arrays, per-parameter step counts,
the layout, and the opaque per-rank commit blobs (RNG, scheduler, extra state) and the
chunks of the model state outside the optimizer (``trainer_hooks._extras``), all for one
iteration. It depends on no transport and no storage: memory (:mod:`shadow.restore`) and
the persisted tiers (:mod:`shadow.persist`) both build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadow.layout import Layout
from shadow.wire.frames import Field


@dataclass
class Snapshot:
    job: str
    iteration: int
    layout: Layout
    optim: dict
    world: int
    arrays: dict[Field, np.ndarray]
    steps: np.ndarray
    has_state: np.ndarray
    blobs: dict[int, bytes]
    source: str
    tier: str = "memory"
    extra: dict = field(default_factory=dict)
    generation: int = 0  # the job's lineage: a restore to an older iteration then training on starts a new one
    extras: dict = field(default_factory=dict)  # key -> chunk of model state outside the optimizer (opaque)
    # the live tensors a restore received the parameters into (layout order; see
    # shadow.restore.ParamSink), instead of arrays[Field.PARAM]; empty: they are in arrays
    placed: tuple = ()
