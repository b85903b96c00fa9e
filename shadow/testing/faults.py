"""Faults in the services, as wrappers around the real code (tests only).

Nothing in a service module checks for a fault: :func:`install` replaces three methods
in this process with wrappers that misbehave on cue, and :func:`uninstall` puts them back.

* ``corrupt_apply_at=k``: right after applying iteration k, a worker flips the lowest bit
  of every parameter in its range (a silent bit flip in the replica, for the audit);
* ``persist_die_at=k``: a worker writing its first checkpoint at or after iteration k
  writes half of it to the temporary file and dies (exit 137);
* ``persist_full=path``: while ``path`` exists, every plain shard write stops half way with
  ``ENOSPC``, as on a disk that fills up.

A cluster with faults is started through this package's entry point, ``python -m
shadow.testing.faulty``, which installs the faults named by ``SHADOW_FAULT_*`` variables
and spawns its workers through itself (``LocalCluster(faults=ServiceFaults(...))`` does
both); in a test process, ``with injected(ServiceFaults(...)):``. Faults on the trainer's
side are wrappers too: :mod:`trainer_hooks.testing`."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ENV = {
    "corrupt_apply_at": "SHADOW_FAULT_CORRUPT_APPLY_AT",
    "persist_die_at": "SHADOW_FAULT_PERSIST_DIE_AT",
    "persist_full": "SHADOW_FAULT_PERSIST_FULL",
}


@dataclasses.dataclass(frozen=True)
class ServiceFaults:
    corrupt_apply_at: int | None = None
    persist_die_at: int | None = None
    persist_full: str | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def env(self) -> dict[str, str]:
        """The ``SHADOW_FAULT_*`` variables that name these faults to ``shadow.testing.faulty``."""
        return {ENV[f.name]: str(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServiceFaults:
        env = os.environ if env is None else env
        got: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = env.get(var)
            if raw:
                try:
                    got[name] = raw if name == "persist_full" else int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not an iteration number") from None
        return cls(**got)


_originals: dict[tuple[Any, str], Any] = {}  # (owner, name) -> what install replaced there


def _replace(owner: Any, name: str, wrapper: Any) -> None:
    """Put ``wrapper`` in place of ``owner.name``, keeping the original for :func:`uninstall`."""
    _originals[(owner, name)] = getattr(owner, name)
    setattr(owner, name, wrapper)


def install(faults: ServiceFaults) -> None:
    """Wrap the code these faults live in (replacing any faults installed before)."""
    from shadow.persist import shardfile, writer
    from shadow.worker import state

    uninstall()
    if faults.corrupt_apply_at is not None:
        real_apply = state.ShardState.apply

        def apply(self, parts, commit, snap=None):
            done = real_apply(self, parts, commit, snap)
            if commit.get("iteration") == faults.corrupt_apply_at and self.size:
                logger.error(
                    "fault injection: flipping a bit of every parameter after iteration %d", faults.corrupt_apply_at
                )
                self.param.view(np.uint32)[:] ^= 1
            return done

        _replace(state.ShardState, "apply", apply)
    if faults.persist_die_at is not None:
        real_write = writer.ShardPersister._write

        def _write(self, img, iteration, epoch, extra):
            if iteration >= faults.persist_die_at:
                _die_mid_write(img, self.local_path(iteration))
            return real_write(self, img, iteration, epoch, extra)

        _replace(writer.ShardPersister, "_write", _write)
    if faults.persist_full is not None:
        real_write_all = shardfile._write_all
        flag = faults.persist_full

        def _write_all(fd, mv, length):
            if os.path.exists(flag):  # half of the first piece goes in, as on a disk that fills up
                os.pwrite(fd, mv[: min(length, shardfile.CHUNK) // 2 // shardfile.PAGE * shardfile.PAGE], 0)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write_all(fd, mv, length)

        _replace(shardfile, "_write_all", _write_all)


def uninstall() -> None:
    """Put back what :func:`install` replaced."""
    while _originals:
        (owner, name), real = _originals.popitem()
        setattr(owner, name, real)


@contextlib.contextmanager
def injected(faults: ServiceFaults) -> Iterator[None]:
    """These faults in this process for the duration of the block."""
    install(faults)
    try:
        yield
    finally:
        uninstall()


def _die_mid_write(image, path: str) -> None:
    """Write half the image to the temporary file, then die."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(memoryview(image.buf)[: image.size // 2])
        f.flush()
        os.fsync(f.fileno())
    logger.error("fault injection: worker dying in the middle of a checkpoint write")
    os._exit(137)
