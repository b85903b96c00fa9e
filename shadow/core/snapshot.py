"""A complete checkpoint in flat form: what every restore path produces and every
exporter consumes.

A :class:`Snapshot` holds the flat parameter and moment arrays, per-parameter step counts,
the layout, and the opaque per-rank commit blobs (RNG, scheduler, extra state) and the
chunks of the model state outside the optimizer (``trainer_hooks.capture.extras``), all for one
iteration. It depends on no transport and no storage: memory (:mod:`shadow.restore`) and
the persisted tiers (:mod:`shadow.persist`) both build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadow.core.fields import Field
from shadow.core.layout import Layout


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
    # the flat element ranges the arrays hold (a fetch of one FSDP2 rank's rows); None: all
    ranges: tuple | None = None


class Assembly:
    """One snapshot put together from its shards, whatever they were read from (a tier's
    files, :func:`shadow.persist.checkpoints.load`; the workers' memory,
    :func:`shadow.restore.memory.fetch_memory`): the flat arrays are filled in place by the
    readers; each shard adds its range, steps, state flags, commit records and model-state
    chunks here, and :meth:`snapshot` checks that the shards cover the layout and every rank's
    commit record came before it makes the :class:`Snapshot`. ``error``: the exception type
    a gap raises (the caller's, so a restore path names its own failures)."""

    def __init__(self, layout: Layout, world: int, error: type[Exception]) -> None:
        self.layout, self.world, self.error = layout, world, error
        self.steps = np.zeros(len(layout.params), dtype=np.float64)
        self.has_state = np.zeros(len(layout.params), dtype=bool)
        self.blobs: dict[int, bytes] = {}
        self.extras: dict = {}
        self.covered = 0

    def add(self, lo: int, hi: int, steps, flags, blobs, extras) -> None:
        """Shard ``[lo, hi)``: ``steps`` ``(param index, step)`` pairs and ``flags`` ``(param
        index, has state)`` pairs (a parameter's own are those of the shard holding its first
        element), ``blobs`` ``(rank, commit record)`` pairs, ``extras`` a mapping of chunks."""
        params = self.layout.params
        for i, s in steps:
            if params[int(i)].offset >= lo:
                self.steps[int(i)] = s
        for i, h in flags:
            if params[int(i)].offset >= lo:
                self.has_state[int(i)] = bool(h)
        self.blobs.update(blobs)
        self.extras.update(extras)
        self.covered += hi - lo

    def snapshot(self, job: str, iteration: int, optim: dict, arrays: dict, source: str, **kw) -> Snapshot:
        """The snapshot, once the shards cover the layout and every rank's record is in
        (``kw``: :class:`Snapshot`'s other fields: ``tier``, ``generation``, ``placed``)."""
        total = self.layout.total
        if self.covered != total:
            raise self.error(f"iteration {iteration}: the shards cover {self.covered} of {total} elements")
        missing = sorted(set(range(self.world)) - set(self.blobs))
        if missing:
            raise self.error(f"iteration {iteration}: the commit records of ranks {missing} are missing")
        return Snapshot(
            job,
            iteration,
            self.layout,
            optim,
            self.world,
            arrays,
            self.steps,
            self.has_state,
            self.blobs,
            source=source,
            extras=self.extras,
            **kw,
        )
