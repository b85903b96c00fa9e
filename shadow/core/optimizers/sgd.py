"""torch.optim.SGD: its param-group settings (:class:`SgdGroup`) and :data:`SGD`, its
:class:`~shadow.core.optimizers.spec.OptimSpec`. The momentum buffer rides in wire slot
``EXP_AVG``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shadow.core.fields import Field
from shadow.core.optimizers.spec import OptimSpec, Slot, check


@dataclass(frozen=True)
class SgdGroup:
    """One SGD param group as its step used it."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    #: the wire map's keys, in the order they are sent, and the kind of each value
    WIRE: ClassVar[dict[str, str]] = {
        "lr": "number",
        "momentum": "number",
        "dampening": "number",
        "weight_decay": "number",
        "nesterov": "flag",
        "maximize": "flag",
    }

    def to_wire(self) -> dict:
        """The map a commit record carries."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "dampening": self.dampening,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
            "maximize": self.maximize,
        }

    @classmethod
    def from_wire(cls, d: Any) -> SgdGroup:
        """The group of a decoded commit map; ValueError naming the key as for
        :meth:`shadow.core.optimizers.adam.AdamGroup.from_wire`."""
        check(d, cls.WIRE, "SGD")
        return cls(d["lr"], d["momentum"], d["dampening"], d["weight_decay"], d["nesterov"], d["maximize"])

    @classmethod
    def from_torch(cls, g: Mapping, defaults: Mapping) -> SgdGroup:
        """The settings of torch param group ``g`` (tensors already refused)."""
        return cls(
            lr=float(g["lr"]),
            momentum=float(g.get("momentum", 0.0)),
            dampening=float(g.get("dampening", 0.0)),
            weight_decay=float(g.get("weight_decay", 0.0)),
            nesterov=bool(g.get("nesterov", False)),
            maximize=bool(g.get("maximize", False)),
        )


def _keeps_momentum(group: Any) -> bool:
    return group.momentum != 0  # torch keeps a momentum buffer only then


SGD = OptimSpec(
    kind="sgd",
    label="SGD",
    classes={"SGD": {}},
    group=SgdGroup,
    slots=(Slot(Field.EXP_AVG, "momentum_buffer", present="momentum_any"),),
    desc_flags=(
        ("amsgrad_any", "amsgrad", bool),  # always False: kept, the descriptor's bytes do not change
        ("momentum_any", "momentum", lambda v: v is not None and v != 0),
    ),
    impls=("fused", "foreach", "single"),
    cuda_candidates={
        "fused": ("cuda_fused",),
        "foreach": ("cuda_foreach", "cuda_single"),
        "single": ("cuda_single", "cuda_foreach"),
    },
    has_tail=True,
    has_step=False,
    has_state_key="momentum_buffer",
    keeps_state=_keeps_momentum,
    tensor_refused=("lr", "weight_decay"),
    probe_big_decay=False,
    planner_names=("sgd",),
    planner_bytes=8.0,
    kernels_at="shadow.kernels.sets:SGD_KERNELS",
)
