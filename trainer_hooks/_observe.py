"""Watching the scheduler and GradScaler step without touching their state: their class is
swapped for a subclass that tells the owning session (``OWNERS``) when they step."""
from __future__ import annotations

import functools
import weakref
from typing import Any

from shadow.errors import ShadowError
from trainer_hooks import _codec

OWNERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def observed(cls: type) -> type:
    """A subclass of a scheduler or GradScaler class that tells the owning session when
    it steps (swapped in with ``__class__``: the object's ``state_dict`` stays untouched)."""
    ns: dict = {"__module__": cls.__module__}
    if hasattr(cls, "unscale_"):  # GradScaler
        def unscale_(self, optimizer):
            session = OWNERS.get(self)
            if session is not None:
                session._inv_scale = float(self._scale.double().reciprocal().float().item())
            return cls.unscale_(self, optimizer)

        def step(self, optimizer, *args, **kwargs):
            session = OWNERS.get(self)
            before = session._next if session is not None else None
            out = cls.step(self, optimizer, *args, **kwargs)
            if session is not None and session._next == before:
                session._skipped_step()  # inf/nan: the optimizer did not step at all
            return out

        def update(self, *args, **kwargs):
            out = cls.update(self, *args, **kwargs)
            session = OWNERS.get(self)
            if session is not None:
                session._done("scaler")
            return out

        ns.update(unscale_=unscale_, step=step, update=update)
    else:
        def step(self, *args, **kwargs):
            out = cls.step(self, *args, **kwargs)
            session = OWNERS.get(self)
            if session is not None:
                session._done("scheduler")
            return out

        ns["step"] = step
    return type(cls.__name__, (cls,), ns)


def check_scheduler(scheduler: Any) -> None:
    """The shadow records the lr each step used, so any scheduler works -- as long as its
    state can be stored for the restore."""
    if scheduler is None:
        return
    if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
        raise TypeError(f"scheduler must be a torch.optim.lr_scheduler scheduler (step/state_dict/load_state_dict); "
                        f"got {type(scheduler).__name__}")
    try:
        _codec.pack(scheduler.state_dict())
    except _codec.EncodeError as exc:
        raise ShadowError(
            f"the state of scheduler {type(scheduler).__name__} cannot be recorded ({exc}); supported: "
            "torch.optim.lr_scheduler schedulers whose state_dict holds numbers, strings, lists, dicts and "
            "tensors (plain functions in LambdaLR are fine: torch leaves them out)") from None
