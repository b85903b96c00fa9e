"""What the shadow knows of one optimizer, as data: :class:`OptimSpec` (its param-group
settings, its state tensors and their wire slots, its implementations, how attach probes
it, where its kernels live) and :class:`Slot`; plus the wire checks every group type uses.

Imports neither torch nor numba: the trainer, the workers and the restore paths read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from shadow.core.fields import Field


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)  # not bool, not a string that float() would take


def _is_pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_is_number(x) for x in v)


#: what each value kind accepts, and its name in an error
_KINDS = {
    "number": (_is_number, "number"),
    "flag": (lambda v: type(v) is bool, "bool"),
    "pair": (_is_pair, "pair"),
}


def check(d: Any, schema: Mapping[str, str], what: str) -> None:
    """Raise ValueError naming the first key of ``d`` that is missing, unknown or of the
    wrong type for ``schema`` (key -> ``"number"``, ``"flag"`` or ``"pair"``)."""
    if not isinstance(d, dict):
        raise ValueError(f"a param group is not a map: {d!r:.40}")
    missing = [k for k in schema if k not in d]
    unknown = sorted(str(k) for k in d if k not in schema)
    if missing or unknown:
        parts = ([f"lacks key {missing[0]!r}"] if missing else []) + (
            [f"has unknown key {unknown[0]!r}"] if unknown else []
        )
        raise ValueError(
            f"{what} param group {' and '.join(parts)}: keys {sorted(map(str, d))}, expected {sorted(schema)}"
        )
    for key, kind in schema.items():
        ok, name = _KINDS[kind]
        if not ok(d[key]):
            raise ValueError(f"group {key} is not a {name}: {d[key]!r:.40}")


class Group(Protocol):
    """One param group's replay settings (a frozen dataclass per optimizer)."""

    #: the wire map's keys, in the order they are sent, and the kind of each value
    WIRE: ClassVar[dict[str, str]]

    def to_wire(self) -> dict: ...

    @classmethod
    def from_wire(cls, d: Any) -> Any: ...

    @classmethod
    def from_torch(cls, g: Mapping, defaults: Mapping) -> Any: ...


@dataclass(frozen=True)
class Slot:
    """One per-element state tensor: the wire ``field`` it travels in (whose lower-case
    name is its on-disk entry), its key in torch's ``optimizer.state[p]``, the descriptor
    flag without which it is not kept (None: always) and the torch group flag without
    which a parameter of that group has no such tensor (None: always)."""

    field: Field
    torch_key: str
    present: str | None = None
    group_flag: str | None = None


def _always(group: Any) -> bool:
    return True


@dataclass(frozen=True)
class OptimSpec:
    """Everything optimizer-specific, once (see :mod:`shadow.core.optimizers`)."""

    kind: str  # the descriptor's and manifest's "kind"
    label: str  # for people: "Adam/AdamW"
    #: torch.optim class names it replays -> defaults of group settings torch keeps implicit
    classes: Mapping[str, Mapping[str, Any]]
    group: type[Group]  # its settings type (to_wire / from_wire / from_torch)
    slots: tuple[Slot, ...]  # state tensors, in wire order after PARAM
    #: descriptor booleans, in the descriptor's key order: name -> (torch group key, test of its value)
    desc_flags: tuple[tuple[str, str, Callable[[Any], bool]], ...]
    impls: tuple[str, ...]  # the torch CPU implementations it replays
    cuda_candidates: Mapping[str, tuple[str, ...]]  # torch implementation -> CUDA rules to try, in order
    sqrt_impls: tuple[str, ...] = ()  # CPU implementations whose square root is the trainer's library's
    has_tail: bool = False  # the fused CPU kernel's scalar remainder rule: vec/tail widths calibrated
    uses_powtab: bool = False  # CUDA fused: beta ** k as the trainer's device computes it
    has_step: bool = True  # torch keeps state["step"]; the worker counts steps
    #: the torch state key whose presence (not None) means a parameter has state
    has_state_key: str = "step"
    keeps_state: Callable[[Any], bool] = _always  # whether a step of this group leaves state behind
    tensor_refused: tuple[str, ...] = ("lr",)  # group keys that must not be tensors
    probe_big_decay: bool = True  # attach also probes a large lr * weight decay (else only when wd != 0)
    #: group flags the probe passes on to the optimizer constructor when set, per class
    probe_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    planner_names: tuple[str, ...] = ()  # the planner's --optimizer names
    planner_bytes: float = 12.0  # fp32 bytes per parameter the shadow and a checkpoint hold
    kernels_at: str = ""  # "module:NAME" of its :class:`shadow.kernels.base.KernelSet`, imported lazily

    @property
    def all_fields(self) -> tuple[Field, ...]:
        """PARAM then every slot's field: the arrays its kernel takes, in order."""
        return (Field.PARAM, *(s.field for s in self.slots))

    def fields(self, desc: Mapping) -> tuple[Field, ...]:
        """The state arrays a descriptor keeps per element, in wire order."""
        return (Field.PARAM, *(s.field for s in self.slots if s.present is None or desc.get(s.present)))

    def torch_key(self, f: Field) -> str | None:
        """``optimizer.state[p]`` key of ``f`` (None for PARAM, the parameter itself)."""
        for s in self.slots:
            if s.field == f:
                return s.torch_key
        return None

    def state_keys(self) -> dict[Field, str]:
        return {s.field: s.torch_key for s in self.slots}

    def describe_flags(self, groups: Sequence[Mapping]) -> dict[str, bool]:
        """The descriptor's boolean keys over torch's param groups."""
        return {name: any(test(g.get(key)) for g in groups) for name, key, test in self.desc_flags}

    def groups_from_wire(self, maps: Sequence[Any]) -> list:
        return [self.group.from_wire(m) for m in maps]

    def group_from_torch(self, g: Mapping, cls_name: str) -> Any:
        return self.group.from_torch(g, self.classes.get(cls_name, {}))

    def export_keys(self, group_map: Mapping, fields: Sequence[Field]) -> list[tuple[str, Field]]:
        """``(torch state key, field)`` of a parameter of a group whose torch map is
        ``group_map``, in torch's order (after ``step``), for the kept ``fields``."""
        return [
            (s.torch_key, s.field)
            for s in self.slots
            if s.field in fields and (s.group_flag is None or group_map.get(s.group_flag))
        ]

    def kernels(self) -> Any:
        """Its :class:`shadow.kernels.base.KernelSet` (numba loads here, not before; the
        registry sits below the kernels, so it names the type without importing it)."""
        mod, _, name = self.kernels_at.partition(":")
        return getattr(importlib.import_module(mod), name)
