"""How much memory a configured session takes: the one estimate the coordinator checks an
attach against (every worker's range, before any worker allocates anything) and a worker
checks again before it configures. Pure arithmetic: it reads no memory and allocates nothing
(what a worker has free is :mod:`shadow.worker.memory`)."""

from __future__ import annotations

from typing import Protocol

from shadow.core import optimizers
from shadow.core.optimizers import state_fields

#: per-parameter bytes of a session: step counts (8), "has state", "in range" and
#: "trainable" flags (1 each), elements in range (8)
PARAM_BYTES = 19
#: per-parameter bytes of a persistence image's metadata, and its fixed slack
#: (:class:`shadow.persist.writer.ShardPersister`)
IMAGE_PARAM_BYTES, IMAGE_SLACK = 17, 1 << 20


class SessionKnobs(Protocol):
    """The tuning knobs a session's size depends on (:class:`shadow.config.tuning.Tuning` has them)."""

    @property
    def worker_slots(self) -> int: ...

    @property
    def persist_buffers(self) -> int: ...


def nfields(optim: dict) -> int:
    """State arrays per element of an optimizer description (at least the parameter)."""
    try:
        return len(state_fields(optim))
    except (KeyError, TypeError, AttributeError, ValueError):
        return optimizers.max_fields()  # unknown: the largest any optimizer keeps


def session_bytes(size: int, fields: int | dict, nparams: int, persist: bool, tuning: SessionKnobs) -> int:
    """What a worker configured for a range of ``size`` elements allocates: the state
    (``fields`` float32 arrays -- a count, or an optimizer description -- and
    per-parameter tables for ``nparams`` parameters), the gradient frames held for
    ``tuning.worker_slots`` iterations in flight, and, with a local tier (``persist``),
    ``tuning.persist_buffers`` shard images (``tuning``: the workers')."""
    fields = nfields(fields) if isinstance(fields, dict) else max(1, int(fields))
    size, nparams = max(0, int(size)), max(0, int(nparams))
    state = fields * size * 4 + nparams * PARAM_BYTES
    grads = tuning.worker_slots * size * 4
    images = tuning.persist_buffers * (fields * size * 4 + nparams * IMAGE_PARAM_BYTES + IMAGE_SLACK) if persist else 0
    return state + grads + images


def human(n: int) -> str:
    """``n`` bytes in a short human form (GiB, MiB, ...)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(x) < 1024 or unit == "PiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"
