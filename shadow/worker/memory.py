"""How much memory a worker has free, and how much a configured session takes.

Workers report :func:`available_bytes` with every register, rejoin and heartbeat; the
coordinator refuses an attach whose ranges need more (:func:`session_bytes`) before any
worker allocates anything, and a worker checks the same estimate before it configures.
This module imports no torch and allocates nothing.
"""

from __future__ import annotations

import logging
import os

from shadow.config.tuning import Tuning
from shadow.core import optimizers
from shadow.core.optimizers import state_fields

logger = logging.getLogger(__name__)

#: per-parameter bytes of a session: step counts (8), "has state", "in range" and
#: "trainable" flags (1 each), elements in range (8)
PARAM_BYTES = 19
#: per-parameter bytes of a persistence image's metadata, and its fixed slack
#: (:class:`shadow.persist.writer.ShardPersister`)
IMAGE_PARAM_BYTES, IMAGE_SLACK = 17, 1 << 20

_CGROUP2 = "/sys/fs/cgroup"
_CGROUP1 = "/sys/fs/cgroup/memory"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo() -> int | None:
    text = _read("/proc/meminfo")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                return int(parts[1]) * (1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1)
            except (IndexError, ValueError):
                return None
    return None


def _sysconf() -> int | None:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _inactive_file(stat: str | None, key: str) -> int:
    for line in (stat or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _cgroup_free() -> int | None:
    """Room left under this process's cgroup memory limit (reclaimable file cache counts
    as free), or None without a limit."""
    limit = _read(os.path.join(_CGROUP2, "memory.max"))
    if limit is not None:
        used = _read(os.path.join(_CGROUP2, "memory.current"))
        cache = _inactive_file(_read(os.path.join(_CGROUP2, "memory.stat")), "inactive_file")
    else:
        limit = _read(os.path.join(_CGROUP1, "memory.limit_in_bytes"))
        used = _read(os.path.join(_CGROUP1, "memory.usage_in_bytes"))
        cache = _inactive_file(_read(os.path.join(_CGROUP1, "memory.stat")), "total_inactive_file")
    if limit is None or used is None or limit.strip() == "max":
        return None
    try:
        cap, cur = int(limit), int(used)
    except ValueError:
        return None
    if cap >= 1 << 60:  # cgroup v1's "no limit"
        return None
    return max(0, cap - max(0, cur - cache))


def available_bytes() -> int:
    """Bytes this process may still allocate: the host's MemAvailable (or free pages),
    capped by the cgroup limit; -1 when unknown."""
    free = _meminfo()
    if free is None:
        free = _sysconf()
    try:
        cg = _cgroup_free()
    except Exception:  # never fatal: a heartbeat calls this
        logger.debug("cgroup memory limit unreadable", exc_info=True)
        cg = None
    if cg is not None:
        free = cg if free is None else min(free, cg)
    return -1 if free is None else int(free)


def report() -> int:
    """The ``memory`` field of register, rejoin and heartbeat messages (-1: unknown)."""
    return available_bytes()


def nfields(optim: dict) -> int:
    """State arrays per element of an optimizer description (at least the parameter)."""
    try:
        return len(state_fields(optim))
    except (KeyError, TypeError, AttributeError, ValueError):
        return optimizers.max_fields()  # unknown: the largest


def session_bytes(
    size: int, fields: int | dict, nparams: int = 0, persist: bool = False, tuning: Tuning | None = None
) -> int:
    """What a worker configured for a range of ``size`` elements allocates: the state
    (``fields`` float32 arrays -- a count, or an optimizer description -- and
    per-parameter tables for ``nparams`` parameters), the gradient frames held for
    ``tuning.worker_slots`` iterations in flight, and, with a local tier (``persist``),
    ``tuning.persist_buffers`` shard images (``tuning``: the workers'; None: the environment's)."""
    tuning = tuning if tuning is not None else Tuning.load()
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
