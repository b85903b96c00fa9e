"""The optimizer registry: one :class:`~shadow.core.optimizers.spec.OptimSpec` per
optimizer the shadow replays (:mod:`.adam`, :mod:`.sgd`, :mod:`.adamax`), and the lookups
every other module asks instead of naming an optimizer. Adding an optimizer is one module
here, its kernel module under :mod:`shadow.kernels` and an entry in :data:`SPECS`.

Imports neither torch nor numba (kernels load through :meth:`OptimSpec.kernels`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shadow.core.fields import Field
from shadow.core.optimizers.adam import ADAM, AdamGroup
from shadow.core.optimizers.adamax import ADAMAX, AdamaxGroup
from shadow.core.optimizers.sgd import SGD, SgdGroup
from shadow.core.optimizers.spec import OptimSpec, Slot

#: every optimizer this build replays, by descriptor kind (the order of messages and lists)
SPECS: dict[str, OptimSpec] = {s.kind: s for s in (ADAM, SGD, ADAMAX)}


def kinds() -> tuple[str, ...]:
    return tuple(SPECS)


def spec(kind: Any) -> OptimSpec:
    """The spec of descriptor kind ``kind``; ValueError naming the supported ones."""
    found = SPECS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ValueError(f"optimizer kind {kind!r} is not supported by this build; supported: {kinds()}")
    return found


def spec_of(desc: Mapping) -> OptimSpec:
    """The spec of an optimizer descriptor (``trainer_hooks.optim.describe.describe``)."""
    return spec(desc.get("kind"))


def state_fields(desc: Mapping) -> tuple[Field, ...]:
    """The state arrays a descriptor keeps per element, in wire order."""
    return spec_of(desc).fields(desc)


def max_fields() -> int:
    """The most state arrays per element any optimizer keeps (PARAM included)."""
    return max(len(s.all_fields) for s in SPECS.values())


def class_names() -> list[str]:
    """``torch.optim`` class names replayed, in registry order."""
    return [c for s in SPECS.values() for c in s.classes]


def for_class(name: str) -> OptimSpec | None:
    """The spec of torch.optim class ``name`` (exact name), None when none replays it."""
    return next((s for s in SPECS.values() if name in s.classes), None)


def planner_bytes() -> dict[str, float]:
    """The planner's optimizer names -> fp32 bytes per parameter."""
    return {n: s.planner_bytes for s in SPECS.values() for n in s.planner_names}


def label(kind: str) -> str:
    """A descriptor kind for people (the raw kind when unknown)."""
    s = SPECS.get(kind)
    return s.label if s is not None else str(kind)


def group_from_wire(d: Any) -> Any:
    """The group of a commit map, by its keys: the optimizer whose wire keys it has
    exactly; else checked as SGD's when it has ``momentum``, as Adam's otherwise
    (ValueError naming the key)."""
    if isinstance(d, dict):
        for s in SPECS.values():
            if set(d) == set(s.group.WIRE):
                return s.group.from_wire(d)
        if "momentum" in d:
            return SgdGroup.from_wire(d)
    return AdamGroup.from_wire(d)


__all__ = [
    "ADAM",
    "ADAMAX",
    "SGD",
    "SPECS",
    "AdamGroup",
    "AdamaxGroup",
    "OptimSpec",
    "SgdGroup",
    "Slot",
    "class_names",
    "for_class",
    "group_from_wire",
    "kinds",
    "label",
    "max_fields",
    "planner_bytes",
    "spec",
    "spec_of",
    "state_fields",
]
