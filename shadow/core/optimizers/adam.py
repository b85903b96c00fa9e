"""torch.optim.Adam and AdamW: their param-group settings (:class:`AdamGroup`) and
:data:`ADAM`, their :class:`~shadow.core.optimizers.spec.OptimSpec`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shadow.core.fields import Field
from shadow.core.optimizers.spec import OptimSpec, Slot, check


@dataclass(frozen=True)
class AdamGroup:
    """One Adam/AdamW param group as its step used it; ``decoupled``: AdamW's weight decay
    (else Adam's L2 penalty added to the gradient)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled: bool

    #: the wire map's keys, in the order they are sent, and the kind of each value
    WIRE: ClassVar[dict[str, str]] = {
        "lr": "number",
        "betas": "pair",
        "eps": "number",
        "weight_decay": "number",
        "amsgrad": "flag",
        "maximize": "flag",
        "decoupled": "flag",
    }

    def to_wire(self) -> dict:
        """The map a commit record carries (``betas`` as a two-element list)."""
        return {
            "lr": self.lr,
            "betas": [self.betas[0], self.betas[1]],
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "amsgrad": self.amsgrad,
            "maximize": self.maximize,
            "decoupled": self.decoupled,
        }

    @classmethod
    def from_wire(cls, d: Any) -> AdamGroup:
        """The group of a decoded commit map; ValueError naming the key when a key is
        missing or unknown, a number is not an int or float (a bool is not), a flag is
        not a bool or ``betas`` is not a list of two numbers."""
        check(d, cls.WIRE, "Adam")
        b1, b2 = d["betas"]
        return cls(d["lr"], (b1, b2), d["eps"], d["weight_decay"], d["amsgrad"], d["maximize"], d["decoupled"])

    @classmethod
    def from_torch(cls, g: Mapping, defaults: Mapping) -> AdamGroup:
        """The settings of torch param group ``g`` (tensors already refused);
        ``defaults["decoupled"]``: the class's weight decay (AdamW's is decoupled)."""
        b1, b2 = g["betas"]
        return cls(
            lr=float(g["lr"]),
            betas=(float(b1), float(b2)),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            amsgrad=bool(g.get("amsgrad", False)),
            maximize=bool(g.get("maximize", False)),
            decoupled=bool(g.get("decoupled_weight_decay", defaults.get("decoupled", False))),
        )


ADAM = OptimSpec(
    kind="adam",
    label="Adam/AdamW",
    classes={"Adam": {"decoupled": False}, "AdamW": {"decoupled": True}},
    group=AdamGroup,
    slots=(
        Slot(Field.EXP_AVG, "exp_avg"),
        Slot(Field.EXP_AVG_SQ, "exp_avg_sq"),
        Slot(Field.MAX_EXP_AVG_SQ, "max_exp_avg_sq", present="amsgrad_any", group_flag="amsgrad"),
    ),
    desc_flags=(
        ("amsgrad_any", "amsgrad", bool),
        ("momentum_any", "momentum", lambda v: False),  # kept: the descriptor's bytes do not change
    ),
    impls=("fused", "foreach", "single"),
    cuda_candidates={
        "fused": ("cuda_fused",),
        "foreach": ("cuda_foreach", "cuda_single"),
        "single": ("cuda_single", "cuda_foreach"),
    },
    sqrt_impls=("single", "foreach"),
    has_tail=True,
    uses_powtab=True,
    tensor_refused=("lr", "betas"),
    probe_flags={"Adam": ("decoupled_weight_decay",)},
    planner_names=("adamw", "adam"),
    planner_bytes=12.0,
    kernels_at="shadow.kernels.sets:ADAM_KERNELS",
)
