"""A worker's shard of the training state and the replay of one iteration on it."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import ModuleType

import numpy as np

from shadow.config.tuning import Tuning
from shadow.core.fields import Field, state_fields
from shadow.core.layout import Layout, replay_tensors
from shadow.core.optim_groups import AdamGroup, SgdGroup
from shadow.core.sqrttab import SqrtTable
from shadow.kernels import ReplayPlan, segments_for_range
from shadow.kernels import adam as _adam
from shadow.kernels import sgd as _sgd
from shadow.kernels.powtab import PowTable
from shadow.kernels.replay import untouched

logger = logging.getLogger(__name__)

SUPPORTED_KINDS = ("adam", "sgd")


class ShardState:
    """Parameters and Adam moments for flat elements ``[start, stop)``.

    Per-parameter step counts and "has state" flags are kept for the whole layout
    (only the parameters intersecting the range are meaningful).
    """

    def __init__(self, layout: Layout, start: int, stop: int, optim: dict, chunk: int | None = None) -> None:
        """``chunk``: elements per parallel work item of the replay (``Tuning.kernel_chunk_elements``;
        None: the environment's, else the default)."""
        kind = optim.get("kind")
        if kind not in SUPPORTED_KINDS:
            raise ValueError(f"optimizer kind {kind!r} is not supported by this worker; supported: {SUPPORTED_KINDS}")
        n = stop - start
        self.kind = kind
        self.layout, self.start, self.stop = layout, start, stop
        self.amsgrad = bool(optim.get("amsgrad_any", False))
        self.momentum = kind == "sgd" and bool(optim.get("momentum_any", False))
        self.param = np.zeros(n, dtype=np.float32)
        self.exp_avg = np.zeros(n if kind == "adam" or self.momentum else 0, dtype=np.float32)  # SGD: momentum
        self.exp_avg_sq = np.zeros(n if kind == "adam" else 0, dtype=np.float32)
        self.max_exp_avg_sq = np.zeros(n if self.amsgrad else 0, dtype=np.float32)
        self.steps = np.zeros(len(layout.params), dtype=np.float64)
        self.has_state = np.zeros(len(layout.params), dtype=bool)
        tensors = replay_tensors(layout, optim)  # per parameter, or per FSDP2 rank's piece of one
        segs = [
            dataclasses.replace(s, param=tensors[s.param][2])
            for s in segments_for_range(
                [off for off, _, _ in tensors],
                [n for _, n, _ in tensors],
                [layout.params[i].group for _, _, i in tensors],
                start,
                stop,
                optim["impl"],
                int(optim["vec_width"]),
                int(optim["tail_width"]),
            )
        ]
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
        for name in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            setattr(self, name, np.zeros(len(getattr(self, name)), dtype=np.float32))
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
        return state_fields({"kind": self.kind, "momentum_any": self.momentum, "amsgrad_any": self.amsgrad})

    def array(self, field: Field) -> np.ndarray:
        return {
            Field.PARAM: self.param,
            Field.EXP_AVG: self.exp_avg,
            Field.EXP_AVG_SQ: self.exp_avg_sq,
            Field.MAX_EXP_AVG_SQ: self.max_exp_avg_sq,
        }[field]

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
        arrays: tuple[np.ndarray, ...]
        mod: ModuleType  # the kernels' module
        sgd: list[SgdGroup] = []
        if self.kind == "sgd":
            sgd = [SgdGroup.from_wire(g) for g in commit["groups"]]
            self.plan.prepare_sgd(sgd, self.has_state, skipped, *transforms)
            arrays = (self.param, self.exp_avg)
            mod = _sgd
        else:
            adam = [AdamGroup.from_wire(g) for g in commit["groups"]]
            self.plan.prepare(adam, steps_next, skipped, *transforms)
            arrays = (self.param, self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq)
            mod = _adam
        empty = np.zeros(0, dtype=np.float32)
        snaps = (
            tuple(
                snap.get(f, empty)
                for f in (Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ, Field.MAX_EXP_AVG_SQ)[: len(arrays)]
            )
            if snap
            else ()
        )
        work = self.plan.run(mod, arrays, parts, snaps)
        if snap:  # what the kernel did not write (skipped or frozen parameters) is copied
            active_seg = self.plan.seg_i[:, 0] != 0
            for lo, hi in untouched(work, active_seg, self.size):
                for f in fields:
                    snap[f][lo:hi] = self.array(f)[lo:hi]
        if self.kind == "sgd":
            with_momentum = np.asarray([sgd[p.group].momentum != 0 for p in self.layout.params])
            self.has_state |= active & with_momentum  # torch keeps a momentum buffer only then
        else:
            self.steps = steps_next
            self.has_state |= active
        return bool(snap)
