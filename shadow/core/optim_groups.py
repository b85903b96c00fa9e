"""A param group's replay settings: the hyperparameters one optimizer step used, as the
trainer reads them (``trainer_hooks.optim.describe.replay_groups``), as a commit record carries
them (:meth:`AdamGroup.to_wire`: a plain map, packed with msgpack) and as a worker checks
and decodes them (:meth:`AdamGroup.from_wire`) for :class:`shadow.kernels.ReplayPlan`.

Imports neither torch nor numba: the trainer and the service both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


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


def _check(d: Any, schema: dict[str, str], what: str) -> None:
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
        _check(d, cls.WIRE, "Adam")
        b1, b2 = d["betas"]
        return cls(d["lr"], (b1, b2), d["eps"], d["weight_decay"], d["amsgrad"], d["maximize"], d["decoupled"])


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
        :meth:`AdamGroup.from_wire`."""
        _check(d, cls.WIRE, "SGD")
        return cls(d["lr"], d["momentum"], d["dampening"], d["weight_decay"], d["nesterov"], d["maximize"])


def group_from_wire(d: Any) -> AdamGroup | SgdGroup:
    """An SGD group when the map has ``momentum``, else an Adam group (as checked by
    :meth:`SgdGroup.from_wire` / :meth:`AdamGroup.from_wire`)."""
    if isinstance(d, dict) and "momentum" in d:
        return SgdGroup.from_wire(d)
    return AdamGroup.from_wire(d)
