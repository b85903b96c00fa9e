"""Where checkpoints are stored: a :class:`Storage` interface with the local file system
and every fsspec back end behind it, :func:`storage_for` (the one place that tells local
from remote) and :class:`Tier` (a named storage with a schedule and a codec)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shadow.storage.base import Image, Storage
from shadow.storage.tier import TIER_ORDER, Codec, Schedule, Tier, tiers_for
from shadow.storage.url import source_tier, storage_for

if TYPE_CHECKING:
    from shadow.storage.local import LocalStorage
    from shadow.storage.remote import FsspecStorage


def __getattr__(name: str) -> Any:
    """The back ends load on first use (they load fsspec)."""
    where = {"LocalStorage": "shadow.storage.local", "FsspecStorage": "shadow.storage.remote"}.get(name)
    if where is None:
        raise AttributeError(f"module 'shadow.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)


__all__ = [
    "TIER_ORDER",
    "Codec",
    "FsspecStorage",
    "Image",
    "LocalStorage",
    "Schedule",
    "Storage",
    "Tier",
    "source_tier",
    "storage_for",
    "tiers_for",
]
