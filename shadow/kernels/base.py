"""The contract between :class:`shadow.kernels.replay.ReplayPlan` and one optimizer's
kernels: a :class:`KernelSet` (named by the optimizer's spec, ``OptimSpec.kernels_at``)
sizes and fills the plan's per-segment scalar tables and runs its kernel over work rows.
Column 0 of every int table is the segment's ACTIVE flag."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from shadow.core.sqrttab import SqrtTable
    from shadow.kernels.replay import ReplayPlan


class KernelSet(Protocol):
    """One optimizer's kernels, as the plan drives them."""

    n_f: int  # float32 scalar columns per segment
    n_i: int  # int64 flag columns per segment (column 0: active)

    def rule(self, impl: str, sqrt: SqrtTable | None) -> int:
        """The rounding rule that replays torch implementation ``impl`` (ValueError: none)."""
        ...

    def setup(self, plan: ReplayPlan) -> None:
        """The static columns of ``plan.seg_i`` (tail start, rule, ...), once."""
        ...

    def fill(
        self,
        plan: ReplayPlan,
        groups: Sequence[Any],
        steps: np.ndarray,
        has_state: np.ndarray,
        skipped: set[int],
        clip: np.float32 | None,
        inv_scale: np.float32 | None,
        grad_scale: np.float32 | None,
    ) -> None:
        """The tables for one iteration: ``groups`` per param group (the spec's group type),
        ``steps`` per parameter after this iteration's increment, ``has_state`` per
        parameter before it, ``skipped`` parameters the optimizer did not step."""
        ...

    def run(
        self,
        plan: ReplayPlan,
        arrays: tuple,
        addr: np.ndarray,
        length: np.ndarray,
        work: np.ndarray,
        snaps: tuple,
        threads: bool,
    ) -> None:
        """The kernel over ``work`` rows; ``arrays`` in the spec's field order (PARAM, then
        its slots; an array not kept is empty), ``snaps`` alike (empty: no snapshot)."""
        ...

    def warm_up(self, threads: tuple[bool, ...]) -> list:
        """Run every rule's kernel once on a tiny range; returns the numba dispatchers run."""
        ...
