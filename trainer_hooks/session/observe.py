"""Watching the scheduler and GradScaler step without touching their state: their class is
swapped for a subclass that tells the owning attachment (``OWNERS``, an :class:`Owner`)
when they step."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

from shadow.core.errors import ShadowError
from shadow.export import blob as _codec


class Owner(Protocol):
    """What the observed scheduler and GradScaler report to (the current attachment)."""

    @property
    def next(self) -> int:
        """The iteration in progress (it moves on when the optimizer steps)."""

    def unscaled(self, inv_scale: Any) -> None:
        """The GradScaler unscaled the gradients by ``inv_scale`` (a tensor, not read)."""

    def skipped_step(self) -> None:
        """The GradScaler stepped and the optimizer did not (inf/nan gradients)."""

    def stepped(self, what: str) -> None:
        """``"scheduler"`` or ``"scaler"`` stepped."""


OWNERS: weakref.WeakKeyDictionary[Any, Owner] = weakref.WeakKeyDictionary()


@functools.cache
def observed(cls: type) -> type:
    """A subclass of a scheduler or GradScaler class that tells the owning session when
    it steps (swapped in with ``__class__``: the object's ``state_dict`` stays untouched);
    it reports to its owner in ``OWNERS``."""
    methods = _scaler_methods(cls) if hasattr(cls, "unscale_") else _scheduler_methods(cls)
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, **methods})


def _scaler_methods(cls: type) -> dict[str, Any]:
    """The observed GradScaler's ``unscale_``, ``step`` and ``update``."""

    def unscale_(self, optimizer):
        out = cls.unscale_(self, optimizer)  # torch's own checks first (a disabled scaler returns at once)
        owner = OWNERS.get(self)
        scale = getattr(self, "_scale", None)
        if owner is not None and getattr(self, "_enabled", True) and scale is not None:
            owner.unscaled(scale.double().reciprocal().float())  # read later, by the sender
        return out

    def step(self, optimizer, *args, **kwargs):
        owner = OWNERS.get(self)
        before = owner.next if owner is not None else None
        out = cls.step(self, optimizer, *args, **kwargs)
        if owner is not None and owner.next == before:
            owner.skipped_step()  # inf/nan: the optimizer did not step at all
        return out

    def update(self, *args, **kwargs):
        out = cls.update(self, *args, **kwargs)
        owner = OWNERS.get(self)
        if owner is not None:
            owner.stepped("scaler")
        return out

    return {"unscale_": unscale_, "step": step, "update": update}


def _scheduler_methods(cls: type) -> dict[str, Any]:
    """The observed scheduler's ``step``."""

    def step(self, *args, **kwargs):
        out = cls.step(self, *args, **kwargs)
        owner = OWNERS.get(self)
        if owner is not None:
            owner.stepped("scheduler")
        return out

    return {"step": step}


def watch(obj: Any, owner: Owner) -> type:
    """Swap ``obj``'s class for its observed subclass, reporting to ``owner``;
    returns the original class for :func:`unwatch`."""
    cls: type = type(obj)  # annotated: mypy does not take type[Any] for Hashable (the cache key)
    obj.__class__ = observed(cls)
    OWNERS[obj] = owner
    return cls


def unwatch(obj: Any, cls: type) -> None:
    obj.__class__ = cls
    OWNERS.pop(obj, None)


def check_scheduler(scheduler: Any) -> None:
    """The shadow records the lr each step used, so any scheduler works -- as long as its
    state can be stored for the restore."""
    if scheduler is None:
        return
    if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
        raise TypeError(
            f"scheduler must be a torch.optim.lr_scheduler scheduler (step/state_dict/load_state_dict); "
            f"got {type(scheduler).__name__}"
        )
    try:
        _codec.pack(scheduler.state_dict())
    except _codec.EncodeError as exc:
        raise ShadowError(
            f"the state of scheduler {type(scheduler).__name__} cannot be recorded ({exc}); supported: "
            "torch.optim.lr_scheduler schedulers whose state_dict holds numbers, strings, lists, dicts and "
            "tensors (plain functions in LambdaLR are fine: torch leaves them out)"
        ) from None
