"""A worker's shard of the training state and the replay of one iteration on it."""

from __future__ import annotations

import copy
import logging

import numpy as np

from shadow.config.tuning import Tuning
from shadow.core import optimizers
from shadow.core.layout import Layout
from shadow.core.split import replay_runs
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import ReplayPlan, segments_for_runs
from shadow.kernels.powtab import PowTable
from shadow.kernels.replay import untouched
from shadow.wire.frames import Field

logger = logging.getLogger(__name__)


class ShardState:
    """Parameters and optimizer state for flat elements ``[start, stop)``: one array per
    field of the optimizer's spec (:mod:`shadow.core.optimizers`), empty when not kept.

    Per-parameter step counts and "has state" flags are kept for the whole layout
    (only the parameters intersecting the range are meaningful).
    """

    def __init__(self, layout: Layout, start: int, stop: int, optim: dict, chunk: int | None = None) -> None:
        """``chunk``: elements per parallel work item of the replay (``Tuning.kernel_chunk_elements``;
        None: the environment's, else the default)."""
        kind = optim.get("kind")
        if kind not in optimizers.SPECS:
            raise ValueError(
                f"optimizer kind {kind!r} is not supported by this worker; supported: {optimizers.kinds()}"
            )
        n = stop - start
        self.kind = kind
        self.spec = optimizers.spec(kind)
        self.layout, self.start, self.stop = layout, start, stop
        self._fields = self.spec.fields(optim)
        #: per field of the spec, the range's values (length 0: not kept)
        self.arrays = {f: np.zeros(n if f in self._fields else 0, dtype=np.float32) for f in self.spec.all_fields}
        self.steps = np.zeros(len(layout.params), dtype=np.float64)
        self.has_state = np.zeros(len(layout.params), dtype=bool)
        # per parameter, or per rank's box of one (FSDP2, tensor parallel): the optimizer's tensors
        segs = segments_for_runs(
            replay_runs(layout, optim),
            [p.group for p in layout.params],
            start,
            stop,
            optim["impl"],
            int(optim["vec_width"]),
            int(optim["tail_width"]),
        )
        chunk = Tuning.load().kernel_chunk_elements if chunk is None else chunk
        sqrt = SqrtTable.from_wire(optim["sqrt"]) if "sqrt" in optim else None  # ValueError: malformed
        self.plan = ReplayPlan(segs, optim["impl"], chunk, kind, PowTable(optim.get("pow")), sqrt)
        self.in_range = np.zeros(len(layout.params), dtype=bool)
        self.in_range[[s.param for s in segs]] = True
        #: elements of each parameter that fall in this range
        self.param_elems = np.zeros(len(layout.params), dtype=np.int64)
        for s in segs:
            self.param_elems[s.param] += s.hi - s.lo
        self._trainable = np.asarray([p.requires_grad for p in layout.params], dtype=bool)

    def sharing(self) -> ShardState:
        """A state for a new epoch that shares this one's arrays (the values at its base) and
        plan; the per-parameter step counts and flags are its own (a bootstrap commit
        replaces them in place)."""
        other = copy.copy(self)
        other.steps, other.has_state = self.steps.copy(), self.has_state.copy()
        return other

    def fresh_arrays(self) -> None:
        """Zeroed arrays of its own in place of shared ones (see :meth:`sharing`)."""
        self.arrays = {f: np.zeros(len(a), dtype=np.float32) for f, a in self.arrays.items()}
        self.steps = np.zeros_like(self.steps)
        self.has_state = np.zeros_like(self.has_state)

    def expected_grad(self, skipped: list) -> int:
        """Elements of this range that the step of an iteration skipping ``skipped`` updates."""
        mask = self._trainable.copy()
        if skipped:
            mask[list(skipped)] = False
        return int(self.param_elems[mask].sum())

    @property
    def size(self) -> int:
        return self.stop - self.start

    def fields(self) -> tuple[Field, ...]:
        return self._fields

    def array(self, field: Field) -> np.ndarray:
        return self.arrays[field]

    @property
    def param(self) -> np.ndarray:
        return self.arrays[Field.PARAM]

    @property
    def exp_avg(self) -> np.ndarray:
        """The array in wire slot ``EXP_AVG`` (whatever the optimizer keeps there)."""
        return self.arrays[Field.EXP_AVG]

    def install_meta(self, steps: list, has_state: list) -> None:
        """Per-parameter step counts and state flags from a bootstrap commit."""
        if len(steps) != len(self.steps) or len(has_state) != len(self.has_state):
            raise ValueError("bootstrap commit carries steps for a different number of parameters")
        self.steps[:] = np.asarray(steps, dtype=np.float64)
        self.has_state[:] = np.asarray(has_state, dtype=bool)

    def apply(self, parts: list, commit: dict, snap: dict | None = None) -> bool:
        """Replay one optimizer step. ``parts``: ``(local_dst, float32 array)`` gradient
        pieces of this range in flat order (received frames, or one contiguous gradient
        at 0). ``snap``: field -> array of the range's size that also receives the new
        values (the persistence image: the snapshot is taken in the same pass). Returns
        whether ``snap`` was filled (False when the step is skipped: nothing ran).
        Raises ``ValueError`` (state untouched) when the parts overlap or leave an updated
        element without a gradient, or a group's settings are not this optimizer's."""
        skipped = set(commit["skipped"])
        if commit.get("skip_step"):
            return False
        active = self.in_range.copy()
        if skipped:
            active[list(skipped)] = False
        steps_next = self.steps + active

        def f32(key):
            v = commit.get(key)
            return None if v is None else np.float32(v)

        transforms = (f32("clip"), f32("inv_scale"), f32("grad_scale"))
        fields = self.fields()
        groups = self.spec.groups_from_wire(commit["groups"])
        self.plan.fill(groups, steps_next, self.has_state, skipped, *transforms)
        order = self.spec.all_fields
        empty = np.zeros(0, dtype=np.float32)
        snaps = tuple(snap.get(f, empty) for f in order) if snap else ()
        work = self.plan.run(tuple(self.arrays[f] for f in order), parts, snaps)
        if snap:  # what the kernel did not write (skipped or frozen parameters) is copied
            active_seg = self.plan.seg_i[:, 0] != 0
            for lo, hi in untouched(work, active_seg, self.size):
                for f in fields:
                    snap[f][lo:hi] = self.array(f)[lo:hi]
        keeps = np.asarray([self.spec.keeps_state(groups[p.group]) for p in self.layout.params], dtype=bool)
        self.has_state |= active & keeps
        if self.spec.has_step:
            self.steps = steps_next
        return bool(snap)
