"""``key=value`` overrides onto a typed config dataclass (OmegaConf, as Hydra does)."""
from __future__ import annotations

import dataclasses
from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class UsageError(ValueError):
    pass


def parse(cls: type[T], overrides: list[str]) -> T:
    """Build ``cls`` from its defaults and ``key=value`` overrides; errors name the key."""
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"argument {item!r} is not key=value; keys: {', '.join(f.name for f in dataclasses.fields(cls))}")
    try:
        base = OmegaConf.structured(cls)
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = str(exc).splitlines()[0]
        raise UsageError(f"invalid value for {key}: {msg}" if key else msg) from None
    except ValueError as exc:  # from the dataclass's own validation
        raise UsageError(str(exc)) from None
