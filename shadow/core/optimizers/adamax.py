"""torch.optim.Adamax: its param-group settings (:class:`AdamaxGroup`) and :data:`ADAMAX`,
its :class:`~shadow.core.optimizers.spec.OptimSpec`. ``exp_inf`` rides in wire slot
``EXP_AVG_SQ`` (on disk: entry ``exp_avg_sq``), as SGD's momentum buffer rides in
``EXP_AVG``: no new wire id. torch has no fused Adamax; CUDA replays only where attach's
calibration finds an exact rule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shadow.core.fields import Field
from shadow.core.optimizers.spec import OptimSpec, Slot, check


@dataclass(frozen=True)
class AdamaxGroup:
    """One Adamax param group as its step used it (weight decay is an L2 penalty)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    maximize: bool

    #: the wire map's keys, in the order they are sent, and the kind of each value
    WIRE: ClassVar[dict[str, str]] = {
        "lr": "number",
        "betas": "pair",
        "eps": "number",
        "weight_decay": "number",
        "maximize": "flag",
    }

    def to_wire(self) -> dict:
        """The map a commit record carries (``betas`` as a two-element list)."""
        return {
            "lr": self.lr,
            "betas": [self.betas[0], self.betas[1]],
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "maximize": self.maximize,
        }

    @classmethod
    def from_wire(cls, d: Any) -> AdamaxGroup:
        """The group of a decoded commit map; ValueError naming the key as for
        :meth:`shadow.core.optimizers.adam.AdamGroup.from_wire`."""
        check(d, cls.WIRE, "Adamax")
        b1, b2 = d["betas"]
        return cls(d["lr"], (b1, b2), d["eps"], d["weight_decay"], d["maximize"])

    @classmethod
    def from_torch(cls, g: Mapping, defaults: Mapping) -> AdamaxGroup:
        """The settings of torch param group ``g`` (tensors already refused)."""
        b1, b2 = g["betas"]
        return cls(
            lr=float(g["lr"]),
            betas=(float(b1), float(b2)),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            maximize=bool(g.get("maximize", False)),
        )


ADAMAX = OptimSpec(
    kind="adamax",
    label="Adamax",
    classes={"Adamax": {}},
    group=AdamaxGroup,
    slots=(Slot(Field.EXP_AVG, "exp_avg"), Slot(Field.EXP_AVG_SQ, "exp_inf")),
    desc_flags=(),
    impls=("foreach", "single"),
    cuda_candidates={"foreach": ("cuda_foreach", "cuda_single"), "single": ("cuda_single", "cuda_foreach")},
    tensor_refused=("lr", "betas"),
    planner_names=("adamax",),
    planner_bytes=12.0,
    kernels_at="shadow.kernels.adamax:KERNELS_SET",
)
