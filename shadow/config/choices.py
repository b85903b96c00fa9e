"""The fixed sets of values that configs and arguments choose from, as enums.

Each member's *name* is what a user types (``persist.local.compress=zstd``,
``log_level=INFO``), which is what OmegaConf matches a config value against, and its
value is the same string: a member is a ``str``, so it compares equal to its spelling,
formats as it and travels on the wire as a plain string. :meth:`Choice.parse` takes a
member or its spelling (any case) and names the key and the choices when it is neither.
"""

from __future__ import annotations

import enum
from typing import TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A value from a fixed set (see the module docstring)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(str(m.value) for m in cls)

    @classmethod
    def hint(cls) -> str:
        """What to add to the error for a value that is none of the choices."""
        return ""

    @classmethod
    def parse(cls: type[C], value: object, key: str, hint: str = "") -> C:
        """The member ``value`` names (a member, or its spelling in any case), or a
        ``ValueError`` naming ``key``, the value and the choices (and ``hint``, default
        :meth:`hint`)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for m in cls:
                if m.value == value:
                    return m
            for m in cls:
                if str(m.value).lower() == value.lower():
                    return m
        shown = value.value if isinstance(value, enum.Enum) else value
        hint = hint or cls.hint()
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{key}={shown!r} is not one of {cls.values()}{extra}")


class Compression(Choice):
    """How a tier stores a shard: the plain image, or float bytes split into planes, then zstd."""

    none = "none"
    zstd = "zstd"


class LogLevel(Choice):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class LogFormat(Choice):
    """``text``: one line per event; ``json``: one JSON object per line."""

    text = "text"
    json = "json"

    @classmethod
    def hint(cls) -> str:
        return "json: one JSON object per line"


class Format(Choice):
    """What ``shadow restore`` writes: a torch state-dict file, a DCP directory, the
    weights as safetensors, a transformers ``Trainer`` checkpoint directory (for
    ``trainer.train(resume_from_checkpoint=...)``) or a Lightning checkpoint file (for
    ``trainer.fit(..., ckpt_path=...)``), the last two of runs the shadow recorded through
    ``trainer_hooks.integrations``."""

    torch = "torch"
    dcp = "dcp"
    safetensors = "safetensors"
    hf_trainer = "hf_trainer"
    lightning = "lightning"


class WeightFormat(Choice):
    """What ``shadow export`` writes the model weights as."""

    safetensors = "safetensors"
    torch = "torch"

    @classmethod
    def hint(cls) -> str:
        return "weights only; shadow restore writes the whole training state"


class Dtype(Choice):
    """The dtype exported weights are cast to (the shadow holds float32)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Role(Choice):
    """Who connects to a cluster, each with keys of its own (:mod:`shadow.security`): a
    worker, a trainer rank, a read-only client (status, ls, restore, export), an admin."""

    worker = "worker"
    trainer = "trainer"
    client = "client"
    admin = "admin"


#: the roles, in order
ROLES: tuple[str, ...] = Role.values()
#: the roles whose keys can be limited to named jobs (a job-scoped role): a worker serves
#: every job, and an admin's word (``shadow drop``) is over every job
SCOPED_ROLES: tuple[str, ...] = ("trainer", "client")


class Policy(Choice):
    """Back-pressure: ``block`` checkpoints every iteration and waits for a slow shadow;
    ``skip`` never waits and resyncs after falling behind."""

    block = "block"
    skip = "skip"
