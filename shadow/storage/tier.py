"""A persistence tier: a named storage with a schedule and a codec, built from the typed
:class:`~shadow.config.PersistConfig`, in the order a restore tries them (nearest first)."""

from __future__ import annotations

from dataclasses import dataclass

from shadow.config.choices import Compression
from shadow.storage.base import Storage
from shadow.storage.url import storage_for

TIER_ORDER = ("local", "remote")  # nearest first: what a restore tries, and the order tiers are listed in


@dataclass(frozen=True)
class Schedule:
    """When a tier takes a checkpoint (any due clause triggers) and how many it keeps."""

    every_n: int = 0  # iterations between checkpoints (0 = not by iterations)
    every_s: float = 0.0  # seconds between checkpoints (0 = not by time)
    every_tokens: int = 0  # tokens between checkpoints (0 = not by tokens)
    keep: int = 0  # complete checkpoints to retain (0 = keep all)

    def due(self, iteration: int, now: float, tokens: int | None, last: tuple[int, float, int | None]) -> bool:
        """Whether ``iteration`` is due, given the ``(iteration, time, tokens)`` of the
        tier's last checkpoint request."""
        last_it, last_t, last_tokens = last
        if self.every_n and iteration - last_it >= self.every_n:
            return True
        if self.every_s and now - last_t >= self.every_s:
            return True
        return bool(self.every_tokens and tokens is not None and tokens - (last_tokens or 0) >= self.every_tokens)


@dataclass(frozen=True)
class Codec:
    """How a tier stores a shard: ``none`` (the plain image) or ``zstd`` at ``level``."""

    compress: Compression = Compression.none
    level: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress", Compression.parse(self.compress, "compress"))


@dataclass(frozen=True)
class Tier:
    """One persistence tier: ``name`` (``local``, ``remote``), where it stores, when, how."""

    name: str
    storage: Storage
    schedule: Schedule
    codec: Codec

    @property
    def root(self) -> str:
        """The tier's root as configured (a path or URL)."""
        return self.storage.url


def tiers_for(persist) -> list[Tier]:
    """The enabled tiers of a :class:`~shadow.config.PersistConfig`, nearest first; a tier
    on a local file system creates its files and directories with ``persist.file_mode``
    and ``persist.dir_mode``."""
    out = []
    for name in TIER_ORDER:
        cfg = getattr(persist, name)
        if cfg.enabled:
            schedule = Schedule(cfg.every_n, cfg.every_s, cfg.every_tokens, cfg.keep)
            storage = storage_for(cfg.location, persist.file_mode, persist.dir_mode, getattr(cfg, "options", None))
            out.append(Tier(name, storage, schedule, Codec(cfg.compress, cfg.compress_level)))
    return out
